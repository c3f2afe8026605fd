// Package server is `rebalancer serve`: the rebalancer's long-running process. It holds the
// leader lease when it can and, while it leads, applies plans, sweeps the instance directory
// (package sweeper) and writes compacted placement snapshots; every instance, leader or not,
// serves the read side of the HTTP API and the event stream the dashboard uses.
//
// # HTTP API
//
//	GET  /api/plans                 plans, newest first, with move counts
//	POST /api/plans                 make a plan from a planner.Request (+ "dry_run")
//	GET  /api/plans/{id}            one plan and its moves
//	POST /api/plans/{id}/apply      apply in the background: 202; 409 if not the leader or busy
//	POST /api/plans/{id}/rollback   roll back in the background: 202; 409 likewise
//	GET  /api/instances             the directory with derived statuses (?kind=)
//	GET  /api/instances/{key}       one instance: fields, tenants, recent runs, circuits, history
//	PUT  /api/instances/{key}/degraded   flag it degraded by hand ({"reason": ...})
//	DELETE /api/instances/{key}/degraded clear that flag
//	GET  /api/audit                 the audit journal (?kind= &tenant= &since= &limit=)
//	GET  /api/tenants               the largest tenants by stored size, from telemetry (?kind= &limit=)
//	GET  /api/kinds                 kind configs
//	PUT  /api/kinds/{kind}          register or replace a kind's config (schema.KindConfig)
//	GET  /api/leader                the leader lease and whether this process holds it
//	GET  /api/plans/{id}/verify     judge the plan's moves by their state digests at the fence
//	GET  /api/plans/{id}/moves/{move}/verify   one move's verdict
//	GET  /api/events                server-sent events: plan, move, audit, instance, verify, job.created, job_run.done
//	GET  /healthz /readyz /metrics
//	GET  /openapi.json              this API as an OpenAPI 3.1 document (openapi.json)
//
// Every request that is not a GET or HEAD (the POST and PUT routes above) changes state and
// needs Authorization: Bearer <Config.AdminToken>: 401 without it, and 403 for all of them when
// no token is configured. Reads of /api/ need Config.ReadToken or the admin token (loopback
// clients only when no read token is set); probes, /metrics and the dashboard's files stay
// open (guard.go).
//
// Errors are problem+json (shardkit/tmhttp), mapped in one function (errorFor).
package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/tenantmesh/tenantmesh/internal/backoff"
	"github.com/tenantmesh/tenantmesh/internal/ctxtime"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/autopilot"
	"github.com/tenantmesh/tenantmesh/rebalancer/dashboard"
	"github.com/tenantmesh/tenantmesh/rebalancer/sweeper"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Config configures a Server. Zero fields take the documented defaults.
type Config struct {
	Store *schema.Store
	// Holder names this process in the leader lease. Keep it stable across restarts of the same
	// process and distinct between processes. Default "rebalancer".
	Holder string
	// LeaseTTL is the leader lease's lifetime, renewed every third of it. Default 10s.
	LeaseTTL time.Duration
	// Engine timeouts (see rebalancer.Config); zero: the engine's defaults.
	WarmTimeout, HandoffTimeout, DrainTimeout time.Duration
	// PauseBudget paces a plan's moves by their handoff pauses (rebalancer.Config.PauseBudget).
	PauseBudget time.Duration
	// Health decides instance statuses (offline threshold default 2m).
	Health rebalancer.Health
	// Sweep configures the sweeper; Store, Health, Logger and Registerer are filled in.
	Sweep sweeper.Config
	// NoCompact disables the compacting placement watcher.
	NoCompact bool
	// CompactEvery and CompactInterval tune the compacting watcher (placement.Config).
	CompactEvery    int
	CompactInterval time.Duration
	// Presence tunes how fast dead instances are noticed (rebalancer.PresenceConfig).
	Presence rebalancer.PresenceConfig
	// Autopilot configures the autopilot the leader runs (mode off, dry-run or on; guardrails).
	Autopilot autopilot.Config
	// AdminToken is the bearer token every route that changes state (not GET or HEAD) needs.
	// Empty: those routes are refused with 403.
	AdminToken string
	// ReadToken (or AdminToken) is what the API's reads need (guard.go). Empty: reads are
	// served to loopback clients only.
	ReadToken string
	// Logger; if nil, logs are discarded.
	Logger *slog.Logger
	// Registry receives metrics and is served on /metrics. Default a new registry with the Go
	// and process collectors.
	Registry *prometheus.Registry
}

