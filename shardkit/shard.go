package shardkit

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/internal/ctxtime"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// Shard is one instance of a shard service as shardkit sees it. Make it with New, mount Gate
// and Mount on the service's router, and call Run; Shutdown (or cancelling Run's context) drains
// and unregisters.
type Shard struct {
	cfg     Config
	kind    string
	self    string // the instance key
	st      *schema.Store
	watcher *placement.Watcher
	view    placement.View // the watcher's view of this shard's kind
	shared  bool           // watcher is Config.Watcher: the caller runs it
	metrics *metrics
	states  *stateMap
	peers   *peerView   // the kind's directory in memory
	signals *signalView // the kind's tenant signals in memory
	proxy   http.Handler
	api     *adminAPI
	moves   *mover
	gk      *gatekeeper
	fwd     *forwarder
	rep     *reporter
	ver     *verifier

	// servedBy is the x-served-by value, shared by every response (never modified).
	servedBy []string

	inflight atomic.Int64
	closing  atomic.Bool // whole-instance drain: refuse new requests
	idle     chan struct{}
	ready    atomic.Bool
	kindCfg  atomic.Pointer[schema.KindConfig]
	// lease is how long the instance serves after its newest placement confirmation
	// (KindConfig.Lease when it started); see leaseHolds.
	lease atomic.Int64

	changeMu sync.Mutex
	changed  chan struct{} // closed and replaced on every placement change

	queueMu sync.Mutex
	queue   []placement.Change
	queued  chan struct{}

	runCtx    context.Context // lives while Run runs; tasks derive from it
	cancel    context.CancelFunc
	tasks     sync.WaitGroup
	taskMu    sync.Mutex
	noTasks   bool // set once Run stops waiting for tasks
	started   atomic.Bool
	stopped   chan struct{} // closed when Run's loops have stopped
	hbStopped chan struct{} // closed when the heartbeat loop has returned
	running   chan struct{} // closed once registered and serving
	shutOnce  sync.Once
	shutErr   error
	shutDone  chan struct{}

	instMu sync.Mutex
	inst   schema.Instance

	consumers consumers // waiting consumers per affinity key (Waiting)

	// member is what the membership entry (tm_members) last written holds; memberStale asks
	// the next heartbeat to write it again whatever it holds.
	memberMu    sync.Mutex
	member      schema.Instance
	memberStale atomic.Bool
	routesStale atomic.Bool // re-assert the routes at the next heartbeat
}

// New makes a Shard from cfg; nothing touches the network until Run.
func New(cfg Config) (*Shard, error) {
	cfg = cfg.withDefaults()
	if err := cfg.valid(); err != nil {
		return nil, err
	}
	s := &Shard{
		cfg:       cfg,
		kind:      cfg.ID.Kind,
		self:      cfg.ID.Key(),
		st:        cfg.Store,
		idle:      make(chan struct{}, 1),
		changed:   make(chan struct{}),
		queued:    make(chan struct{}, 1),
		stopped:   make(chan struct{}),
		hbStopped: make(chan struct{}),
		running:   make(chan struct{}),
		shutDone:  make(chan struct{}),
		servedBy:  []string{cfg.ID.Key()},
	}
	s.api, s.moves, s.gk, s.fwd, s.rep = &adminAPI{s}, &mover{s}, &gatekeeper{s}, &forwarder{s}, &reporter{s: s}
	if s.cfg.Transport == nil {
		s.cfg.Transport = s.fwd.defaultTransport()
	}
	s.runCtx, s.cancel = context.WithCancel(context.Background())
	s.metrics = newMetrics(cfg.Registerer, s)
	s.ver = newVerifier(s)
	s.cfg.Hooks = s.ver.wrap(cfg.Hooks)
	s.states = newStateMap(s.metrics.seriesFor)
	s.peers, s.signals = newPeerView(s), newSignalView(s)
	if cfg.Forward {
		s.proxy = s.fwd.newProxy()
	}
	if cfg.Watcher != nil {
		s.watcher, s.shared = cfg.Watcher, true
		s.view = s.watcher.View(s.kind)
		return s, nil
	}
	w, err := placement.New(placement.Config{
		Store:      cfg.Store,
		Kinds:      []string{s.kind},
		OnChange:   s.onChange,
		Confirm:    cfg.Confirm,
		Logger:     cfg.Logger,
		Registerer: cfg.Registerer,
	})
	if err != nil {
		return nil, fmt.Errorf("shardkit: %w", err)
	}
	s.watcher, s.view = w, w.View(s.kind)
	return s, nil
}

