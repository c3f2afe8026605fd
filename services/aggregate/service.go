// Package aggregate is the aggregate shard service: a tenant-scoped command API whose state is
// event-sourced on JetStream, with single-writer safety, snapshots and both warm-up strategies
// of the Cloudlysis PRD (snapshot migration and cold replay).
//
// # Overview
//
// The domain is a ledger of accounts (open, deposit, withdraw never below zero, close). Each
// command appends one event to TM_EVENTS on events.<tenant>.account.<id> with JetStream's
// expected-last-subject-sequence set to the last event this instance applied for that account,
// so two writers that both believe they own a tenant cannot fork an account's history: the
// second append is rejected, the instance catches the account up from the stream and decides
// again. The JetStream message id (tenant + idempotency key) and a per-tenant window of recent
// outcomes make a retried command apply once, also across a move (the window travels in
// snapshots and is rebuilt from events).
//
// State lives in memory per hosted tenant, rebuilt from the newest snapshot plus later events.
// Snapshots (object store tm_aggregate_snapshots) are written every SnapshotEvery events and
// when a tenant is released, so the next owner loads them.
package aggregate

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"regexp"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/tenantmesh/tenantmesh/internal/ctxtime"
	"github.com/tenantmesh/tenantmesh/internal/tracing"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Config configures a Service. The zero value of each field is its documented default.
type Config struct {
	Store *schema.Store
	// SnapshotEvery: a tenant's snapshot is written after this many new events. Default 1000.
	SnapshotEvery int
	// IdempotencyWindow: outcomes remembered per tenant for retries. Default 10000.
	IdempotencyWindow int
	// Strategy used when a move does not name one, and for lazy loads. Default snapshot.
	Strategy Strategy
	// CommandTimeout bounds one command's NATS calls. Default 5s.
	CommandTimeout time.Duration
	// MaxAttempts bounds the catch-ups before a command is rejected on state a sibling instance
	// may have moved on from. Default 5. A command that lost an append to another writer is
	// decided again until CommandTimeout runs out, not a fixed number of times: a client gets
	// no failure it did nothing to cause (the gateway sends a tenant's commands to one
	// instance, so such races are rare: clients that bypass it, a change of writer).
	MaxAttempts int
	Logger      *slog.Logger
	Registerer  prometheus.Registerer
}

