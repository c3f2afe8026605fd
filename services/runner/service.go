// Package runner is the runner shard service: per-tenant job queues on JetStream with
// per-instance and per-tenant limits, side effects (log, HTTP webhook, SMTP email) delivered
// through an outbox with dedupe keys, sagas triggered by events, and a per-tenant drain that
// hands a tenant to another shard without repeating an effect (the multi-host design and the Cloudlysis PRD).
//
// # Overview
//
// A job is a run record in KV tm_runner_runs (key <tenant>.<id>: status, attempts, result,
// timestamps, pinned instance) and an entry on the tenant's queue in TM_JOBS: jobs.<tenant>.any
// for any instance of the owning shard, jobs.<tenant>.pin.<instance> for a job pinned to one
// instance (the multi-host design's hostId). An entry leaves the queue when its job finishes, so the queue
// holds exactly the unfinished jobs and its message count is the tenant's depth.
//
// Each instance follows the runner placement and acquires only the tenants its shard owns
// (active, warming as the source, draining as the new owner; never in handoff). For each owned
// tenant it keeps a cursor into the tenant's subjects and a core NATS interest on them as a
// wake-up; a dispatcher takes one job per ready tenant in turn (round robin), within the
// instance's concurrency cap and the instance and tenant rates, and claims it by
// compare-and-set on the run record, so sibling instances never run the same attempt. See
// README.md for how this scales to 10,000 tenants per shard.
//
// Effects are recorded in the tenant's outbox (jobs.<tenant>.fx, JetStream message id = the
// dedupe key) before they are delivered, and a delivery marker in KV tm_runner_outbox (created
// only if absent) makes a retried job, a second instance or a new owner skip an effect that was
// delivered. Providers receive the dedupe key (the webhook's Idempotency-Key header, the email's
// Message-ID) for the one case the marker cannot cover: an instance that dies between the
// delivery and writing its marker.
package runner

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Kind is the service kind.
const Kind = "runner"

// Config configures a Service. The zero value of each field is its documented default.
type Config struct {
	Store *schema.Store
	// ID is this instance (kind runner); its Shard decides which tenants it acquires and its
	// Instance which pinned jobs it runs. Required.
	ID schema.InstanceID
	// MaxConcurrent is the per-instance cap on running jobs (the multi-host design section 8). Default 8.
	MaxConcurrent int
	// InstanceJobsPerMinute caps job starts per instance; 0: no cap.
	InstanceJobsPerMinute int
	// TenantJobsPerMinute caps job starts per tenant on the shard; 0: no cap. Each instance
	// takes an even share, from the count of the shard's live instances.
	TenantJobsPerMinute int
	// MaxQueued is the number of unfinished jobs a tenant may have; a create beyond it is
	// answered 429. Default 10000.
	MaxQueued int
	// MaxAttempts bounds the tries of a failing job. Default 5.
	MaxAttempts int
	// RetryBackoff is the pause before a failed job's second try, doubled per try up to 1
	// minute. Default 1s.
	RetryBackoff time.Duration
	// RunTimeout bounds one attempt, its effects included. Default 30s.
	RunTimeout time.Duration
	// DrainTimeout bounds how long a released tenant's in-flight runs and outbox flush may
	// take; runs still going are then cancelled and retried by the next owner. Default 10s.
	DrainTimeout time.Duration
	// Sweep is how often every owned tenant is rescanned, in case a wake-up was lost (core
	// NATS is lossy) or a sibling instance died mid-run. Default 30s.
	Sweep time.Duration
	// StatusEvery is how often the instance writes its runner status. Default 1s.
	StatusEvery time.Duration
	// OpTimeout bounds one request's NATS calls. Default 5s.
	OpTimeout time.Duration
	// Retention is how long a finished run (succeeded or failed) and its effects' delivery
	// markers are kept; then JetStream removes them, and a create with the run's
	// idempotency key makes a new job. Default 7 days.
	Retention time.Duration
	// SizeEvery is how often the acquired tenants' queue and outbox depths are counted for
	// telemetry and /admin/tenants. Default 10s.
	SizeEvery time.Duration
	// MaxSchedules is the number of recurring schedules a tenant may have. Default 100.
	MaxSchedules int
	// Handlers are job types beyond the built-ins (webhook, email, log, sleep, noop).
	Handlers map[string]Handler
	// Effects are providers by name, beyond or replacing the built-ins: log, webhook (a
	// Webhook with defaults) and email (only if set, for example an *SMTP).
	Effects map[string]Effect
	// WebhookAllow is the built-in webhook's allow-list (Webhook.Allow; default: public
	// addresses only).
	WebhookAllow []string
	// Sagas triggered by events. Default: Welcome (account opened -> welcome email).
	// Set to an empty, non-nil slice to run none.
	Sagas []Saga
	// Labels are shown in the instance's runner status (the directory has them too).
	Labels map[string]string
	// Logger; if nil, logs are discarded.
	Logger     *slog.Logger
	Registerer prometheus.Registerer
}

