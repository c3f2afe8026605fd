// Package projection is the projection shard service: per-tenant read models (views) built
// from the ledger events the aggregate service writes to TM_EVENTS, served by a small query API
// (POST /query/{view_type}), with exact per-tenant lag and the warm-up, drain and release hooks
// shardkit needs to move tenants between shards (the Cloudlysis PRD, "Projection").
//
// # Overview
//
// An instance consumes TM_EVENTS only for the tenants its shard hosts or is warming. A tenant
// is added (by the placement watch, by shardkit's Warm hook, or by its first query) with a
// catch-up: its stored views are loaded and a replay over events.<tenant>.> brings them to the
// stream's end (tenants added together share one replay consumer). It then joins one of the
// instance's tail consumers (TailPartitions of them, by a hash of the tenant), whose filter
// subjects are their live tenants' subjects, so steady-state cost is proportional to the hosted
// tenants' event rate, not to their number, nor to other shards' traffic (README.md has the
// figures at 10,000 tenants).
//
// Views ("accounts", "transactions") live in memory. Each tenant's views are stored with the
// sequence they cover in tm_projection_views (pages of transactions written once full, and a
// head: stored.go), and a checkpoint record in
// tm_projection_checkpoints, every CheckpointEvery events, every CheckpointInterval while
// changed, and when the tenant is released (drain, end of a move). A restarted or new owner
// resumes from that object instead of replaying the tenant's whole history.
package projection

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Kind is the service kind.
const Kind = "projection"

// ErrAllTenants is a move to a multi-tenant shard (Config.AllTenants), which takes part in none.
var ErrAllTenants = errors.New("projection: this shard consumes every tenant (multi-tenant mode) and takes part in no move; move tenants between tenant-filtered shards")

// Config configures a Service. The zero value of each field is its documented default.
type Config struct {
	Store *schema.Store
	// Shard is this instance's shard. When set, the service follows the projection placement
	// and consumes the tenants placed on the shard or moving to it, and drops a tenant once a
	// move away from the shard completed. Empty: tenants are added by Warm and by queries only.
	Shard string
	// CheckpointEvery: a tenant's views are stored after this many new events. Default 10000.
	CheckpointEvery int
	// CheckpointInterval: changed views are stored at least this often. Default 10s.
	CheckpointInterval time.Duration
	// TailPartitions is the number of tail consumers tenants are spread over (by a hash of
	// their name); a placement change rebuilds one of them. Default 1.
	TailPartitions int
	// MaxFilters is the most tenants one tail consumer lists as filter subjects; beyond it that
	// consumer reads events.> and drops other tenants' events here. Default 1000.
	MaxFilters int
	// FilterBacklog: a tail consumer with more than this many events to deliver reads events.>
	// until it caught up, then goes back to its filters; a batched catch-up with more replays
	// tenant by tenant. Default 5000.
	FilterBacklog int
	// TailBatch is each tail consumer's pull batch. Default 4096.
	TailBatch int
	// CatchUps bounds concurrent catch-up replays. Default 8.
	CatchUps int
	// CatchUpBatch is the most tenants one catch-up replays with one consumer. Default 256.
	CatchUpBatch int
	// QueryWait bounds how long a query for a tenant still catching up waits before it is
	// answered 503. Default 5s.
	QueryWait time.Duration
	// AllTenants makes the instance a multi-tenant shard (the Cloudlysis PRD's first mode): it
	// consumes every tenant's events, whatever the placement says, taking up each tenant it
	// sees an event of (or a query for), with the tenant's history through its catch-up. It
	// reads the whole stream, and it takes part in no move: a move needs a tenant-filtered
	// shard at both ends (its Warm refuses; the rebalancer refuses to plan one, from the
	// schema.LabelTenants label the binary gives such an instance).
	AllTenants bool
	Logger     *slog.Logger
	Registerer prometheus.Registerer
}