func (c Config) withDefaults() Config {
	if c.SnapshotEvery <= 0 {
		c.SnapshotEvery = 1000
	}
	if c.IdempotencyWindow <= 0 {
		c.IdempotencyWindow = 10000
	}
	if c.Strategy == "" {
		c.Strategy = StrategySnapshot
	}
	if c.CommandTimeout <= 0 {
		c.CommandTimeout = 5 * time.Second
	}
	if c.MaxAttempts <= 0 {
		c.MaxAttempts = 5
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// Service holds the ledgers of the tenants this instance hosts.
type Service struct {
	cfg Config
	es  *eventStore
	m   *metrics

	mu      sync.Mutex
	tenants map[string]*slot
	base    context.Context // Run's, while it runs: the follows' parent
	follows sync.WaitGroup

	snapq chan string
}

// slot is a tenant being loaded or loaded.
type slot struct {
	done chan struct{}
	ts   *tenantState
	err  error
}

// New opens the event store and snapshot bucket.
func New(ctx context.Context, cfg Config) (*Service, error) {
	cfg = cfg.withDefaults()
	if cfg.Store == nil {
		return nil, errors.New("aggregate: Store is required")
	}
	es, err := openEventStore(ctx, cfg.Store)
	if err != nil {
		return nil, err
	}
	m := newMetrics(cfg.Registerer, es)
	es.retries = m.appendRetries
	return &Service{cfg: cfg, es: es, m: m, tenants: map[string]*slot{}, snapq: make(chan string, 1024)}, nil
}

// Run writes snapshots queued by commands and owns the warmed targets' follows, until ctx ends.
func (s *Service) Run(ctx context.Context) error {
	s.mu.Lock()
	s.base = ctx
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.base = nil
		s.mu.Unlock()
		s.follows.Wait()
	}()
	for {
		select {
		case tenant := <-s.snapq:
			s.writeSnapshot(ctx, tenant)
		case <-ctx.Done():
			return nil
		}
	}
}

var aggregateID = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// Result is a command's outcome.
type Result struct {
	AggregateType string `json:"aggregate_type"`
	AggregateID   string `json:"aggregate_id"`
	Version       uint64 `json:"version"`
	Event         string `json:"event"`
	Seq           uint64 `json:"seq"`
	// Replayed is true when the idempotency key had been applied before: nothing new happened.
	Replayed bool `json:"replayed"`
}

// Handle decides and appends one command for tenant.
func (s *Service) Handle(ctx context.Context, tenant string, cmd Command) (Result, error) {
	if !aggregateID.MatchString(cmd.AggregateID) {
		return Result{}, fmt.Errorf("%w: aggregate_id %q must be 1 to 64 characters of [A-Za-z0-9_-]", ErrBadPayload, cmd.AggregateID)
	}
	if cmd.IdempotencyKey == "" || len(cmd.IdempotencyKey) > 200 {
		return Result{}, fmt.Errorf("%w: idempotency_key (or the Idempotency-Key header) is required, at most 200 bytes, so a retried command applies once", ErrBadPayload)
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.CommandTimeout)
	defer cancel()
	if tracing.On() {
		var span trace.Span
		ctx, span = tracer.Start(ctx, "command", trace.WithAttributes(attribute.String("tm.tenant", tenant),
			attribute.String("tm.command", cmd.Command), attribute.String("tm.aggregate", cmd.AggregateID)))
		defer span.End()
	}
	ts, err := s.tenant(ctx, tenant, "")
	if err != nil {
		return Result{}, err
	}
	ts.mu.Lock()
	defer ts.mu.Unlock()
	ts.stopFollow() // commands come to the owner: a move to here committed
	for attempt := 1; ; attempt++ {
		if e, ok := ts.idem.get(cmd.IdempotencyKey); ok {
			s.m.commands.WithLabelValues(cmd.Command, "replayed").Inc()
			return Result{AggregateType: AccountType, AggregateID: e.AggregateID, Version: e.Version, Event: e.Event, Seq: e.Seq, Replayed: true}, nil
		}
		acc := ts.accounts[cmd.AggregateID]
		ev, err := decide(acc, cmd)
		if err != nil {
			// A rejection may come from state a sibling instance has moved on from: reject
			// only once this instance has the account's last event.
			if fresh, ferr := ts.fresh(ctx, s.es, cmd.AggregateID); ferr != nil {
				return Result{}, ferr
			} else if !fresh && attempt < s.cfg.MaxAttempts {
				if err := ts.catchUpAggregate(ctx, s.es, cmd.AggregateID); err != nil {
					return Result{}, err
				}
				continue
			}
			s.m.commands.WithLabelValues(cmd.Command, "rejected").Inc()
			return Result{}, err
		}
		var expect uint64
		ev.Version = 1
		if acc != nil {
			expect, ev.Version = acc.LastSeq, acc.Version+1
		}
		ev.Tenant, ev.At = tenant, time.Now().UTC()
		seq, dup, err := s.es.append(ctx, ev, expect)
		if err == nil && !dup {
			ev.Seq = seq
			ts.apply(ev)
			s.afterAppend(ts)
			s.m.commands.WithLabelValues(cmd.Command, "applied").Inc()
			return Result{AggregateType: AccountType, AggregateID: ev.AggregateID, Version: ev.Version, Event: ev.Event, Seq: seq}, nil
		}
		if err != nil && !errors.Is(err, errStale) {
			s.m.commands.WithLabelValues(cmd.Command, "error").Inc()
			return Result{}, err
		}
		if dup {
			// This command is already stored (an earlier attempt whose answer was lost, or a
			// sibling instance's): read the tenant's events so the window knows its outcome.
			if err := ts.catchUp(ctx, s.es); err != nil {
				return Result{}, err
			}
			if _, ok := ts.idem.get(cmd.IdempotencyKey); !ok {
				return Result{}, fmt.Errorf("%w: idempotency key %q was used by another command; use a new key per command", ErrVersionConflict, cmd.IdempotencyKey)
			}
			continue
		}
		// Another writer appended to this account first: learn what it wrote, decide again,
		// after a short random pause once it keeps happening (writers in lockstep).
		s.m.conflicts.Inc()
		if attempt > 2 && !ctxtime.Sleep(ctx, conflictPause(attempt)) {
			return Result{}, fmt.Errorf("%w: account %s kept changing underneath for %s (%d attempts); retry the command", ErrVersionConflict, cmd.AggregateID, s.cfg.CommandTimeout, attempt)
		}
		if err := ts.catchUpAggregate(ctx, s.es, cmd.AggregateID); err != nil {
			return Result{}, err
		}
	}
}

// conflictPause is a random pause before deciding again after the attempt-th lost append:
// up to 1 ms, doubling to 32 ms.
func conflictPause(attempt int) time.Duration {
	limit := time.Millisecond << min(attempt-3, 5)
	return time.Duration(rand.Int64N(int64(limit)) + 1)
}

func (s *Service) afterAppend(ts *tenantState) {
	if ts.sinceSnap < s.cfg.SnapshotEvery {
		return
	}
	ts.sinceSnap = 0
	select {
	case s.snapq <- ts.tenant:
	default: // a snapshot is late, not lost: the next threshold queues it again
	}
}

// Account reads one account, first catching it up with writes made by sibling instances.
func (s *Service) Account(ctx context.Context, tenant, id string) (Account, error) {
	if !aggregateID.MatchString(id) {
		return Account{}, fmt.Errorf("%w: account id %q must be 1 to 64 characters of [A-Za-z0-9_-]", ErrBadPayload, id)
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.CommandTimeout)
	defer cancel()
	ts, err := s.tenant(ctx, tenant, "")
	if err != nil {
		return Account{}, err
	}
	ts.mu.Lock()
	defer ts.mu.Unlock()
	if err := ts.catchUpAggregate(ctx, s.es, id); err != nil {
		return Account{}, err
	}
	acc := ts.accounts[id]
	if acc == nil {
		return Account{}, fmt.Errorf("%w: %s", ErrNoAccount, id)
	}
	return *acc, nil
}

// Totals reads a tenant's ledger totals after catching up with the stream.
func (s *Service) Totals(ctx context.Context, tenant string) (Totals, uint64, error) {
	ctx, cancel := context.WithTimeout(ctx, 4*s.cfg.CommandTimeout)
	defer cancel()
	ts, err := s.tenant(ctx, tenant, "")
	if err != nil {
		return Totals{}, 0, err
	}
	ts.mu.Lock()
	defer ts.mu.Unlock()
	if err := ts.catchUp(ctx, s.es); err != nil {
		return Totals{}, 0, err
	}
	return ts.totals, ts.contig, nil
}

// tenant returns the tenant's state, loading it (once, however many callers ask) if needed.
func (s *Service) tenant(ctx context.Context, tenant string, strategy Strategy) (*tenantState, error) {
	s.mu.Lock()
	sl := s.tenants[tenant]
	if sl == nil {
		sl = &slot{done: make(chan struct{})}
		s.tenants[tenant] = sl
		s.mu.Unlock()
		if strategy == "" {
			strategy = s.cfg.Strategy
		}
		ts, rep, err := load(ctx, s.es, tenant, strategy, s.cfg.IdempotencyWindow)
		sl.ts, sl.err = ts, err
		close(sl.done)
		if err != nil {
			s.mu.Lock()
			if s.tenants[tenant] == sl {
				delete(s.tenants, tenant)
			}
			s.mu.Unlock()
			return nil, err
		}
		s.m.observeLoad(rep)
		s.cfg.Logger.Info("tenant loaded", "tenant", tenant, "strategy", rep.Strategy, "snapshot_hit", rep.SnapshotHit,
			"replayed", rep.Replayed, "took", rep.Took.Round(time.Millisecond))
		return ts, nil
	}
	s.mu.Unlock()
	select {
	case <-sl.done:
		return sl.ts, sl.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (s *Service) loaded(tenant string) *tenantState {
	s.mu.Lock()
	defer s.mu.Unlock()
	sl := s.tenants[tenant]
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

func (s *Service) writeSnapshot(ctx context.Context, tenant string) {
	ts := s.loaded(tenant)
	if ts == nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ts.mu.Lock()
	// Catch up first, so the snapshot's applied sequence covers everything before it.
	err := ts.catchUp(ctx, s.es)
	snap := ts.snapshot()
	ts.mu.Unlock()
	if err != nil {
		s.cfg.Logger.Warn("snapshot skipped: catch-up failed", "tenant", tenant, "err", err)
		return
	}
	n, err := s.es.saveSnapshot(ctx, snap)
	if err != nil {
		s.cfg.Logger.Warn("snapshot failed", "tenant", tenant, "err", err)
		return
	}
	s.m.snapshotBytes.Set(float64(n))
	s.cfg.Logger.Debug("snapshot written", "tenant", tenant, "applied", snap.Applied, "bytes", n)
}

// Warm loads tenant (with the move's strategy, else the default) and catches it up until its
// applied sequence reaches fence. It is shardkit's warm hook.
func (s *Service) Warm(ctx context.Context, tenant string, fence uint64) error {
	strategy := s.cfg.Strategy
	if s.loaded(tenant) == nil { // the strategy only matters for a load
		if p, err := s.cfg.Store.Placement(ctx, "aggregate", tenant); err == nil && p.Strategy != "" {
			strategy = Strategy(p.Strategy)
		}
	}
	ts, err := s.tenant(ctx, tenant, strategy)
	if err != nil {
		return err
	}
	ts.mu.Lock()
	defer ts.mu.Unlock()
	for {
		if ts.unfollow == nil || fence == 0 {
			if err := ts.catchUp(ctx, s.es); err != nil {
				return err
			}
		}
		if fence == 0 {
			s.follow(ts) // warm now; stay so until the handoff names the fence
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
			return fmt.Errorf("aggregate: warming %s reached %d of fence %d: %w", tenant, ts.contig, fence, ctx.Err())
		}
	}
}

// Applied is the tenant's contiguous applied sequence (0 if not loaded). shardkit hook.
func (s *Service) Applied(tenant string) uint64 {
	ts := s.loaded(tenant)
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
func (s *Service) Fence(tenant string) uint64 {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	last, err := s.es.lastSeq(ctx, schema.TenantEvents(tenant))
	if err == nil {
		return last
	}
	s.cfg.Logger.Warn("fence: reading the tenant's last event failed; catching up instead", "tenant", tenant, "err", err)
	ts := s.loaded(tenant)
	if ts == nil {
		return 0
	}
	ts.mu.Lock()
	defer ts.mu.Unlock()
	if err := ts.catchUp(ctx, s.es); err != nil {
		s.cfg.Logger.Warn("fence: catch-up failed", "tenant", tenant, "err", err)
	}
	return ts.contig
}

// Release writes the tenant's final snapshot (so its next owner loads it) and drops it from
// memory. shardkit hook.
func (s *Service) Release(ctx context.Context, tenant string) error {
	if ts := s.loaded(tenant); ts != nil {
		ts.mu.Lock()
		ts.stopFollow()
		ts.mu.Unlock()
	}
	s.writeSnapshot(ctx, tenant)
	s.mu.Lock()
	delete(s.tenants, tenant)
	s.mu.Unlock()
	return nil
}

// Size describes a tenant for the rebalancer's choice of warm-up strategy.
type Size struct {
	Tenant        string `json:"tenant"`
	Events        uint64 `json:"events"`
	SnapshotSeq   uint64 `json:"snapshot_seq"`
	SnapshotBytes int    `json:"snapshot_bytes"`
	Accounts      int    `json:"accounts"`
	// Suggested is the cheaper strategy: replay when there is no snapshot or it covers little.
	Suggested Strategy `json:"suggested"`
}

// TenantSize reports a tenant's size in events and snapshot.
func (s *Service) TenantSize(ctx context.Context, tenant string) (Size, error) {
	n, err := s.es.tenantEvents(ctx, tenant)
	if err != nil {
		return Size{}, err
	}
	sz := Size{Tenant: tenant, Events: n, Suggested: StrategyReplay}
	if snap, bytes, err := s.es.loadSnapshot(ctx, tenant); err == nil && snap != nil {
		sz.SnapshotSeq, sz.SnapshotBytes, sz.Accounts = snap.Applied, bytes, len(snap.Accounts)
		if n > 1000 {
			sz.Suggested = StrategySnapshot
		}
	}
	return sz, nil
}

// Hosted lists the tenants in memory.
func (s *Service) Hosted() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, len(s.tenants))
	for t := range s.tenants {
		out = append(out, t)
	}
	return out
}

// tracer makes the aggregate's spans: a command and its append (the event carries the trace
// on to the projection and to anyone reading the stream).
var tracer = otel.Tracer("github.com/tenantmesh/tenantmesh/services/aggregate")
