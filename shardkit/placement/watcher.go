// Package placement keeps tenant placement in memory from NATS KV, for the gateway, the shards
// and the rebalancer.
//
// # Overview
//
// A [Watcher] follows the tm_placement_<kind> bucket of one or more kinds. It is ready once the
// initial values are in; after that [Watcher.Lookup] answers from memory, without a lock and
// without allocating. Every change is applied in revision order, exactly once, and survives the
// server restarting or the cluster node holding the watch dying (see package kvwatch): the
// watcher resumes from the last revision it applied.
//
// At start a watcher loads the kind's compacted snapshot from the tm_snapshots object store, if
// one exists, and follows the bucket from the snapshot's revision; a watcher configured with
// Compact writes those snapshots. Values that cannot be decoded are logged, counted and skipped.
package placement

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/backoff"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
	"github.com/tenantmesh/tenantmesh/shardkit/kvwatch"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Change is one applied placement change. OldOK/NewOK are false when the tenant had or has no
// placement.
type Change struct {
	Kind, Tenant string
	Old, New     Entry
	OldOK, NewOK bool
	// Move is the move workflow of a handoff (New.Phase handoff; "" otherwise), which the
	// table does not keep: the target's commit carries it on, without reading the record.
	Move string
}

// Config configures a Watcher.
type Config struct {
	Store *schema.Store
	// Kinds to follow; each must be registered.
	Kinds []string
	// Heartbeat of the underlying consumers; a dead watch is replaced within twice this.
	// Default 500ms.
	Heartbeat time.Duration
	// NoSnapshot skips loading the compacted snapshot at start.
	NoSnapshot bool
	// Compact makes this watcher write compacted snapshots (run it in one process, such as the
	// rebalancer leader). CompactEvery is the number of changes since the last snapshot that
	// triggers a new one, checked every CompactInterval. Defaults 10000 and 30s.
	Compact         bool
	CompactEvery    int
	CompactInterval time.Duration
	// OnChange, if set, is called after each change of a tenant's routing data (not for
	// revisions that change nothing it keeps), in revision order, on the kind's apply
	// goroutine: keep it short. A placement bucket keeps one revision per key, so a revision
	// overwritten before the watcher read it is never seen: a quick handoff may show as
	// warming -> draining. Whatever must not be missed is made causal by the move protocol (a
	// move commits only after its source and target reported seeing the handoff). It may call the watcher's methods. It is also called for every
	// placement of the initial load (Old not OK), but not for those loaded from a snapshot: use
	// Range after Ready for a complete view.
	OnChange func(Change)
	// Confirm, if set, makes the watcher confirm this often that it has applied every
	// placement write acknowledged before: it asks each kind's placement stream leader for the
	// stream's last sequence and waits (up to Confirm) until it has applied that revision.
	// Confirmed then tells when the newest such question was asked. A shard serves its tenants
	// only while that is recent (its lease): cut off from NATS, frozen, or behind, it stops.
	Confirm time.Duration
	// Logger; if nil, logs are discarded.
	Logger *slog.Logger
	// Registerer, if set, receives the watcher's metrics.
	Registerer prometheus.Registerer
}

// Watcher keeps placements of several kinds in memory.
type Watcher struct {
	cfg   Config
	kinds map[string]*kindState // fixed at New

	ready      chan struct{}
	readyOnce  sync.Once
	discSince  atomic.Int64 // unix ns of the connection's last disconnect, 0 while connected
	metrics    *metrics
	pendingSyn atomic.Int32

	subMu sync.Mutex                    // serialises Subscribe's copy-on-write
	subs  atomic.Pointer[[]*subscriber] // nil when none
}

type kindState struct {
	w    *Watcher
	kind string
	t    atomic.Pointer[table]
	f    atomic.Pointer[kvwatch.Follower] // set by Run's start; nil before

	mu        sync.Mutex // held by the writer while applying; by snapshots while encoding
	rev       uint64     // last revision applied (under mu)
	changes   int        // changes since the last snapshot (under mu)
	corrupt   atomic.Uint64
	synced    chan struct{}
	syncOnce  sync.Once
	snapRev   atomic.Uint64 // the revision of the snapshot loaded at start (0: none)
	startedAt time.Time
	// confirmed is when (monoNow) the newest confirmation that held was asked; 0: never.
	confirmed atomic.Int64
	// applied counts the changes applied (a View's Changes), each once the table holds it.
	applied atomic.Uint64
	// live: the follower caught up once (Synced); changes applied since are observed as they
	// arrive.
	live atomic.Bool
}

