package events

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/backoff"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// ErrKeyReused is a command whose idempotency key an earlier, different command of the
// tenant used.
var ErrKeyReused = errors.New("events: idempotency key used by another command")

// ErrConflict is a command that kept losing its append to other writers until its time ran
// out.
var ErrConflict = errors.New("events: subject kept changing underneath")

// Config configures a Log. The zero value of each optional field is its documented default.
type Config[S any] struct {
	// Store is the schema store; its JetStream holds the stream. Required.
	Store *schema.Store
	// Kind is the service kind: a move's warm-up strategy is read from its placements, and
	// metrics are named tm_<kind>_*. Required.
	Kind string
	// Stream holds the events; it must exist. Required.
	Stream string
	// Prefix is where a tenant's events are stored: Prefix(tenant) + Event.Subject, e.g.
	// "events.<tenant>."; Prefix(tenant) + ">" matches all of them. Required.
	Prefix func(tenant string) string
	// New returns an empty state for a tenant; Apply folds one event into it (events are
	// facts: an error means a corrupt event). The state is JSON in snapshots. Required.
	New   func() S
	Apply func(state S, ev Event) error
	// Snapshots is the object store bucket of per-tenant snapshots ("": none, every load
	// replays).
	Snapshots string
	// SnapshotEvery: a tenant's snapshot is written after this many new events. Default 1000.
	SnapshotEvery int
	// Window: outcomes remembered per tenant for retries. Default 10000.
	Window int
	// Strategy used when a move does not name one, and for lazy loads. Default snapshot.
	Strategy Strategy
	// Timeout bounds one command's or read's NATS calls. Default 5s.
	Timeout time.Duration
	// MaxAttempts bounds the catch-ups before a command is rejected on state a sibling instance
	// may have moved on from. Default 5. A command that lost an append to another writer is
	// decided again until Timeout runs out, not a fixed number of times.
	MaxAttempts int
	// Logger default: discard. Registerer: where the tm_<kind>_* metrics go (nil: nowhere).
	Logger     *slog.Logger
	Registerer prometheus.Registerer
	// Metrics, if set, are used instead of NewMetrics(Registerer, Kind) (the caller registers
	// them).
	Metrics *Metrics
}