// Server is the rebalancer service.
type Server struct {
	cfg      Config
	st       *schema.Store
	eng      *rebalancer.Engine
	sweep    *sweeper.Sweeper
	tel      *rebalancer.Telemetry
	presence *rebalancer.Presence
	auto     *autopilot.Autopilot
	// placements is the leader's placement watcher (compaction, and the autopilot's shard
	// counts); nil while not leading.
	placements atomic.Pointer[placement.Watcher]
	// circuits are the gateways' circuit reports, for an instance's page.
	circuits *rebalancer.Circuits
	hub      *hub
	log      *slog.Logger
	reg      *prometheus.Registry

	mu       sync.Mutex
	leadCtx  context.Context // non-nil while this process holds the lease
	busy     string          // the plan being applied or rolled back, "" when idle
	busyDone chan struct{}   // closed when that apply ends
	work     sync.WaitGroup  // background applies
	leaderG  prometheus.Gauge
	applying prometheus.Gauge
	moves    moveTracker // moves in progress, from the watch of tm_rebalance
	verify   *autoVerifier
}

// New makes a server; it does nothing until Run.
func New(cfg Config) (*Server, error) {
	if cfg.Store == nil {
		return nil, errors.New("server: Store is required")
	}
	if cfg.Holder == "" {
		cfg.Holder = "rebalancer"
	}
	if cfg.LeaseTTL <= 0 {
		cfg.LeaseTTL = 10 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Registry == nil {
		cfg.Registry = prometheus.NewRegistry()
		cfg.Registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	s := &Server{cfg: cfg, st: cfg.Store, log: cfg.Logger, reg: cfg.Registry, hub: newHub()}
	pc := cfg.Presence
	pc.Logger = cfg.Logger
	s.presence = rebalancer.NewPresence(cfg.Store, pc)
	eng, err := rebalancer.New(rebalancer.Config{Store: cfg.Store, Holder: cfg.Holder, LeaseTTL: cfg.LeaseTTL, LeaseHeld: true,
		WarmTimeout: cfg.WarmTimeout, HandoffTimeout: cfg.HandoffTimeout, DrainTimeout: cfg.DrainTimeout, PauseBudget: cfg.PauseBudget,
		Thresholds: cfg.Health.Thresholds, Presence: s.presence, Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	s.eng = eng
	ac := cfg.Autopilot
	ac.Logger, ac.Registerer = cfg.Logger, cfg.Registry
	if ac.Actor == "" {
		ac.Actor = "autopilot/" + cfg.Holder
	}
	s.auto, err = autopilot.New(ac, autopilot.Deps{Store: cfg.Store, Engine: eng, Presence: s.presence,
		ShardTenants: s.shardTenants, Takeovers: s.takeovers, OperatorBusy: s.operatorBusy,
		Apply: func(ctx context.Context, id string) (rebalancer.PlanRecord, error) {
			return resumed(ctx, s.log, id, func(c context.Context) (rebalancer.PlanRecord, error) { return s.eng.Apply(c, id) })
		}})
	if err != nil {
		return nil, err
	}
	sc := cfg.Sweep
	sc.Store, sc.Health, sc.Logger, sc.Registerer = cfg.Store, cfg.Health, cfg.Logger, cfg.Registry
	sc.Actor = "rebalancer/" + cfg.Holder
	next := sc.OnEvent
	sc.OnEvent = func(ev sweeper.Event) {
		s.hub.publish("instance", ev)
		if next != nil {
			next(ev)
		}
	}
	if s.sweep, err = sweeper.New(sc); err != nil {
		return nil, err
	}
	s.leaderG = prometheus.NewGauge(prometheus.GaugeOpts{Name: "tm_rebalancer_leader", Help: "1 while this process holds the leader lease."})
	s.applying = prometheus.NewGauge(prometheus.GaugeOpts{Name: "tm_rebalancer_applying", Help: "1 while this process applies or rolls back a plan."})
	stalled := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "tm_rebalancer_move_stalled_seconds",
		Help: "How long the move in progress (warming, handoff or committed) that stepped longest ago has gone without a step; 0 when none. Every process reports it from tm_rebalance."},
		func() float64 { return s.moves.stalled(time.Now()).Seconds() })
	limit := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "tm_rebalancer_move_limit",
		Help: "How many moves the plan being applied may run at once: its concurrency, or fewer while handoff pauses exceed the pause budget; 0 when none is applied."},
		func() float64 { return float64(s.eng.MoveLimit()) })
	for _, c := range []prometheus.Collector{s.leaderG, s.applying, s.hub.dropped, stalled, limit} {
		if err := s.reg.Register(c); err != nil {
			return nil, err
		}
	}
	if s.verify, err = newAutoVerifier(s); err != nil {
		return nil, err
	}
	return s, nil
}