// ID is the instance's id.
func (s *Shard) ID() schema.InstanceID { return s.cfg.ID }

// Watcher is the shard's placement watcher (read-only use: Lookup, Stats).
func (s *Shard) Watcher() *placement.Watcher { return s.watcher }

// Running is closed once Run has registered the instance and takes traffic.
func (s *Shard) Running() <-chan struct{} { return s.running }

// Stopped is closed once Run has returned.
func (s *Shard) Stopped() <-chan struct{} { return s.stopped }

// Ready reports whether the instance takes traffic: running, registered and not shutting down.
func (s *Shard) Ready() bool { return s.ready.Load() }

// Run registers the instance, publishes its routes, follows placement and heartbeats until ctx
// ends; then it shuts down cleanly (see Shutdown) and returns. It returns early with an error
// if it cannot start.
func (s *Shard) Run(ctx context.Context) error {
	if !s.started.CompareAndSwap(false, true) {
		return errors.New("shardkit: Run called twice")
	}
	runCtx, cancel := s.runCtx, s.cancel
	var loops sync.WaitGroup
	defer func() {
		cancel()
		loops.Wait()
		s.taskMu.Lock()
		s.noTasks = true
		s.taskMu.Unlock()
		s.tasks.Wait()
		close(s.stopped)
	}()
	if s.shared {
		defer s.watcher.Subscribe(s.onChange)()
	} else {
		loops.Go(func() { _ = s.watcher.Run(runCtx) })
	}
	if err := s.peers.start(runCtx, &loops); err != nil {
		return err
	}
	if err := s.signals.start(runCtx, &loops); err != nil {
		return err
	}
	// start's calls end when Run's ctx or Shutdown ends, so Shutdown never races a registration.
	sctx, scancel := context.WithCancel(runCtx)
	stopStart := context.AfterFunc(ctx, scancel)
	err := s.start(sctx)
	stopStart()
	scancel()
	if err != nil {
		s.undoRegister()
		return err
	}
	// The rebalancer's liveness probe: answered while the process runs and holds its NATS
	// connection, so a probe with no responders tells at once that the instance is gone.
	ping, err := s.st.JS().Conn().Subscribe(schema.PingSubject(s.cfg.ID), func(m *nats.Msg) { _ = m.Respond(nil) })
	if err != nil {
		s.undoRegister()
		return fmt.Errorf("shardkit: answer liveness probes on %s: %w", schema.PingSubject(s.cfg.ID), err)
	}
	defer func() { _ = ping.Unsubscribe() }()
	s.ready.Store(true)
	loops.Go(func() { s.applyLoop(runCtx) })
	loops.Go(func() { s.rep.heartbeatLoop(runCtx) })
	close(s.running)
	s.cfg.Logger.Info("shard instance running", "instance", s.self, "url", s.cfg.URL, "forward", s.cfg.Forward)
	select {
	case <-ctx.Done():
		sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.DrainTimeout+10*time.Second)
		defer scancel()
		return s.Shutdown(sctx)
	case <-s.shutDone:
		return s.shutErr
	}
}