func (c Config) withDefaults() Config {
	if c.CheckpointEvery <= 0 {
		c.CheckpointEvery = 10000
	}
	if c.CheckpointInterval <= 0 {
		c.CheckpointInterval = 10 * time.Second
	}
	if c.TailPartitions <= 0 {
		c.TailPartitions = 1
	}
	if c.MaxFilters <= 0 {
		c.MaxFilters = 1000
	}
	if c.FilterBacklog <= 0 {
		c.FilterBacklog = 5000
	}
	if c.TailBatch <= 0 {
		c.TailBatch = 4096
	}
	if c.CatchUps <= 0 {
		c.CatchUps = 8
	}
	if c.CatchUpBatch <= 0 {
		c.CatchUpBatch = 256
	}
	if c.QueryWait <= 0 {
		c.QueryWait = 5 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// Service holds the views of the tenants this instance hosts or warms.
type Service struct {
	cfg   Config
	st    *store
	m     *metrics
	tails []*tail

	mu      sync.Mutex
	tenants map[string]*tenantState

	cmu   sync.Mutex
	cq    []*tenantState // tenants waiting for their catch-up
	cwake chan struct{}

	fmu    sync.Mutex
	flushq map[string]bool
	fwake  chan struct{}

	// hold, when set, pauses the tails until the channel is closed (benchmarks only).
	hold atomic.Pointer[chan struct{}]

	pmu    sync.Mutex
	placed map[string]bool // tenants whose placement changed, to re-evaluate
	pwake  chan struct{}
}

// New opens the event stream and the views' buckets.
func New(ctx context.Context, cfg Config) (*Service, error) {
	cfg = cfg.withDefaults()
	if cfg.Store == nil {
		return nil, errors.New("projection: Store is required")
	}
	st, err := openEventStore(ctx, cfg.Store, cfg.Logger)
	if err != nil {
		return nil, err
	}
	s := &Service{cfg: cfg, st: st, m: newMetrics(cfg.Registerer), tenants: map[string]*tenantState{},
		cwake: make(chan struct{}, cfg.CatchUps), flushq: map[string]bool{}, fwake: make(chan struct{}, 1),
		placed: map[string]bool{}, pwake: make(chan struct{}, 1)}
	for i := range cfg.TailPartitions {
		s.tails = append(s.tails, newTail(s, i))
	}
	if cfg.AllTenants {
		// A multi-tenant shard takes up every tenant whose events come after this point (and
		// their history with them): its tails start here.
		info, err := st.stream.Info(ctx)
		if err != nil {
			return nil, fmt.Errorf("projection: read %s state: %w", schema.StreamEvents, err)
		}
		for _, t := range s.tails {
			t.pos, t.posValid = info.State.LastSeq, true
		}
	}
	return s, nil
}

// Run consumes events, stores checkpoints and (with Config.Shard) follows placement until ctx
// ends; then it stores every changed tenant's views.
func (s *Service) Run(ctx context.Context) error {
	var w *placement.Watcher
	if s.cfg.Shard != "" && !s.cfg.AllTenants {
		var err error
		w, err = placement.New(placement.Config{Store: s.cfg.Store, Kinds: []string{Kind}, NoSnapshot: true,
			OnChange: s.placementChanged, Logger: s.cfg.Logger})
		if err != nil {
			return err
		}
	}
	var wg sync.WaitGroup
	for _, t := range s.tails {
		wg.Go(func() { t.run(ctx) })
	}
	for range s.cfg.CatchUps {
		wg.Go(func() { s.catchUpLoop(ctx) })
	}
	if w != nil {
		wg.Go(func() {
			if err := w.Run(ctx); err != nil && ctx.Err() == nil {
				s.cfg.Logger.Error("placement watch stopped", "err", err)
			}
		})
		wg.Go(func() { s.followPlacement(ctx, w) })
	}
	s.flushLoop(ctx)
	wg.Wait()
	fctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s.flushAll(fctx, s.hosted())
	return nil
}

// tailOf is the tail partition that applies tenant's events.
func (s *Service) tailOf(tenant string) *tail {
	h := fnv.New32a()
	h.Write([]byte(tenant))
	return s.tails[h.Sum32()%uint32(len(s.tails))]
}

// host returns the tenant's state, adding the tenant (and starting its catch-up) if needed.
func (s *Service) host(tenant string) *tenantState {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ts := s.tenants[tenant]; ts != nil {
		return ts
	}
	ts := newTenantState(tenant)
	s.tenants[tenant] = ts
	s.m.hosted.Set(float64(len(s.tenants)))
	s.queueCatchUp(ts)
	return ts
}

func (s *Service) lookup(tenant string) *tenantState {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.tenants[tenant]
}

func (s *Service) hosted() []*tenantState {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*tenantState, 0, len(s.tenants))
	for _, ts := range s.tenants {
		out = append(out, ts)
	}
	return out
}

// Tenants lists the tenants this instance hosts, sorted.
func (s *Service) Tenants() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, len(s.tenants))
	for t := range s.tenants {
		out = append(out, t)
	}
	sort.Strings(out)
	return out
}