func (c Config[S]) withDefaults() (Config[S], error) {
	if c.Store == nil || c.Kind == "" || c.Stream == "" || c.Prefix == nil || c.New == nil || c.Apply == nil {
		return c, errors.New("events: Store, Kind, Stream, Prefix, New and Apply are required")
	}
	if c.SnapshotEvery <= 0 {
		c.SnapshotEvery = 1000
	}
	if c.Window <= 0 {
		c.Window = 10000
	}
	if c.Strategy == "" {
		c.Strategy = StrategySnapshot
	}
	if c.Timeout <= 0 {
		c.Timeout = 5 * time.Second
	}
	if c.MaxAttempts <= 0 {
		c.MaxAttempts = 5
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c, nil
}

// Log is the event-sourced state of the tenants this instance hosts, kept in memory per
// tenant and fenced on the stream.
type Log[S any] struct {
	cfg Config[S]
	es  *store
	m   *Metrics

	mu      sync.Mutex
	tenants map[string]*slot[S]
	base    context.Context // Run's, while it runs: the follows' parent
	follows sync.WaitGroup

	snapq chan string
	// epochOf is SetWriteEpoch's function (nil: markers fence nothing).
	epochOf atomic.Pointer[func(tenant string) uint64]
}

// slot is a tenant being loaded or loaded.
type slot[S any] struct {
	done chan struct{}
	ts   *tenant[S]
	err  error
}

// New opens the stream and the snapshot bucket.
func New[S any](ctx context.Context, cfg Config[S]) (*Log[S], error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	stream, err := cfg.Store.JS().Stream(ctx, cfg.Stream)
	if err != nil {
		return nil, fmt.Errorf("events: open %s: %w", cfg.Stream, err)
	}
	es := &store{st: cfg.Store, js: cfg.Store.JS().JetStream(), name: cfg.Stream, stream: stream, prefix: cfg.Prefix, batch: 4096}
	if cfg.Snapshots != "" {
		if es.snaps, err = cfg.Store.JS().ObjectStore(ctx, cfg.Snapshots, cfg.Kind+" service: per-tenant snapshots"); err != nil {
			return nil, fmt.Errorf("events: %w", err)
		}
	}
	m := cfg.Metrics
	if m == nil {
		m = NewMetrics(cfg.Registerer, cfg.Kind)
	}
	es.retries = m.AppendRetries
	return &Log[S]{cfg: cfg, es: es, m: m, tenants: map[string]*slot[S]{}, snapq: make(chan string, 1024)}, nil
}

// Run writes the snapshots commands queue and owns the warmed targets' follows, until ctx
// ends.
func (l *Log[S]) Run(ctx context.Context) error {
	l.mu.Lock()
	l.base = ctx
	l.mu.Unlock()
	defer func() {
		l.mu.Lock()
		l.base = nil
		l.mu.Unlock()
		l.follows.Wait()
	}()
	for {
		select {
		case tenant := <-l.snapq:
			l.writeSnapshot(ctx, tenant)
		case <-ctx.Done():
			return nil
		}
	}
}

// Result is a command's outcome: the event it stored, or with Replayed the one an earlier
// command with its key stored (then Data is nil).
type Result struct {
	Event
	Replayed bool
}

// Decide validates a command against the tenant's state and the subject's position (Version
// 0: no events yet) and returns the event to append (Type and Data; the rest is filled in),
// or an error that rejects the command.
type Decide[S any] func(state S, at Position) (Event, error)

// Execute runs one command for tenant on subject: it answers a key it has seen with the stored
// outcome, calls decide on the tenant's state and appends the event with the subject's last
// sequence expected. A lost append (another writer was first) catches the subject up and
// decides again, with a short random pause once it keeps happening, until Config.Timeout; a
// rejection is only final once the subject's last stored event is applied here. key is
// required: the message id <tenant>:<key> and the window make a retried command apply once,
// also across moves (the window is in snapshots and rebuilt from events).
func (l *Log[S]) Execute(ctx context.Context, tenant, subject, key string, decide Decide[S]) (Result, error) {
	if key == "" {
		return Result{}, errors.New("events: a command needs an idempotency key")
	}
	ctx, cancel := context.WithTimeout(ctx, l.cfg.Timeout)
	defer cancel()
	ts, err := l.tenant(ctx, tenant, "")
	if err != nil {
		return Result{}, err
	}
	ts.mu.Lock()
	defer ts.mu.Unlock()
	ts.stopFollow() // commands come to the owner: a move to here committed
	conflictPauses := conflictPolicy.Pauses()
	for attempt := 1; ; attempt++ {
		if e, ok := ts.idem.get(key); ok {
			return Result{Event: e, Replayed: true}, nil
		}
		if err := l.fenced(ts); err != nil {
			return Result{}, err
		}
		at := ts.subjects[subject]
		ev, err := decide(ts.state, at)
		if err != nil {
			// A rejection may come from state a sibling instance has moved on from: reject
			// only once this instance has the tenant's last event.
			if fresh, ferr := ts.fresh(ctx, l.es); ferr != nil {
				return Result{}, ferr
			} else if !fresh && attempt < l.cfg.MaxAttempts {
				if err := ts.catchUp(ctx, l.es); err != nil {
					return Result{}, err
				}
				continue
			}
			return Result{}, err
		}
		ev.Subject, ev.Key, ev.Version = subject, key, at.Version+1
		seq, dup, err := l.es.append(ctx, tenant, ev, ts.contig)
		if err == nil && !dup {
			ev.Seq = seq
			if err := ts.add(ev); err != nil {
				return Result{}, err
			}
			ts.contig = seq // the append expected contig as the tenant's last event: nothing came between
			l.afterAppend(ts)
			return Result{Event: ev}, nil
		}
		if err != nil && !errors.Is(err, ErrStale) {
			return Result{}, err
		}
		if dup {
			// This command is already stored (an earlier attempt whose answer was lost, or a
			// sibling instance's): read the tenant's events so the window knows its outcome, up
			// to the stored command's own sequence (the duplicate's ack names it). Not up to the
			// newest a direct read reports: a replica behind (a NATS node just restarted) may
			// answer that, miss the command, and make it look like another one's key (the
			// upgrade test found it: 409 key reused for a retried deposit).
			var err error
			if seq > ts.contig {
				err = ts.catchUpTo(ctx, l.es, seq)
			} else {
				err = ts.catchUp(ctx, l.es)
			}
			if err != nil {
				return Result{}, err
			}
			if _, ok := ts.idem.get(key); !ok {
				return Result{}, fmt.Errorf("%w: %q; use a new key per command", ErrKeyReused, key)
			}
			continue
		}
		// Another writer appended to the tenant first (a sibling instance, or a takeover's
		// epoch marker): learn what it wrote, decide again (unless it fenced this instance),
		// after a short random pause once it keeps happening (writers in lockstep).
		l.m.Conflicts.Inc()
		if attempt > 2 && !conflictPauses.Wait(ctx) {
			return Result{}, fmt.Errorf("%w: %s kept changing for %s (%d attempts); retry the command", ErrConflict, tenant, l.cfg.Timeout, attempt)
		}
		if err := ts.catchUp(ctx, l.es); err != nil {
			return Result{}, err
		}
	}
}

// SetWriteEpoch tells the Log at which epoch this instance may write each tenant (shardkit's
// Shard.WriteEpoch: the epoch it owns the tenant at, 0 when it does not). A tenant whose
// events hold an epoch marker newer than that is fenced: its commands and reads fail with
// schema.ErrFenced, so a former owner that was taken over (it was frozen, or cut off from
// NATS, or its view of placement is behind) writes nothing after the marker and answers no
// read from state the new owner may have changed. Without it (nil) markers are applied but
// nothing is fenced by them. Call it before the Log serves requests.
func (l *Log[S]) SetWriteEpoch(fn func(tenant string) uint64) {
	if fn == nil {
		l.epochOf.Store(nil)
		return
	}
	l.epochOf.Store(&fn)
}

// fenced is schema.ErrFenced if a takeover's marker fenced this instance for ts. Caller holds
// ts.mu.
func (l *Log[S]) fenced(ts *tenant[S]) error {
	fn := l.epochOf.Load()
	if fn == nil || ts.epoch == 0 {
		return nil
	}
	e := (*fn)(ts.name)
	switch {
	case e >= ts.epoch:
		return nil
	case e == 0:
		return fmt.Errorf("%w: this instance does not own %s; it was taken over at epoch %d", schema.ErrFenced, ts.name, ts.epoch)
	}
	return fmt.Errorf("%w: this instance owns %s at epoch %d; it was taken over at epoch %d", schema.ErrFenced, ts.name, e, ts.epoch)
}

// Takeover fences the tenant's former owner on the stream for a takeover at epoch (the new
// owner's): it stores the tenant's epoch marker, after which no append that expects an earlier
// last event succeeds, and returns the marker's sequence: the fence this instance then warms
// up to (Warm), so it holds every write the former owner made before the fence. Instances of
// the new owner may all call it; the marker is stored once per epoch. shardkit's Takeover hook.
func (l *Log[S]) Takeover(ctx context.Context, tenant string, epoch uint64) (uint64, error) {
	ctx, cancel := context.WithTimeout(ctx, l.cfg.Timeout)
	defer cancel()
	seq, err := l.es.writeEpoch(ctx, tenant, epoch)
	if err != nil {
		return 0, fmt.Errorf("events: takeover of %s at epoch %d: %w", tenant, epoch, err)
	}
	l.cfg.Logger.Info("takeover: the former owner's writes are fenced", "tenant", tenant, "epoch", epoch, "fence", seq)
	return seq, nil
}

// conflictPolicy is the random pauses before deciding again after the third and later lost
// appends: up to 1 ms, doubling to 32 ms.
var conflictPolicy = backoff.Policy{Initial: time.Millisecond, Max: 32 * time.Millisecond}

func (l *Log[S]) afterAppend(ts *tenant[S]) {
	if ts.sinceSnap < l.cfg.SnapshotEvery || l.es.snaps == nil {
		return
	}
	ts.sinceSnap = 0
	select {
	case l.snapq <- ts.name:
	default: // a snapshot is late, not lost: the next threshold queues it again
	}
}

// Read calls fn with the tenant's state once the subject's events (its siblings' writes
// included) are applied, or with subject "" once all of the tenant's are, with the sequence
// every event is applied up to. fn must not keep the state past its return. It takes up to
// Config.Timeout, four times that for a whole tenant.
func (l *Log[S]) Read(ctx context.Context, tenant, subject string, fn func(state S, applied uint64) error) error {
	bound := l.cfg.Timeout
	if subject == "" {
		bound *= 4
	}
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	ts, err := l.tenant(ctx, tenant, "")
	if err != nil {
		return err
	}
	ts.mu.Lock()
	defer ts.mu.Unlock()
	if subject == "" {
		err = ts.catchUp(ctx, l.es)
	} else {
		err = ts.catchUpSubject(ctx, l.es, subject)
	}
	if err != nil {
		return err
	}
	if err := l.fenced(ts); err != nil {
		return err
	}
	return fn(ts.state, ts.contig)
}

// tenant returns the tenant's state, loading it (once, however many callers ask) if needed.
func (l *Log[S]) tenant(ctx context.Context, name string, strategy Strategy) (*tenant[S], error) {
	l.mu.Lock()
	sl := l.tenants[name]
	if sl == nil {
		sl = &slot[S]{done: make(chan struct{})}
		l.tenants[name] = sl
		l.mu.Unlock()
		if strategy == "" {
			strategy = l.cfg.Strategy
		}
		ts, rep, err := load(ctx, l.es, &l.cfg, name, strategy)
		sl.ts, sl.err = ts, err
		close(sl.done)
		if err != nil {
			l.mu.Lock()
			if l.tenants[name] == sl {
				delete(l.tenants, name)
			}
			l.mu.Unlock()
			return nil, err
		}
		l.m.observeLoad(rep)
		l.cfg.Logger.Info("tenant loaded", "tenant", name, "strategy", rep.Strategy, "snapshot_hit", rep.SnapshotHit,
			"replayed", rep.Replayed, "took", rep.Took.Round(time.Millisecond))
		return ts, nil
	}
	l.mu.Unlock()
	select {
	case <-sl.done:
		return sl.ts, sl.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (l *Log[S]) loaded(name string) *tenant[S] {
	l.mu.Lock()
	defer l.mu.Unlock()
	sl := l.tenants[name]
	if sl == nil {
		return nil
	}
	select {
	case <-sl.done:
		return sl.ts
	default:
		return nil
	}
}

func (l *Log[S]) writeSnapshot(ctx context.Context, tenant string) {
	ts := l.loaded(tenant)
	if ts == nil || l.es.snaps == nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ts.mu.Lock()
	// Catch up first, so the snapshot's applied sequence covers everything before it.
	err := ts.catchUp(ctx, l.es)
	snap := ts.snapshot()
	var b []byte
	if err == nil {
		b, err = json.Marshal(snap) // under the lock: the state is shared
	}
	ts.mu.Unlock()
	if err != nil {
		l.cfg.Logger.Warn("snapshot skipped", "tenant", tenant, "err", err)
		return
	}
	if err := l.es.saveSnapshot(ctx, tenant, b); err != nil {
		l.cfg.Logger.Warn("snapshot failed", "tenant", tenant, "err", err)
		return
	}
	l.m.SnapshotBytes.Set(float64(len(b)))
	ts.snapBytes.Store(uint64(len(b)))
	l.cfg.Logger.Debug("snapshot written", "tenant", tenant, "applied", snap.Applied, "bytes", len(b))
}

// Hooks are the Log's part of shardkit's move protocol: Warm, Applied, Fence, Release and
// Takeover.
func (l *Log[S]) Hooks() shardkit.Hooks {
	return shardkit.Hooks{Warm: l.Warm, Applied: l.Applied, Fence: l.Fence, Release: l.Release, Sizes: l.Sizes, Takeover: l.Takeover}
}

// Warm loads tenant (with the move's strategy, else the default) and catches it up until its
// applied sequence reaches fence; with fence 0 (a move's warming phase) it then follows the
// tenant's events until the handoff names the fence or the tenant's first command here.
func (l *Log[S]) Warm(ctx context.Context, tenant string, fence uint64) error {
	strategy := l.cfg.Strategy
	if l.loaded(tenant) == nil { // the strategy only matters for a load
		if p, err := l.cfg.Store.Placements(l.cfg.Kind).Get(ctx, tenant); err == nil && p.Strategy != "" {
			strategy = Strategy(p.Strategy)
		}
	}
	ts, err := l.tenant(ctx, tenant, strategy)
	if err != nil {
		return err
	}
	ts.mu.Lock()
	defer ts.mu.Unlock()
	for {
		if ts.unfollow == nil || fence == 0 {
			if err := ts.catchUp(ctx, l.es); err != nil {
				return err
			}
		}
		if fence == 0 {
			l.follow(ts) // warm now; stay so until the handoff names the fence
			return nil
		}
		if ts.contig >= fence {
			return nil
		}
		// The fence names an event not applied yet: wait for the follow, or poll the stream.
		advanced := ts.advanced
		ts.mu.Unlock()
		t := time.NewTimer(50 * time.Millisecond)
		select {
		case <-advanced:
		case <-t.C:
		case <-ctx.Done():
		}
		t.Stop()
		ts.mu.Lock()
		if ctx.Err() != nil {
			return fmt.Errorf("events: warming %s reached %d of fence %d: %w", tenant, ts.contig, fence, ctx.Err())
		}
	}
}

// Applied is the tenant's contiguous applied sequence (0 if not loaded).
func (l *Log[S]) Applied(tenant string) uint64 {
	ts := l.loaded(tenant)
	if ts == nil {
		return 0
	}
	ts.mu.Lock()
	defer ts.mu.Unlock()
	return ts.contig
}

// Fence is the sequence a move's target must reach: the tenant's newest event in the stream
// (its siblings' writes included). shardkit calls it on the source after the tenant's in-flight
// commands finished, so nothing this instance accepted can come after it. One read from the
// stream leader (a replica's direct get could miss the last appends); if that fails, the
// instance catches the tenant up and answers its applied sequence instead.
func (l *Log[S]) Fence(tenant string) uint64 {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	last, err := l.es.lastSeq(ctx, l.es.tenantFilter(tenant))
	if err == nil {
		return last
	}
	l.cfg.Logger.Warn("fence: reading the tenant's last event failed; catching up instead", "tenant", tenant, "err", err)
	ts := l.loaded(tenant)
	if ts == nil {
		return 0
	}
	ts.mu.Lock()
	defer ts.mu.Unlock()
	if err := ts.catchUp(ctx, l.es); err != nil {
		l.cfg.Logger.Warn("fence: catch-up failed", "tenant", tenant, "err", err)
	}
	return ts.contig
}

// Release writes the tenant's final snapshot (so its next owner loads it) and drops it from
// memory.
func (l *Log[S]) Release(ctx context.Context, tenant string) error {
	if ts := l.loaded(tenant); ts != nil {
		ts.mu.Lock()
		ts.stopFollow()
		ts.mu.Unlock()
	}
	l.writeSnapshot(ctx, tenant)
	l.mu.Lock()
	delete(l.tenants, tenant)
	l.mu.Unlock()
	return nil
}

// Size describes a tenant for the choice of a warm-up strategy.
type Size struct {
	Tenant        string `json:"tenant"`
	Events        uint64 `json:"events"`
	SnapshotSeq   uint64 `json:"snapshot_seq"`
	SnapshotBytes int    `json:"snapshot_bytes"`
	// Subjects is how many subjects the snapshot holds.
	Subjects int `json:"subjects"`
	// Suggested is the cheaper strategy: replay when there is no snapshot or it covers little.
	Suggested Strategy `json:"suggested"`
}

// TenantSize reports a tenant's size in events and snapshot.
func (l *Log[S]) TenantSize(ctx context.Context, tenant string) (Size, error) {
	n, err := l.es.count(ctx, tenant)
	if err != nil {
		return Size{}, err
	}
	sz := Size{Tenant: tenant, Events: n, Suggested: StrategyReplay}
	if snap, bytes, err := loadSnapshot(ctx, l.es, tenant, l.cfg.New); err == nil && snap != nil {
		sz.SnapshotSeq, sz.SnapshotBytes, sz.Subjects = snap.Applied, bytes, len(snap.Subjects)
		if n > 1000 {
			sz.Suggested = StrategySnapshot
		}
	}
	return sz, nil
}

// Sizes are the stored sizes of the tenants in memory: their events and bytes, counted as
// they are applied (no NATS round trip), and the size of the snapshot last loaded or written.
// shardkit's Sizes hook.
func (l *Log[S]) Sizes() []schema.TenantSize {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]schema.TenantSize, 0, len(l.tenants))
	for name, sl := range l.tenants {
		select {
		case <-sl.done:
		default:
			continue // loading
		}
		if ts := sl.ts; ts != nil {
			out = append(out, schema.TenantSize{Tenant: name, Events: ts.events.Load(), EventBytes: ts.bytes.Load(), SnapshotBytes: ts.snapBytes.Load()})
		}
	}
	return out
}

// Hosted lists the tenants in memory.
func (l *Log[S]) Hosted() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]string, 0, len(l.tenants))
	for t := range l.tenants {
		out = append(out, t)
	}
	return out
}