// Engine is the server's engine (for tests and embedding).
func (s *Server) Engine() *rebalancer.Engine { return s.eng }

// IsLeader reports whether this process holds the leader lease.
func (s *Server) IsLeader() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.leadCtx != nil
}

// Serve runs the server on ln until ctx ends, then shuts down: HTTP first (event streams are
// closed), then background applies stop at their next step (they resume on the next leader),
// then the lease is released.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if err := s.Start(rctx); err != nil {
		return err
	}
	srv := &http.Server{Handler: s.Handler(), ReadHeaderTimeout: 5 * time.Second, MaxHeaderBytes: 64 << 10,
		ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelWarn), BaseContext: func(net.Listener) context.Context { return rctx }}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	s.log.Info("rebalancer serving", "addr", ln.Addr().String(), "holder", s.cfg.Holder)
	var err error
	select {
	case <-ctx.Done():
	case err = <-errc:
	}
	s.hub.close()
	sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
	_ = srv.Shutdown(sctx)
	scancel()
	cancel()
	s.Wait()
	if errors.Is(err, http.ErrServerClosed) {
		err = nil
	}
	return err
}

// Start runs the background parts (telemetry, event sources, the leadership loop) until ctx
// ends; Wait waits for them. Serve calls both.
func (s *Server) Start(ctx context.Context) error {
	tel, err := rebalancer.WatchTelemetry(s.st, "", s.presence.Heard)
	if err != nil {
		return err
	}
	s.tel = tel
	s.auto.SetTelemetry(tel)
	s.work.Go(func() {
		if err := s.presence.Run(ctx); err != nil {
			s.log.Error("presence stopped: dead instances are noticed only by their directory entries' age", "err", err)
		}
	})
	circuits, err := rebalancer.WatchCircuits(s.st)
	if err != nil {
		tel.Stop()
		return err
	}
	s.circuits = circuits
	if err := s.startEvents(ctx); err != nil {
		tel.Stop()
		circuits.Stop()
		return err
	}
	s.work.Go(func() {
		<-ctx.Done()
		tel.Stop()
		circuits.Stop()
		s.hub.close() // ends the event streams
	})
	s.work.Go(func() { s.leadLoop(ctx) })
	return nil
}

// Wait waits for everything Start started to stop.
func (s *Server) Wait() { s.work.Wait() }

// leadLoop tries to take the leader lease and, while it holds it, runs the leader's work.
func (s *Server) leadLoop(ctx context.Context) {
	retry := s.cfg.LeaseTTL / 3
	for ctx.Err() == nil {
		l, err := s.st.Rebalance().AcquireLease(ctx, schema.LeaderLease, s.cfg.Holder, s.cfg.LeaseTTL)
		if err != nil {
			if !errors.Is(err, schema.ErrLeaseHeld) && ctx.Err() == nil {
				s.log.Warn("leader lease", "err", err)
			}
			ctxtime.Sleep(ctx, retry)
			continue
		}
		s.lead(ctx, l)
	}
}

// lead does the leader's work until ctx ends or the lease is lost.
func (s *Server) lead(ctx context.Context, l jsx.Lease) {
	lctx, cancel := context.WithCancel(ctx)
	s.mu.Lock()
	s.leadCtx = lctx
	s.mu.Unlock()
	s.leaderG.Set(1)
	s.log.Info("leading", "holder", s.cfg.Holder)
	s.hub.publish("leader", map[string]any{"holder": s.cfg.Holder, "leading": true})
	var wg sync.WaitGroup
	wg.Go(func() { _ = s.sweep.Run(lctx) })
	wg.Go(func() { _ = s.auto.Run(lctx) })
	wg.Go(func() { s.resumeApplying(lctx) })
	wg.Go(func() { s.compact(lctx) }) // the placement watcher: compaction unless NoCompact, the autopilot's counts
	t := time.NewTicker(s.cfg.LeaseTTL / 3)
	for lctx.Err() == nil {
		select {
		case <-t.C:
			nl, err := s.st.Rebalance().RenewLease(lctx, l, s.cfg.LeaseTTL)
			switch {
			case errors.Is(err, schema.ErrLeaseHeld):
				s.log.Error("leader lease lost", "err", err)
				cancel()
			case err != nil:
				s.log.Warn("lease renewal failed; retrying", "err", err)
			default:
				l = nl
			}
		case <-lctx.Done():
		}
	}
	t.Stop()
	s.mu.Lock()
	s.leadCtx = nil
	s.mu.Unlock()
	cancel()
	wg.Wait()
	s.waitIdle()
	s.leaderG.Set(0)
	rctx, rcancel := context.WithTimeout(context.Background(), 2*time.Second)
	_ = s.st.Rebalance().ReleaseLease(rctx, l)
	rcancel()
	s.hub.publish("leader", map[string]any{"holder": s.cfg.Holder, "leading": false})
}