// start waits for placement, reads the kind and registers the instance and its routes.
func (s *Shard) start(ctx context.Context) error {
	// On a new cluster the placement buckets can take a while to answer: wait up to two
	// minutes, saying so, rather than exit.
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	go func() {
		t := time.NewTicker(10 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				s.cfg.Logger.Info("waiting for the placement of the kind to load", "kind", s.kind)
			case <-s.watcher.Ready():
				return
			case <-wctx.Done():
				return
			}
		}
	}()
	if err := s.watcher.WaitReady(wctx); err != nil {
		return fmt.Errorf("shardkit: %w", err)
	}
	if err := s.peers.waitReady(wctx); err != nil {
		return err
	}
	kc, err := s.st.Kinds().Get(wctx, s.kind)
	if err != nil {
		return fmt.Errorf("shardkit: read kind %s: %w", s.kind, err)
	}
	if err := s.checkFallback(kc); err != nil {
		return err
	}
	s.kindCfg.Store(&kc)
	s.lease.Store(int64(kc.Lease.D()))
	if every := s.watcher.ConfirmEvery(); every > kc.Lease.D()/4 {
		s.cfg.Logger.Warn("the placement view is confirmed less often than a quarter of the kind's lease: a short NATS hiccup will make the instance refuse requests",
			"confirm", every, "lease", kc.Lease.D())
	}
	if err := s.watcher.WaitConfirmed(wctx, s.kind); err != nil {
		return fmt.Errorf("shardkit: %w", err)
	}
	return s.register(wctx)
}

// leaseHolds reports whether the instance may serve its tenants now: its view of placement was
// confirmed with the placement stream's leader within its lease. An instance cut off from NATS
// (or frozen: the monotonic clock counts the pause) stops serving within the lease, which is
// what a takeover of its tenants waits out (docs/design.md, "Failover").
func (s *Shard) leaseHolds() bool {
	age, ok := s.view.Confirmed() // the monotonic clock alone: cheaper than time.Now
	return ok && age < time.Duration(s.lease.Load())
}

// leaseHoldsAt is leaseHolds at now (a time.Now reading the caller has).
func (s *Shard) leaseHoldsAt(now time.Time) bool {
	age, ok := s.view.ConfirmedAt(now)
	return ok && age < time.Duration(s.lease.Load())
}

// Serving reports whether this instance serves tenant now: its shard owns it, at the current
// placement, and the instance's lease holds. Work a service does for a tenant outside a request
// (the runner claiming a job) checks it first.
func (s *Shard) Serving(tenant string) bool {
	e, ok := s.watcher.Lookup(s.kind, tenant)
	return ok && s.gk.owns(e) && s.leaseHolds()
}

// WriteEpoch is the epoch at which this instance may write tenant's state now: the placement's
// epoch while its shard owns the tenant (or is the source of its handoff, finishing the
// requests in flight) and its lease holds; 0 otherwise (another shard owns it, a takeover is
// under way or done, the lease ran out). shardkit/events' Log.SetWriteEpoch takes it: a tenant
// whose events carry a newer epoch marker (a takeover's) is then fenced here.
func (s *Shard) WriteEpoch(tenant string) uint64 {
	e, ok := s.watcher.Lookup(s.kind, tenant)
	if !ok || !s.leaseHolds() {
		return 0
	}
	if s.gk.owns(e) || (e.Phase == schema.PhaseHandoff && e.Shard == s.cfg.ID.Shard) {
		return e.Epoch
	}
	return 0
}