// New makes a watcher; it follows nothing until Run.
func New(cfg Config) (*Watcher, error) {
	if cfg.Store == nil || len(cfg.Kinds) == 0 {
		return nil, errors.New("placement: Store and at least one kind are required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.CompactEvery <= 0 {
		cfg.CompactEvery = 10000
	}
	if cfg.CompactInterval <= 0 {
		cfg.CompactInterval = 30 * time.Second
	}
	w := &Watcher{cfg: cfg, kinds: map[string]*kindState{}, ready: make(chan struct{})}
	for _, k := range cfg.Kinds {
		if err := schema.CheckName("kind", k); err != nil {
			return nil, err
		}
		ks := &kindState{w: w, kind: k, synced: make(chan struct{})}
		ks.t.Store(newTable(0))
		w.kinds[k] = ks
	}
	w.pendingSyn.Store(int32(len(w.kinds)))
	w.metrics = newMetrics(w, cfg.Registerer)
	return w, nil
}

// Lookup returns the placement of tenant for kind. It takes no lock and allocates nothing.
func (w *Watcher) Lookup(kind, tenant string) (Entry, bool) {
	ks := w.kinds[kind]
	if ks == nil {
		return Entry{}, false
	}
	return ks.t.Load().lookup(tenant)
}

// View is one kind of a Watcher, for a caller that asks about that kind only (a shard's gate):
// the Watcher's answers without finding the kind each time. The zero View knows nothing.
type View struct{ ks *kindState }

// View returns kind's view (the zero View if the watcher does not follow kind).
func (w *Watcher) View(kind string) View { return View{w.kinds[kind]} }

// Lookup is Watcher.Lookup for the view's kind.
func (v View) Lookup(tenant string) (Entry, bool) {
	if v.ks == nil {
		return Entry{}, false
	}
	return v.ks.t.Load().lookup(tenant)
}

// Changes counts the changes the view applied so far: equal counts read before a Lookup and
// after mean the entry it returned is still current.
func (v View) Changes() uint64 {
	if v.ks == nil {
		return 0
	}
	return v.ks.applied.Load()
}

// Confirmed is Watcher.Confirmed for the view's kind.
func (v View) Confirmed() (time.Duration, bool) {
	if v.ks == nil {
		return 0, false
	}
	c := v.ks.confirmed.Load()
	if c == 0 {
		return 0, false
	}
	return time.Duration(monoNow() - c), true
}

// ConfirmedAt is Confirmed at now (a time.Now reading, which carries the monotonic clock), for
// a caller that read the clock anyway.
func (v View) ConfirmedAt(now time.Time) (time.Duration, bool) {
	if v.ks == nil {
		return 0, false
	}
	c := v.ks.confirmed.Load()
	if c == 0 {
		return 0, false
	}
	return time.Duration(int64(now.Sub(monoBase)) + 1 - c), true
}

// Range calls fn for every placement of kind until fn returns false, without locking out the
// writer: use it to build a service's owned set at start (OnChange is not called for
// placements loaded from a snapshot).
func (w *Watcher) Range(kind string, fn func(tenant string, e Entry) bool) {
	if ks := w.kinds[kind]; ks != nil {
		ks.t.Load().rangeAll(fn)
	}
}

// Takeovers calls fn for every placement of kind in a takeover until fn returns false, in no
// particular order. The watcher keeps the set of them as it applies changes, so a look costs
// their number, not the kind's placements (nothing while there is none).
func (w *Watcher) Takeovers(kind string, fn func(tenant string, e Entry) bool) {
	ks := w.kinds[kind]
	if ks == nil {
		return
	}
	t := ks.t.Load()
	for _, tenant := range t.heldTenants() {
		if e, ok := t.lookup(tenant); ok && e.Phase == schema.PhaseTakeover && !fn(tenant, e) {
			return
		}
	}
}

// Has reports whether the watcher follows kind.
func (w *Watcher) Has(kind string) bool { return w.kinds[kind] != nil }

// Ready is closed once every kind's initial values are in.
func (w *Watcher) Ready() <-chan struct{} { return w.ready }

// WaitReady waits for Ready or ctx.
func (w *Watcher) WaitReady(ctx context.Context) error {
	select {
	case <-w.ready:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("placement: waiting for initial values: %w", ctx.Err())
	}
}

// KindStats describe one kind's follower.
type KindStats struct {
	Kind       string
	Placements int
	Revision   uint64
	Corrupt    uint64
	Resumes    uint64
	Gaps       uint64
	Synced     bool
	// SnapshotRevision is the revision of the snapshot loaded at start (0: none).
	SnapshotRevision uint64
}

// Stats returns per-kind figures.
func (w *Watcher) Stats(kind string) (KindStats, bool) {
	ks := w.kinds[kind]
	if ks == nil {
		return KindStats{}, false
	}
	st := KindStats{Kind: kind, Corrupt: ks.corrupt.Load(), SnapshotRevision: ks.snapRev.Load()}
	if f := ks.f.Load(); f != nil {
		fs := f.Stats()
		st.Revision, st.Resumes, st.Gaps, st.Synced = fs.Revision, fs.Resumes, fs.Gaps, fs.Synced
	}
	ks.mu.Lock()
	st.Placements = ks.t.Load().len()
	if ks.rev > st.Revision {
		st.Revision = ks.rev
	}
	ks.mu.Unlock()
	return st, true
}

// Revision is the last revision applied for kind.
func (w *Watcher) Revision(kind string) uint64 {
	st, _ := w.Stats(kind)
	return st.Revision
}

// ShardCounts returns the number of tenants each shard of kind owns.
func (w *Watcher) ShardCounts(kind string) map[string]int {
	ks := w.kinds[kind]
	if ks == nil {
		return nil
	}
	return ks.t.Load().shardCounts()
}

// Staleness is how long the watcher has been cut off from NATS (0 while it follows). While it
// is cut off, lookups answer from the last snapshot: static stability.
func (w *Watcher) Staleness() time.Duration {
	since := w.discSince.Load()
	for _, ks := range w.kinds {
		f := ks.f.Load()
		if f == nil {
			continue
		}
		if ds := f.Stats().DownSince; !ds.IsZero() && (since == 0 || ds.UnixNano() < since) {
			since = ds.UnixNano()
		}
	}
	if since == 0 {
		return 0
	}
	return time.Since(time.Unix(0, since))
}

// Run follows every kind until ctx ends. It returns an error only if it cannot start.
func (w *Watcher) Run(ctx context.Context) error {
	nc := w.cfg.Store.JS().Conn()
	status := nc.StatusChanged(nats.CONNECTED, nats.DISCONNECTED, nats.RECONNECTING, nats.CLOSED)
	defer nc.RemoveStatusListener(status)
	if !nc.IsConnected() {
		w.discSince.Store(time.Now().UnixNano())
	}
	var wg sync.WaitGroup
	for _, ks := range w.kinds {
		if err := ks.start(ctx); err != nil {
			return err
		}
		wg.Go(func() { _ = ks.f.Load().Run(ctx) })
		if w.cfg.Confirm > 0 {
			wg.Go(func() { ks.confirmLoop(ctx) })
		}
		if w.cfg.Compact {
			wg.Go(func() { ks.compactLoop(ctx) })
		}
	}
	for {
		select {
		case st := <-status:
			if st == nats.CONNECTED {
				w.discSince.Store(0)
			} else {
				w.discSince.CompareAndSwap(0, time.Now().UnixNano())
			}
		case <-ctx.Done():
			wg.Wait()
			return nil
		}
	}
}

// start loads the kind's snapshot, if any, and makes its follower.
func (ks *kindState) start(ctx context.Context) error {
	w := ks.w
	ks.startedAt = time.Now()
	var after uint64
	if !w.cfg.NoSnapshot {
		t, rev, err := ks.loadSnapshot(ctx)
		switch {
		case err != nil:
			w.cfg.Logger.Warn("ignoring placement snapshot", "kind", ks.kind, "err", err)
		case t != nil:
			ks.t.Store(t)
			ks.applied.Add(1)
			ks.mu.Lock()
			ks.rev, after = rev, rev
			ks.mu.Unlock()
			ks.snapRev.Store(rev)
			w.cfg.Logger.Info("loaded placement snapshot", "kind", ks.kind, "revision", rev, "placements", t.len(), "took", time.Since(ks.startedAt).Round(time.Millisecond))
		}
	}
	f, err := kvwatch.New(kvwatch.Config{
		JS:        w.cfg.Store.JS().JetStream(),
		Bucket:    schema.PlacementBucket(ks.kind),
		After:     after,
		Heartbeat: w.cfg.Heartbeat,
		Logger:    w.cfg.Logger.With("kind", ks.kind),
	}, ks)
	if err != nil {
		return err
	}
	ks.f.Store(f)
	return nil
}

// loadSnapshot fetches and decodes the kind's snapshot; (nil, 0, nil) if there is none or it
// does not fit the bucket's current stream.
func (ks *kindState) loadSnapshot(ctx context.Context) (*table, uint64, error) {
	st := ks.w.cfg.Store
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	obs, err := st.Snapshots(ctx)
	if err != nil {
		return nil, 0, err
	}
	data, err := obs.GetBytes(ctx, schema.SnapshotObject(ks.kind))
	if errors.Is(err, jetstream.ErrObjectNotFound) {
		return nil, 0, nil
	}
	if err != nil {
		return nil, 0, err
	}
	t, rev, err := decodeSnapshot(ks.kind, data)
	if err != nil {
		return nil, 0, err
	}
	stream, err := st.JS().JetStream().Stream(ctx, schema.PlacementStream(ks.kind))
	if err != nil {
		return nil, 0, err
	}
	if last := stream.CachedInfo().State.LastSeq; rev > last {
		return nil, 0, fmt.Errorf("snapshot revision %d is past the bucket's last revision %d (bucket recreated?)", rev, last)
	}
	return t, rev, nil
}

// routing is the part of a placement value the table keeps; decoding only it is cheaper.
type routing struct {
	Shard  string       `json:"shard"`
	Epoch  uint64       `json:"epoch"`
	Phase  schema.Phase `json:"phase"`
	Target string       `json:"target"`
	Source string       `json:"source"`
	Owners []string     `json:"owners"`
	Pinned bool         `json:"pinned"`
}

// Apply implements kvwatch.Handler. OnChange runs after the writer lock is released (Apply is
// only ever called from the follower's goroutine, so changes are still reported in order).
func (ks *kindState) Apply(e kvwatch.Entry) {
	ks.mu.Lock()
	ks.rev = e.Revision
	ks.changes++
	t := ks.t.Load()
	var v uint64
	if e.Op == kvwatch.Put {
		var ok bool
		if v, ok = ks.decode(t, e); !ok {
			ks.mu.Unlock()
			return
		}
	}
	old := t.set(e.Key, v, e.Revision)
	ks.applied.Add(1) // after the table changed: a count read before a lookup covers what it saw
	ks.mu.Unlock()
	if ks.live.Load() && e.Op == kvwatch.Put && !e.Created.IsZero() {
		// A change made before the watch caught up says nothing about delivery: live ones only.
		ks.w.metrics.delay.WithLabelValues(ks.kind, string(phases[(v>>phaseShift)&7])).Observe(time.Since(e.Created).Seconds())
	}
	cb, subs := ks.w.cfg.OnChange, ks.w.subs.Load()
	if (cb != nil || subs != nil) && old != v {
		c := Change{Kind: ks.kind, Tenant: e.Key}
		c.Old, c.OldOK = t.decode(old, 0)
		c.New, c.NewOK = t.decode(v, e.Revision)
		if c.NewOK && c.New.Phase == schema.PhaseHandoff {
			var m struct {
				Move string `json:"move"`
			}
			_ = json.Unmarshal(e.Value, &m) // decoded once already, in decode
			c.Move = m.Move
		}
		if cb != nil {
			cb(c)
		}
		if subs != nil {
			for _, s := range *subs {
				s.fn(c)
			}
		}
	}
}

// subscriber is one Subscribe call's callback.
type subscriber struct{ fn func(Change) }

// Subscribe adds fn to the callbacks called like Config.OnChange, for a watcher shared by
// several users in one process (many shard instances of one kind in a sidecar or a harness),
// and returns the function that removes it.
func (w *Watcher) Subscribe(fn func(Change)) (remove func()) {
	sub := &subscriber{fn: fn}
	w.subMu.Lock()
	defer w.subMu.Unlock()
	var next []*subscriber
	if cur := w.subs.Load(); cur != nil {
		next = append(next, *cur...)
	}
	next = append(next, sub)
	w.subs.Store(&next)
	return func() {
		w.subMu.Lock()
		defer w.subMu.Unlock()
		cur := w.subs.Load()
		if cur == nil {
			return
		}
		rest := slices.DeleteFunc(slices.Clone(*cur), func(s *subscriber) bool { return s == sub })
		if len(rest) == 0 {
			w.subs.Store(nil)
			return
		}
		w.subs.Store(&rest)
	}
}

func (ks *kindState) decode(t *table, e kvwatch.Entry) (uint64, bool) {
	var r routing
	err := schema.CheckTenant(e.Key)
	if err == nil {
		if ferr := jsx.CheckFormat(e.Value); ferr != nil {
			// Refused, never guessed at: the tenant reads as not placed here (its old entry
			// goes too, so nothing routes or serves by a view this binary can no longer
			// follow), and the writes that would place it meet the record and fail.
			ks.corrupt.Add(1)
			ks.w.metrics.corrupt.WithLabelValues(ks.kind).Inc()
			ks.w.cfg.Logger.Error("refusing a placement of a newer record format: upgrade this binary", "kind", ks.kind, "key", e.Key,
				"revision", e.Revision, "err", ferr)
			return 0, true
		}
		err = json.Unmarshal(e.Value, &r)
	}
	if err == nil {
		p := schema.Placement{Kind: ks.kind, Tenant: e.Key, Shard: r.Shard, Epoch: r.Epoch, Phase: r.Phase,
			Target: r.Target, Source: r.Source, Owners: r.Owners, Pinned: r.Pinned}
		if err = p.Validate(); err == nil {
			v, ok := t.pack(p)
			if ok {
				return v, true
			}
			err = errors.New("epoch or shard count out of range")
		}
	}
	ks.corrupt.Add(1)
	ks.w.metrics.corrupt.WithLabelValues(ks.kind).Inc()
	ks.w.cfg.Logger.Warn("skipping corrupt placement", "kind", ks.kind, "key", e.Key, "revision", e.Revision, "err", err)
	return 0, false
}

// Synced implements kvwatch.Handler.
func (ks *kindState) Synced() {
	ks.syncOnce.Do(func() {
		ks.live.Store(true)
		close(ks.synced)
		ks.w.cfg.Logger.Info("placement synced", "kind", ks.kind, "placements", ks.t.Load().len(),
			"took", time.Since(ks.startedAt).Round(time.Millisecond))
		if ks.w.pendingSyn.Add(-1) == 0 {
			ks.w.readyOnce.Do(func() { close(ks.w.ready) })
		}
	})
}

// WriteSnapshot writes kind's compacted snapshot now.
func (w *Watcher) WriteSnapshot(ctx context.Context, kind string) error {
	ks := w.kinds[kind]
	if ks == nil {
		return fmt.Errorf("%w: watcher does not follow %q", schema.ErrUnknownKind, kind)
	}
	select {
	case <-ks.synced:
	default:
		return errors.New("placement: not synced yet; a snapshot now would be incomplete")
	}
	ks.mu.Lock()
	data := encodeSnapshot(kind, ks.rev, ks.t.Load())
	rev := ks.rev
	ks.changes = 0
	ks.mu.Unlock()
	obs, err := w.cfg.Store.Snapshots(ctx)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if _, err := obs.PutBytes(ctx, schema.SnapshotObject(kind), data); err != nil {
		return fmt.Errorf("placement: write snapshot of %s: %w", kind, err)
	}
	w.cfg.Logger.Info("wrote placement snapshot", "kind", kind, "revision", rev, "bytes", len(data))
	return nil
}

func (ks *kindState) compactLoop(ctx context.Context) {
	tick := time.NewTicker(ks.w.cfg.CompactInterval)
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
			ks.mu.Lock()
			due := ks.changes >= ks.w.cfg.CompactEvery
			ks.mu.Unlock()
			if due {
				if err := ks.w.WriteSnapshot(ctx, ks.kind); err != nil {
					ks.w.cfg.Logger.Warn("placement snapshot failed", "kind", ks.kind, "err", err)
				}
			}
		case <-ctx.Done():
			return
		}
	}
}