// resumeApplying finishes, oldest first, the plans a previous leader left applying (it crashed
// or lost its lease): the engine resumes each move from what the placement says.
func (s *Server) resumeApplying(ctx context.Context) {
	plans, err := s.eng.Plans(ctx)
	if err != nil {
		s.log.Warn("listing plans to resume", "err", err)
		return
	}
	for i := len(plans) - 1; i >= 0; i-- {
		id := plans[i].ID
		if plans[i].Status != rebalancer.PlanApplying {
			continue
		}
		if plans[i].Origin == "autopilot" {
			s.auto.Adopt(ctx, plans[i]) // in the autopilot's lanes: a failover does not wait for anything
			continue
		}
		s.log.Info("resuming a plan left applying", "plan", id)
		for {
			err := s.startWork(ctx, id, func(c context.Context) (rebalancer.PlanRecord, error) { return s.eng.Apply(c, id) })
			if err == nil {
				break
			}
			if !errors.Is(err, errBusy) || ctx.Err() != nil {
				return
			}
			ctxtime.Sleep(ctx, 200*time.Millisecond) // an operator's apply runs; resume after it
		}
		s.mu.Lock()
		done := s.busyDone
		s.mu.Unlock()
		select {
		case <-done:
		case <-ctx.Done():
			return
		}
	}
}

// compact runs a placement watcher with Compact for every registered kind, so gateways and
// shards cold-start from a snapshot; it restarts the watcher when the set of kinds changes.
func (s *Server) compact(ctx context.Context) {
	for ctx.Err() == nil {
		kcs, err := s.st.Kinds().List(ctx)
		if err != nil || len(kcs) == 0 {
			ctxtime.Sleep(ctx, 5*time.Second)
			continue
		}
		var kinds []string
		for _, k := range kcs {
			kinds = append(kinds, k.Kind)
		}
		slices.Sort(kinds)
		w, err := placement.New(placement.Config{Store: s.st, Kinds: kinds, Compact: !s.cfg.NoCompact, CompactEvery: s.cfg.CompactEvery,
			CompactInterval: s.cfg.CompactInterval, Logger: s.log})
		if err != nil {
			s.log.Warn("compacting watcher", "err", err)
			return
		}
		wctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); _ = w.Run(wctx) }()
		s.placements.Store(w)
		for wctx.Err() == nil {
			ctxtime.Sleep(wctx, 30*time.Second)
			if now, err := s.st.Kinds().List(wctx); err == nil && len(now) != len(kinds) {
				cancel()
			}
		}
		cancel()
		<-done
		s.placements.Store(nil)
	}
}

// shardTenants counts kind's tenants per shard from the leader's placement watcher (nil
// before it is ready).
func (s *Server) shardTenants(kind string) map[string]int {
	w := s.placements.Load()
	if w == nil || !w.Has(kind) {
		return nil
	}
	select {
	case <-w.Ready():
		return w.ShardCounts(kind)
	default:
		return nil
	}
}

// takeovers calls fn with kind's tenants in a takeover, from the leader's placement watcher;
// false if the watcher does not follow kind or is not ready.
func (s *Server) takeovers(kind string, fn func(tenant, source string) bool) bool {
	w := s.placements.Load()
	if w == nil || !w.Has(kind) {
		return false
	}
	select {
	case <-w.Ready():
	default:
		return false
	}
	w.Takeovers(kind, func(tenant string, e placement.Entry) bool { return fn(tenant, e.Shard) })
	return true
}

// operatorBusy is the operator's plan this process applies ("" if none).
func (s *Server) operatorBusy() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.busy
}