func (ts *tenantState) appliedSeq() uint64 {
	ts.mu.RLock()
	defer ts.mu.RUnlock()
	return ts.applied
}

// refuse stops ts's views at an event this binary cannot read (a newer release wrote it): they
// stay at the last event applied, never folding one they may misread. The caller holds ts.mu.
func (s *Service) refuse(ts *tenantState, err error) {
	ts.refused = err
	s.cfg.Logger.Error("views stopped at an event in a newer format; upgrade this instance", "tenant", ts.tenant, "err", err)
}

func (s *Service) corrupt(tenant string, err error) {
	s.m.corrupt.Inc()
	s.cfg.Logger.Warn("skipping corrupt event", "tenant", tenant, "err", err)
}

// drop stops consuming the tenant and forgets it; it returns the state (nil if not hosted).
func (s *Service) drop(tenant string) *tenantState {
	s.mu.Lock()
	ts := s.tenants[tenant]
	delete(s.tenants, tenant)
	s.m.hosted.Set(float64(len(s.tenants)))
	s.mu.Unlock()
	if ts == nil {
		return nil
	}
	ts.mu.Lock()
	ts.phase = phaseDropped
	ts.mu.Unlock()
	s.tailOf(tenant).leave(tenant)
	return ts
}

// Warm starts consuming the tenant and returns once its applied sequence reaches fence, or, with
// fence 0, the tenant's last event when Warm was called. It is shardkit's warm hook.
func (s *Service) Warm(ctx context.Context, tenant string, fence uint64) error {
	if s.cfg.AllTenants {
		return ErrAllTenants
	}
	ts := s.host(tenant)
	ts.mu.Lock()
	ts.dig.keep(ts.applied) // a move's target: its digest at the fence is asked for later
	ts.mu.Unlock()
	select {
	case <-ts.caught:
	case <-ctx.Done():
		return fmt.Errorf("projection: warming %s: catch-up not finished: %w", tenant, ctx.Err())
	}
	target := fence
	if target == 0 {
		last, err := s.st.lastSeq(ctx, tenant)
		if err != nil {
			return err
		}
		target = last
	}
	select {
	case <-ts.waitApplied(target):
		return nil
	case <-ctx.Done():
		return fmt.Errorf("projection: warming %s reached %d of %d: %w", tenant, ts.appliedSeq(), target, ctx.Err())
	}
}

// Applied is the stream sequence of the tenant's last applied event (0 if not hosted). shardkit
// hook; a move's source reports it as the fence, so the target serves at least what it served.
func (s *Service) Applied(tenant string) uint64 {
	ts := s.lookup(tenant)
	if ts == nil {
		return 0
	}
	return ts.appliedSeq()
}

// Lag is the tenant's exact lag: the stream sequence of its last event minus its applied
// sequence (0 when caught up). shardkit hook.
func (s *Service) Lag(tenant string) uint64 {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	lag, _, err := s.lag(ctx, tenant)
	if err != nil {
		s.cfg.Logger.Warn("lag: reading the tenant's last event failed", "tenant", tenant, "err", err)
	}
	return lag
}

func (s *Service) lag(ctx context.Context, tenant string) (lag, applied uint64, err error) {
	applied = s.Applied(tenant)
	last, err := s.st.lastSeq(ctx, tenant)
	if err != nil || last <= applied {
		return 0, applied, err
	}
	return last - applied, applied, nil
}

// Release stores the tenant's views and checkpoint, then drops them from memory. It is
// shardkit's release hook: after a per-tenant drain, after a move away from this shard
// committed, and when a move to this shard was aborted.
func (s *Service) Release(ctx context.Context, tenant string) error {
	ts := s.drop(tenant)
	if ts == nil {
		return nil
	}
	select {
	case <-ts.caught:
	default:
		return nil // never caught up: what is stored is at least as good
	}
	return s.flush(ctx, ts)
}

// Checkpoint reads the tenant's stored checkpoint.
func (s *Service) Checkpoint(ctx context.Context, tenant string) (Checkpoint, error) {
	return s.st.checkpoint(ctx, tenant)
}