// Following reports whether a warmed move target follows the tenant's events (until its first
// command, its release or 5 minutes).
func (l *Log[S]) Following(tenant string) bool {
	ts := l.loaded(tenant)
	if ts == nil {
		return false
	}
	ts.mu.Lock()
	defer ts.mu.Unlock()
	return ts.unfollow != nil
}

// Append is the single-writer fence on its own: it stores ev for tenant on ev.Subject if the
// tenant's last stored event (on any subject) is still expectLast (0: none), with ev.Key as
// the message id.
// ErrStale says another writer appended first; dup that the key was stored before. Execute
// uses it; call it directly only to write outside the Log's state (imports, tests).
func (l *Log[S]) Append(ctx context.Context, tenant string, ev Event, expectLast uint64) (seq uint64, dup bool, err error) {
	return l.es.append(ctx, tenant, ev, expectLast)
}

// Replay calls fn with tenant's events on subject ("": all of them) after sequence after, in
// order, up to the last one stored when it started. Versions are not set.
func (l *Log[S]) Replay(ctx context.Context, tenant, subject string, after uint64, fn func(Event) error) (uint64, error) {
	filter := l.es.tenantFilter(tenant)
	if subject != "" {
		filter = l.es.subject(tenant, subject)
	}
	return l.es.replay(ctx, tenant, filter, after, fn)
}