// errNotLeader and errBusy are answered 409.
var (
	errNotLeader = errors.New("not the leader")
	errBusy      = errors.New("busy")
)

// startWork runs fn (an apply or rollback of plan id) in the background under the leader's
// context, one at a time per process.
func (s *Server) startWork(ctx context.Context, id string, fn func(context.Context) (rebalancer.PlanRecord, error)) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.leadCtx == nil {
		return s.notLeader(ctx)
	}
	if s.busy != "" {
		return fmt.Errorf("%w: plan %s is being applied by this rebalancer; wait for it to finish", errBusy, s.busy)
	}
	s.busy = id
	done := make(chan struct{})
	s.busyDone = done
	s.applying.Set(1)
	lctx := s.leadCtx
	s.work.Go(func() {
		defer close(done)
		s.auto.Yield(lctx, id) // an operator's plan goes first: the autopilot's pauses meanwhile
		rec, err := resumed(lctx, s.log, id, fn)
		if err != nil {
			s.log.Error("apply failed", "plan", id, "err", err)
			s.hub.publish("error", map[string]string{"plan": id, "error": err.Error()})
		} else {
			s.log.Info("plan finished", "plan", rec.ID, "status", rec.Status)
		}
		s.mu.Lock()
		s.busy = ""
		s.mu.Unlock()
		s.applying.Set(0)
	})
	return nil
}

// notLeader is errNotLeader naming the lease's holder.
func (s *Server) notLeader(ctx context.Context) error {
	holder := "another rebalancer"
	if l, ok, err := rebalancer.Lease(ctx, s.st, time.Now()); err == nil && ok {
		holder = fmt.Sprintf("%s (until %s)", l.Holder, l.Expires.Format(time.RFC3339))
	}
	return fmt.Errorf("%w: this rebalancer (%s) does not hold the leader lease; it is held by %s: send the request there", errNotLeader, s.cfg.Holder, holder)
}

// leaderContext is the leader's context (a cancelled one when not leading).
func (s *Server) leaderContext() context.Context {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.leadCtx == nil {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		return ctx
	}
	return s.leadCtx
}

// resumeTries bounds how often an apply or rollback interrupted by NATS is started again.
const resumeTries = 8

// resumed runs fn and, while NATS interrupts it (a record write or read that could not be
// served for now) and this rebalancer still leads, runs it again after a pause: an apply picks
// up each move where its records say it is, as a new leader's does. Without it, one record
// write that timed out under load stopped the whole plan with moves in flight (the scale
// harness: 9 moves left in warming, handoff and committed).
func resumed(ctx context.Context, log *slog.Logger, id string, fn func(context.Context) (rebalancer.PlanRecord, error)) (rebalancer.PlanRecord, error) {
	var rec rebalancer.PlanRecord
	try := 0
	err := backoff.Retry(ctx, backoff.Policy{Initial: time.Second, Max: 5 * time.Second, Tries: resumeTries,
		RetryIf: func(err error) bool { return errors.Is(err, schema.ErrUnavailable) },
		OnRetry: func(err error, pause time.Duration) {
			log.Warn("plan interrupted by NATS; resuming", "plan", id, "attempt", try, "in", pause, "err", err)
		},
	}, func(ctx context.Context) (err error) {
		try++
		rec, err = fn(ctx)
		return err
	})
	return rec, err
}

// waitIdle waits until no background apply runs (after the leader context ended).
func (s *Server) waitIdle() {
	s.mu.Lock()
	busy, done := s.busy, s.busyDone
	s.mu.Unlock()
	if busy != "" {
		<-done // the apply stops at its next step once its ctx ended
	}
}

// Handler is the HTTP API.
func (s *Server) Handler() http.Handler {
	r := chi.NewRouter()
	r.Use(s.guard()) // guard.go
	s.registerPlanRoutes(r)
	s.registerDirectoryRoutes(r)
	s.registerInstanceRoutes(r)
	s.registerTenantRoutes(r)
	s.registerEventRoutes(r)
	s.registerVerifyRoutes(r)
	s.registerAutopilotRoutes(r)
	r.Get("/healthz", s.handleHealthz)
	r.Get("/readyz", s.handleReadyz)
	r.Handle("/metrics", promhttp.HandlerFor(s.reg, promhttp.HandlerOpts{Registry: s.reg}))
	r.Get("/openapi.json", handleOpenAPI)
	r.Handle("/*", dashboard.Handler()) // the dashboard: /, /app.js, /style.css
	return r
}