// monoBase anchors monoNow: durations since it are read from the monotonic clock, so a lease
// measured with them neither jumps with the wall clock nor stops while the process is frozen.
var monoBase = time.Now()

// monoNow is the monotonic time since monoBase, in nanoseconds (always > 0).
func monoNow() int64 { return int64(time.Since(monoBase)) + 1 }

// ConfirmEvery is Config.Confirm: how often the watcher confirms its view (0: never).
func (w *Watcher) ConfirmEvery() time.Duration { return w.cfg.Confirm }

// Confirmed reports how long ago the watcher last confirmed that its view of kind held every
// placement write acknowledged before (see Config.Confirm), and false if it never did. The
// answer is from the monotonic clock: a process frozen (SIGSTOP, a long pause) wakes up with
// the time it was frozen counted.
func (w *Watcher) Confirmed(kind string) (time.Duration, bool) {
	ks := w.kinds[kind]
	if ks == nil {
		return 0, false
	}
	c := ks.confirmed.Load()
	if c == 0 {
		return 0, false
	}
	return time.Duration(monoNow() - c), true
}

// WaitConfirmed waits until kind has been confirmed once (Config.Confirm must be set).
func (w *Watcher) WaitConfirmed(ctx context.Context, kind string) error {
	ks := w.kinds[kind]
	if ks == nil || w.cfg.Confirm <= 0 {
		return fmt.Errorf("placement: %s is not confirmed by this watcher (Config.Confirm)", kind)
	}
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for ks.confirmed.Load() == 0 {
		select {
		case <-t.C:
		case <-ctx.Done():
			return fmt.Errorf("placement: waiting for the first confirmation of %s with its stream leader: %w", kind, ctx.Err())
		}
	}
	return nil
}