// register writes the directory entry and publishes the routes.
func (s *Shard) register(ctx context.Context) error {
	capacity := s.cfg.Capacity
	if capacity == 0 {
		if kc := s.kindCfg.Load(); kc != nil {
			capacity = kc.Capacity
		}
	}
	s.instMu.Lock()
	inst := schema.Instance{InstanceID: s.cfg.ID, URL: s.cfg.URL, Capacity: capacity, Labels: s.cfg.Labels,
		Version: s.cfg.Version, Started: s.inst.Started, Reported: schema.StatusOnline, RefreshMS: s.cfg.DirectoryRefresh.Milliseconds(),
		LeaseMS: time.Duration(s.lease.Load()).Milliseconds()}
	s.instMu.Unlock()
	inst, err := s.st.Directory().Register(ctx, inst)
	if err != nil {
		return fmt.Errorf("shardkit: register %s: %w", s.self, err)
	}
	s.instMu.Lock()
	s.inst = inst
	s.instMu.Unlock()
	s.memberMu.Lock()
	s.member = inst
	s.memberMu.Unlock()
	s.rep.registered(inst)
	for _, r := range s.routes() {
		if _, err := s.st.Routes().AddInstance(ctx, r, s.cfg.ID); err != nil {
			return fmt.Errorf("shardkit: publish route %s %s: %w", r.Method, r.Prefix, err)
		}
	}
	return nil
}

// undoRegister removes whatever a failed start registered (best effort).
func (s *Shard) undoRegister() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, r := range s.routes() {
		_, _ = s.st.Routes().RemoveInstance(ctx, r, s.cfg.ID)
	}
	_ = s.st.Directory().Unregister(ctx, s.cfg.ID)
}

func (s *Shard) routes() []schema.Route {
	out := make([]schema.Route, 0, len(s.cfg.Routes))
	for _, r := range s.cfg.Routes {
		if r.Kind == "" {
			r.Kind = s.kind
		}
		r.Instances = nil
		out = append(out, r)
	}
	return out
}

// Shutdown is the whole-instance drain: it reports not-ready (readyz and the directory's
// "draining" status) first, keeps serving for ShutdownGrace, then refuses new requests and waits, within DrainTimeout, for those
// in flight; then it removes its routes and directory entry and its tenant signals, and stops
// Run. It is idempotent; later calls return the first call's result.
func (s *Shard) Shutdown(ctx context.Context) error {
	s.shutOnce.Do(func() {
		s.shutErr = s.shutdown(ctx)
		close(s.shutDone)
	})
	return s.shutErr
}

// Close is Shutdown with a bound of DrainTimeout plus 10s, waiting for Run to stop.
func (s *Shard) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.DrainTimeout+10*time.Second)
	defer cancel()
	err := s.Shutdown(ctx)
	if s.started.Load() {
		select {
		case <-s.stopped:
		case <-ctx.Done():
		}
	}
	return err
}