func (c Config) withDefaults() Config {
	if c.MaxConcurrent <= 0 {
		c.MaxConcurrent = 8
	}
	if c.MaxQueued <= 0 {
		c.MaxQueued = 10000
	}
	if c.MaxAttempts <= 0 {
		c.MaxAttempts = 5
	}
	if c.RetryBackoff <= 0 {
		c.RetryBackoff = time.Second
	}
	if c.RunTimeout <= 0 {
		c.RunTimeout = 30 * time.Second
	}
	if c.DrainTimeout <= 0 {
		c.DrainTimeout = 10 * time.Second
	}
	if c.Sweep <= 0 {
		c.Sweep = 30 * time.Second
	}
	if c.StatusEvery <= 0 {
		c.StatusEvery = time.Second
	}
	if c.OpTimeout <= 0 {
		c.OpTimeout = 5 * time.Second
	}
	if c.SizeEvery <= 0 {
		c.SizeEvery = 10 * time.Second
	}
	if c.MaxSchedules <= 0 {
		c.MaxSchedules = 100
	}
	if c.Retention <= 0 {
		c.Retention = 7 * 24 * time.Hour
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Sagas == nil {
		c.Sagas = []Saga{Welcome{}}
	}
	return c
}

// Service runs the jobs, sagas and effects of the tenants its shard owns.
type Service struct {
	cfg      Config
	st       *schema.Store
	js       jetstream.JetStream
	jobs     jetstream.Stream
	events   jetstream.Stream
	watcher  *placement.Watcher
	handlers map[string]Handler
	outbox   *outbox
	sagas    *sagas
	board    *statusBoard
	exec     *executor
	wakes    *wakeups
	// reachable is when a saga checkpoint was last read (unix ns): Warm's probe.
	reachable atomic.Int64
	// verify is the kind config's verify flag (followVerify): digests at a move's fence.
	verify atomic.Bool
	// serving, once Handler bound the shard, says whether the shard serves a tenant now (its
	// lease holds and it owns the tenant): a claim is made only then.
	serving atomic.Pointer[func(tenant string) bool]
	// gateView is the bound shard's placement view (Handler), which admits the requests: ahead
	// of the service's own watcher, which follows the placement on the data connection.
	gateView atomic.Pointer[placement.Watcher]
	store    *runStore
	m        *metrics
	sched    *Scheduler
	sizes    *sizer
	runs     *runStats // per-tenant attempts, retries and latency (tenantruns.go)
	started  time.Time

	mu       sync.Mutex
	tenants  map[string]*tenantQ
	ring     []*tenantQ // ready tenants, round robin
	running  int
	siblings int // live instances of the shard, for the per-tenant rate split
	resplits int // times siblings changed (tests check the split stayed in force)
	instRate *limiter
	changed  map[string]struct{} // tenants whose placement changed, to reconcile
	wake     chan struct{}       // nudges the dispatcher
	recon    chan struct{}       // nudges the reconciler
	totals   Totals
	recent   recentRuns           // the newest runs, for the instance's load reports
	fenced   map[string]*captured // digests taken from a move's fence, until shardkit asks (digest.go)
	runsStr  jetstream.Stream     // the runs bucket's stream, for digests (digest.go)

	housekeeping sync.WaitGroup // released tenants' outbox flushes and drain records, digests, waits for them
}

// Totals are the instance's counters since start.
type Totals struct {
	Started   uint64 `json:"started"`
	Succeeded uint64 `json:"succeeded"`
	Failed    uint64 `json:"failed"`
	Retried   uint64 `json:"retried"`
	Effects   uint64 `json:"effects"`
	Deduped   uint64 `json:"deduped"`
}

// New opens the queue stream, the buckets and the placement watcher. Call Run to start work.
func New(ctx context.Context, cfg Config) (*Service, error) {
	cfg = cfg.withDefaults()
	if cfg.Store == nil {
		return nil, errors.New("runner: Store is required")
	}
	if cfg.ID.Kind == "" {
		cfg.ID.Kind = Kind
	}
	if err := cfg.ID.Check(); err != nil {
		return nil, fmt.Errorf("runner: ID: %w", err)
	}
	st := cfg.Store
	if err := st.EnsureJobsStream(ctx); err != nil {
		return nil, err
	}
	if err := st.EnsureEventsStream(ctx); err != nil {
		return nil, err
	}
	s := &Service{cfg: cfg, st: st, js: st.JS().JetStream(), tenants: map[string]*tenantQ{}, changed: map[string]struct{}{}, fenced: map[string]*captured{},
		wake: make(chan struct{}, 1), recon: make(chan struct{}, 1), started: time.Now().UTC()}
	s.outbox = &outbox{s: s, flushWake: make(chan struct{}, 1)}
	s.sagas = &sagas{s: s, wake: make(chan struct{}, 1)}
	s.board = &statusBoard{s: s}
	s.exec = &executor{s: s}
	s.wakes = &wakeups{s: s, wakeCh: make(chan *nats.Msg, 8192)}
	s.store = &runStore{s: s}
	var err error
	if s.jobs, err = st.JS().Stream(ctx, schema.StreamJobs); err != nil {
		return nil, fmt.Errorf("runner: open %s: %w", schema.StreamJobs, err)
	}
	if s.events, err = st.JS().Stream(ctx, schema.StreamEvents); err != nil {
		return nil, fmt.Errorf("runner: open %s: %w", schema.StreamEvents, err)
	}
	buckets := []struct {
		dst     *jetstream.KeyValue
		purpose string
		desc    string
		ttl     bool // finished runs and delivered markers expire after Retention
	}{
		{&s.store.runs, "runs", "runner: job runs, <tenant>.<job id>", true},
		{&s.outbox.markers, "outbox", "runner: effect delivery markers, by dedupe key", true},
		{&s.sagas.checks, "checkpoints", "runner: saga checkpoints and drain records per tenant", false},
		{&s.board.status, "status", "runner: each instance's running count, limits and totals", false},
	}
	for _, b := range buckets {
		spec := jsx.KVSpec{Bucket: schema.ServiceBucket(Kind, b.purpose), Description: b.desc, PerKeyTTL: b.ttl}
		if *b.dst, err = st.JS().EnsureKV(ctx, spec); err != nil {
			return nil, err
		}
	}
	if cfg.InstanceJobsPerMinute > 0 {
		s.instRate = newLimiter(cfg.InstanceJobsPerMinute)
	}
	s.handlers = builtinHandlers()
	for name, h := range cfg.Handlers {
		s.handlers[name] = h
	}
	s.outbox.effects = map[string]Effect{"log": LogEffect{Logger: cfg.Logger}, "webhook": &Webhook{Allow: cfg.WebhookAllow}}
	for name, e := range cfg.Effects {
		s.outbox.effects[name] = e
	}
	s.m = newMetrics(cfg.Registerer, s)
	if s.sched, err = newScheduler(ctx, s); err != nil {
		return nil, err
	}
	s.sizes = newSizer(s)
	s.runs = newRunStats(cfg.Registerer)
	// NoSnapshot: every placement then comes through OnChange, so the owned set is complete.
	s.watcher, err = placement.New(placement.Config{Store: st, Kinds: []string{Kind}, NoSnapshot: true,
		OnChange: s.onChange, Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	return s, nil
}

// Run follows the placement and runs jobs, sagas and effects until ctx ends; then it waits for
// the runs in flight (they end with ctx) and returns.
func (s *Service) Run(ctx context.Context) error {
	s.board.write(ctx) // siblings may pin jobs to this instance from now on
	var wg sync.WaitGroup
	wg.Go(func() { _ = s.watcher.Run(ctx) })
	if err := s.watcher.WaitReady(ctx); err != nil {
		wg.Wait()
		return nil
	}
	wg.Go(func() { s.wakes.wakeLoop(ctx) })
	wg.Go(func() { s.outbox.flushLoop(ctx) })
	wg.Go(func() { s.reconcileLoop(ctx) })
	wg.Go(func() { s.dispatchLoop(ctx) })
	wg.Go(func() { s.sagas.loop(ctx) })
	wg.Go(func() { s.board.loop(ctx) })
	wg.Go(func() { s.sweepLoop(ctx) })
	wg.Go(func() { s.sched.run(ctx) })
	wg.Go(func() { s.sizes.run(ctx) })
	wg.Go(func() { s.followVerify(ctx) })
	<-ctx.Done()
	wg.Wait()
	s.mu.Lock()
	all := make([]*tenantQ, 0, len(s.tenants))
	for _, tq := range s.tenants {
		all = append(all, tq)
	}
	s.mu.Unlock()
	for _, tq := range all {
		s.wakes.unsubscribe(tq)
		tq.work.Wait()
	}
	s.housekeeping.Wait()
	return nil
}

// Hooks connect the runner to shardkit's move protocol.
func (s *Service) Hooks() shardkit.Hooks {
	return shardkit.Hooks{Warm: s.Warm, Fence: s.Fence, Lag: s.Lag, Release: s.Release, Reload: s.Reload, Report: s.recent.report, DigestBeside: true,
		Sizes: s.sizes.Sizes, Digest: s.Digest}
}

// Warm prepares a tenant moving here: it reads the tenant's saga checkpoint so the bucket is
// known reachable. The runner has no state to load: its queue, runs and checkpoints are in
// NATS, and it starts acquiring when its shard becomes the owner. A read that succeeded within
// the last second answers for the bucket: a move calls Warm at warming and again at handoff,
// and there the read would be a round trip inside the pause.
func (s *Service) Warm(ctx context.Context, tenant string, _ uint64) error {
	if time.Since(time.Unix(0, s.reachable.Load())) < time.Second {
		return nil
	}
	if _, _, err := s.sagas.checkpoint(ctx, tenant); err != nil {
		return err
	}
	s.reachable.Store(time.Now().UnixNano())
	return nil
}

// Fence is called by shardkit on a move's source at handoff, after its HTTP requests
// finished. The runner has no sequence to fence on: 0.
//
// It only stops acquiring the tenant; it does not wait for the tenant's runs in flight, nor
// flush its outbox, so the source reports drained at once and the handoff pause does not
// carry a job's run time or NATS round trips. The new owner needs no quiet queue: a claim is
// a compare-and-set on the run record, so it never runs an attempt that is still running here
// (it waits for that attempt's lease), and every effect is delivered once by its marker. The
// runs in flight finish (or are cancelled at DrainTimeout) and the outbox is flushed in
// Release, which shardkit calls once the tenant has moved away.
//
// The move may have been aborted meanwhile, its placement back on this shard: reconciling the
// tenant afterwards takes it up again (a released tenant this shard owns starts a new turn).
//
// For a kind that verifies moves it also takes the tenant's queue digest (digest.go): NATS
// reads inside the pause, one for an empty queue.
func (s *Service) Fence(tenant string) uint64 {
	s.mu.Lock()
	tq := s.tenants[tenant]
	if tq != nil {
		tq.released = true
	}
	settled := s.settledClaims(tq)
	s.changed[tenant] = struct{}{}
	s.mu.Unlock()
	if tq != nil {
		s.wakes.unsubscribe(tq)
	}
	nudge(s.recon)
	s.captureAtFence(tenant, settled)
	return 0
}

// Reload re-evaluates every tenant's placement (POST /admin/reload): a tenant released by a
// drain outside a move is acquired again if its shard still owns it.
func (s *Service) Reload(context.Context) error {
	s.mu.Lock()
	for t, tq := range s.tenants {
		tq.released = false
		s.changed[t] = struct{}{}
	}
	s.mu.Unlock()
	nudge(s.recon)
	return nil
}

// Schedules is the service's scheduler: its tenants' recurring schedules.
func (s *Service) Schedules() *Scheduler { return s.sched }

// Routes are the routes the service publishes in the registry.
func (s *Service) Routes() []schema.Route { return RouteTable }

// Handler serves the service's routes on their own router: the tenant routes behind sk's gate,
// the admin ones behind its token check. It also binds the claims to sk: a job is claimed
// only while sk serves its tenant (its lease holds), so an instance frozen or cut off from
// NATS, whose tenants a takeover gives to another shard, claims nothing once it wakes.
func (s *Service) Handler(sk *shardkit.Shard) http.Handler {
	serving := sk.Serving
	s.serving.Store(&serving)
	s.gateView.Store(sk.Watcher())
	r := chi.NewRouter()
	s.Mount(r, sk.Gate, sk.RequireAdmin)
	return r
}

// servingNow reports whether this instance may start work for tenant now: without a bound
// shard (tests that run the service alone), its own placement view decides.
func (s *Service) servingNow(tenant string) bool {
	if fn := s.serving.Load(); fn != nil {
		return (*fn)(tenant)
	}
	return true
}

// Owned lists the tenants this instance acquires now, sorted.
func (s *Service) Owned() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for t, tq := range s.tenants {
		if tq.acquired && !tq.released {
			out = append(out, t)
		}
	}
	slices.Sort(out)
	return out
}

func nudge(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// placementOf is the tenant's placement as this instance knows it soonest: the newer of the
// bound shard's view (which admitted the request at hand) and the service's own.
func (s *Service) placementOf(tenant string) placement.Entry {
	e, _ := s.watcher.Lookup(Kind, tenant)
	if w := s.gateView.Load(); w != nil {
		if g, ok := w.Lookup(Kind, tenant); ok && g.Revision > e.Revision {
			return g
		}
	}
	return e
}