// confirmLoop confirms the kind's view every Config.Confirm until ctx ends.
func (ks *kindState) confirmLoop(ctx context.Context) {
	every := ks.w.cfg.Confirm
	t := time.NewTicker(every)
	defer t.Stop()
	for failed := 0; ; {
		select {
		case <-ks.synced:
		case <-ctx.Done():
			return
		}
		cctx, cancel := context.WithTimeout(ctx, every)
		err := ks.confirm(cctx)
		cancel()
		switch {
		case err == nil:
			if failed > 0 {
				ks.w.cfg.Logger.Info("placement view confirmed again", "kind", ks.kind, "after_failures", failed)
			}
			failed = 0
		case ctx.Err() == nil:
			failed++
			ks.w.metrics.confirmFailures.WithLabelValues(ks.kind).Inc()
			if failed == 1 || failed%10 == 0 {
				ks.w.cfg.Logger.Warn("cannot confirm the placement view with its stream leader", "kind", ks.kind, "failures", failed, "err", err)
			}
		}
		select {
		case <-t.C:
		case <-ctx.Done():
			return
		}
	}
}

// confirm asks the placement stream's leader for its last sequence and waits until the kind
// has applied it; then the time it asked is the newest confirmation. Every write the leader
// acknowledged before it answered is at or below that sequence, so once it is applied the view
// holds all of them: a view confirmed at t is at least as new as the placement at t.
func (ks *kindState) confirm(ctx context.Context) error {
	asked := monoNow()
	js := ks.w.cfg.Store.JS()
	// The stream holds only the kind's placements: its last sequence is theirs (stream info,
	// constant cost; the last message on the bucket's wildcard cost the leader a walk of every
	// key).
	last, err := js.StreamLastSeq(ctx, schema.PlacementStream(ks.kind))
	// The stream leader's answer is the process's probe of its NATS server: a server cut from
	// the cluster's majority keeps the connection but lets these time out (jsx.APITimedOut).
	switch nc := js.Conn(); {
	case err == nil:
		jsx.APIAnswered(nc)
	case errors.Is(err, context.DeadlineExceeded):
		if server := nc.ConnectedServerName(); jsx.APITimedOut(nc) {
			ks.w.cfg.Logger.Warn("leaving a NATS server whose JetStream API requests keep timing out", "kind", ks.kind, "server", server)
		}
	}
	if err != nil {
		return err
	}
	// A local poll: nobody competes, so no jitter.
	pauses := backoff.Policy{Initial: 200 * time.Microsecond, Max: 10 * time.Millisecond, Jitter: backoff.None}.Pauses()
	for {
		ks.mu.Lock()
		rev := ks.rev
		ks.mu.Unlock()
		if rev >= last {
			break
		}
		if !pauses.Wait(ctx) {
			return fmt.Errorf("applied revision %d of %d: %w", rev, last, ctx.Err())
		}
	}
	for {
		c := ks.confirmed.Load()
		if asked <= c || ks.confirmed.CompareAndSwap(c, asked) {
			return nil
		}
	}
}