func (s *Shard) shutdown(ctx context.Context) error {
	s.ready.Store(false)
	if !s.started.Load() {
		s.closing.Store(true)
		s.cancel()
		return nil
	}
	log := s.cfg.Logger
	s.instMu.Lock()
	inst := s.inst
	s.instMu.Unlock()
	if inst.URL != "" {
		inst.Reported = schema.StatusDraining
		if got, err := s.st.Directory().Heartbeat(ctx, inst); err != nil {
			log.Warn("reporting draining", "err", err)
		} else {
			s.rep.syncMember(ctx, got)
		}
	}
	if s.cfg.ShutdownGrace > 0 {
		ctxtime.Sleep(ctx, s.cfg.ShutdownGrace) // routers notice "draining" while we still serve
	}
	s.closing.Store(true)
	if n := s.waitIdle(ctx, s.cfg.DrainTimeout); n > 0 {
		log.Warn("shutdown: requests still in flight after the drain bound", "in_flight", n)
	}
	s.cancel() // stop heartbeats, telemetry, tasks
	// Once heartbeats have stopped nothing re-creates the entry or re-adds a route.
	select {
	case <-s.hbStopped:
	case <-s.stopped:
	case <-ctx.Done():
	}
	var errs []error
	for _, r := range s.routes() {
		if _, err := s.st.Routes().RemoveInstance(ctx, r, s.cfg.ID); err != nil {
			errs = append(errs, fmt.Errorf("unpublish route %s %s: %w", r.Method, r.Prefix, err))
		}
	}
	for _, ts := range s.states.all() {
		ts.mu.Lock()
		had := ts.phase != ""
		ts.mu.Unlock()
		if had {
			if err := s.st.Signals().Delete(ctx, s.kind, ts.tenant, s.cfg.ID); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if err := s.st.Directory().Unregister(ctx, s.cfg.ID); err != nil {
		errs = append(errs, fmt.Errorf("unregister: %w", err))
	}
	log.Info("shard instance stopped", "instance", s.self)
	return errors.Join(errs...)
}

// waitIdle waits up to bound for the instance's in-flight count to reach zero and returns it.
func (s *Shard) waitIdle(ctx context.Context, bound time.Duration) int64 {
	t := time.NewTimer(bound)
	defer t.Stop()
	for {
		n := s.inflight.Load()
		if n <= 0 {
			return 0
		}
		select {
		case <-s.idle:
		case <-t.C:
			return s.inflight.Load()
		case <-ctx.Done():
			return s.inflight.Load()
		}
	}
}

// onChange runs on the watcher's apply goroutine: wake epoch waiters and queue the changes
// that may need work (see handleChange).
func (s *Shard) onChange(c placement.Change) {
	s.changeMu.Lock()
	close(s.changed)
	s.changed = make(chan struct{})
	s.changeMu.Unlock()
	if !s.involved(c) {
		return
	}
	s.queueMu.Lock()
	s.queue = append(s.queue, c)
	s.queueMu.Unlock()
	select {
	case s.queued <- struct{}{}:
	default:
	}
}

// involved reports whether a change may need work here: it names this shard, and it is not
// just a tenant placed (or staying) active here that this instance holds no state for, which
// is most of the changes at start.
func (s *Shard) involved(c placement.Change) bool {
	me := s.cfg.ID.Shard
	names := func(ok bool, e placement.Entry) bool {
		return ok && (e.Shard == me || e.Target == me || e.Source == me || s.gk.inOwners(e.Owners))
	}
	if !names(c.OldOK, c.Old) && !names(c.NewOK, c.New) {
		return false
	}
	quiet := c.NewOK && c.New.Phase == schema.PhaseActive && s.gk.owns(c.New) && (!c.OldOK || c.Old.Phase == schema.PhaseActive && s.gk.owns(c.Old))
	return !quiet || s.states.get(c.Tenant) != nil
}

// changes returns a channel closed at the next placement change.
func (s *Shard) changes() <-chan struct{} {
	s.changeMu.Lock()
	defer s.changeMu.Unlock()
	return s.changed
}

// WaitPlacement waits until the local placement snapshot has applied revision rev of the
// kind's placement bucket (for example the revision a Placements(kind).Update returned). It
// wakes on routing changes (owner, epoch, phase, target, source, owners): wait for revisions
// that made one, as every step of a move does.
func (s *Shard) WaitPlacement(ctx context.Context, rev uint64) error {
	for {
		ch := s.changes()
		if s.watcher.Revision(s.kind) >= rev {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("shardkit: waiting for placement revision %d: %w", rev, ctx.Err())
		}
	}
}

// applyLoop hands queued placement changes to handleChange, in order.
func (s *Shard) applyLoop(ctx context.Context) {
	for {
		select {
		case <-s.queued:
		case <-ctx.Done():
			return
		}
		s.queueMu.Lock()
		q := s.queue
		s.queue = nil
		s.queueMu.Unlock()
		for _, c := range q {
			s.moves.handleChange(c)
		}
	}
}

// problem builds a problem+json body about tenant.
func (s *Shard) problem(status int, typ, title, tenant, detail string) tmhttp.Problem {
	return tmhttp.Problem{Type: tmhttp.TypeBase + typ, Title: title, Status: status, Detail: detail,
		Tenant: tenant, Kind: s.kind}
}

// goTask runs fn on a goroutine that Run waits for; after Run stopped, fn does not run.
func (s *Shard) goTask(fn func()) bool {
	s.taskMu.Lock()
	defer s.taskMu.Unlock()
	if s.noTasks {
		return false
	}
	s.tasks.Go(fn)
	return true
}
