// Package gateway is tenantmesh's data plane: every tenant request passes through it.
//
// # Overview
//
// A [Gateway] follows the route registry, the instance directory and the kind configs (KV
// followers from package kvwatch) and every kind's placement (package placement), and keeps
// them as immutable snapshots swapped by pointer, so the request path takes no lock. Each
// request goes through the stages of pipeline.go (docs/design.md "The request path"):
//
//  1. admit: validates x-tenant-id (400) or takes it from the bearer token, matches method and
//     the longest path prefix in the route registry (404), applies the kind's per-tenant rate
//     limit (429);
//  2. place: looks up the placement, assigning an unplaced tenant to the least-loaded shard with
//     room by KV create, or answering 404, as the kind says;
//  3. hold: buffers the body for replay, and holds the request while the tenant is in handoff,
//     until the move commits (then it goes to the new owner, in arrival order) or the kind's
//     hold budget is spent (503 + Retry-After);
//  4. pick: the kind's policy picks the instance (power of two choices on in-flight requests
//     and latency, the load policy's decision table, or the affinity plan), skipping open
//     circuits;
//  5. send: the upstream engine sends it over a pooled HTTP/1.1 connection, adding x-tm-epoch,
//     x-tm-shard, x-tm-kind and x-request-id and stripping every x-tm-* header the client sent;
//     on 421 it refreshes the placement and retries on the owner, on a refused connection it
//     retries another instance;
//  6. answer: relays the response, or the problem+json of the one error mapping.
//
// Plaintext listeners are served by the gateway's own HTTP/1.1 front end (strict parsing,
// package h1); TLS listeners, upgrades and the admin endpoints by net/http's server.
//
// Errors are problem+json with the status table of docs/design.md; the client never sees 421. With
// NATS unreachable the gateway keeps routing from its snapshots and reports their age.
package gateway

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"golang.org/x/time/rate"

	"github.com/tenantmesh/tenantmesh/gateway/breaker"
	"github.com/tenantmesh/tenantmesh/gateway/edgeauth"
	"github.com/tenantmesh/tenantmesh/shardkit/kvwatch"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Config configures a Gateway. Only Store is required; every other zero field takes the default
// its comment names.
type Config struct {
	// Store is the NATS schema store (required).
	Store *schema.Store
	// ID names this gateway in audit events ("gateway/<ID>"). Default: hostname-pid.
	ID string
	// Addr is the listen address. Default ":8080". Ignored when Listener is set.
	Addr string
	// Listener, if set, is served instead of listening on Addr (tests, socket activation).
	Listener net.Listener
	// Auth, if set, checks a bearer JWT on every tenant request (the Cloudlysis PRD's tenant validation at
	// the edge): 401 without a valid one, 403 when x-tenant-id names another tenant, and the
	// token's tenant fills x-tenant-id when the client sent none. Its sub reaches the shard as
	// x-tm-subject.
	Auth *edgeauth.Verifier
	// ShardKey, if set, is the gateways' master key for proving to shards that a request came
	// through a gateway (internal/gatesig): every request to an instance carries X-Tm-Proof,
	// an HMAC with its kind's key over the request line, tenant, epoch, shard and subject, which
	// shardkit's gate checks when the shard has its kind's key (shardkit Config.GatewayKey).
	ShardKey []byte
	// ForwardAuthorization names the kinds whose instances receive the client's
	// Authorization field when Auth is set (the bearer token is the edge's; other kinds do
	// not get it, so an instance cannot replay a user's token). Without Auth the field is
	// the application's own and always goes.
	ForwardAuthorization []string
	// FailedTokens bounds the signature checks of tokens that fail, per client address: a
	// client whose token bucket is empty gets 429 without a check (tokens verified before
	// still pass). Default 10 a second, bursts of 100; a negative rate turns it off.
	FailedTokens      float64
	FailedTokensBurst int
	// AdminToken guards /admin/* and /debug/pprof/ (Authorization: Bearer); without one they
	// are refused. RegistrationToken (or the admin token) guards the affinity servers'
	// registration (/prerender-servers): a registered server receives tenants' traffic.
	AdminToken, RegistrationToken string
	// TLS, if set, serves the listener over TLS (certfile.Reloader picks up renewed files),
	// through net/http's server (HTTP/2 with ALPN); plaintext listeners are served by the
	// gateway's own HTTP/1.1 front end.
	TLS *tls.Config
	// UpstreamCAs verify instances registered with https:// URLs (nil: the system's roots).
	UpstreamCAs *x509.CertPool
	// Logger; if nil, logs are discarded.
	Logger *slog.Logger
	// Registry receives the gateway's metrics and is served on /metrics. Default: a new registry
	// with the Go and process collectors.
	Registry *prometheus.Registry

	// Retries is the number of further attempts after the first (421, unreachable instance).
	// Default 2. A negative value disables retries.
	Retries int
	// RefreshWait bounds the wait for a newer placement after a 421 that names no newer owner.
	// Default 500ms.
	RefreshWait time.Duration
	// MaxReplayBody is the largest request body buffered so that the request can be retried or
	// held; larger bodies are streamed and never replayed. Default 1 MiB.
	MaxReplayBody int64
	// MaxBodyBytes bounds request bodies (413 beyond). Default 32 MiB; negative: no bound.
	MaxBodyBytes int64
	// MaxHeaderBytes bounds request headers. Default 64 KiB.
	MaxHeaderBytes int
	// ReadHeaderTimeout bounds reading a request's headers. Default 5s.
	ReadHeaderTimeout time.Duration
	// IdleTimeout closes idle client connections. Default 2m.
	IdleTimeout time.Duration
	// BodyReadTimeout bounds each wait for more of a request body; after it, the body must
	// also keep arriving at MinBodyRate bytes a second on average since it began. A body that
	// does not is answered 408 and its connection closed, so a client that stops sending
	// cannot hold a connection, a goroutine and a buffer. Defaults 10s and 1024 (nginx's
	// client_body_timeout is 60s between reads; the average rate is what stops a client
	// that sends a byte every few seconds). A negative MinBodyRate checks no rate.
	BodyReadTimeout time.Duration
	MinBodyRate     int64
	// WriteTimeout bounds each write to a client: a client that does not take the answer's
	// bytes for this long is cut off (a slow reader cannot pin the connection, the request
	// and its instance connection). Default 30s.
	WriteTimeout time.Duration
	// TunnelIdleTimeout closes an upgraded connection (WebSocket) after this long without a
	// byte in either direction. Default 10m.
	TunnelIdleTimeout time.Duration
	// MaxStreams bounds the concurrent streams (requests, gRPC calls) of one HTTP/2 client
	// connection. Default 250.
	MaxStreams int
	// MaxConns and MaxConnsPerIP bound the client connections open at once, overall and from
	// one address; a connection beyond either is closed as soon as it is accepted
	// (tm_gateway_connections_refused_total). Defaults 10,000 and 1,000; negative: no bound.
	// Behind a load balancer that does not keep the client's address, raise MaxConnsPerIP.
	MaxConns, MaxConnsPerIP int
	// ShutdownTimeout bounds the wait for in-flight requests at shutdown. Default 30s.
	ShutdownTimeout time.Duration
	// ConnectTimeout bounds dialing an instance (the Queen coordinator's connect timeout). Default 1s.
	ConnectTimeout time.Duration
	// MaxIdleConnsPerHost is the idle connection pool per instance. Default 256.
	MaxIdleConnsPerHost int
	// Hold bounds the hold buffer.
	Hold HoldLimits
	// Assign bounds the unplaced-tenant rule (assign): anyone who may send a request could
	// otherwise fill every shard with placements (and the audit journal with entries) for
	// made-up tenants.
	Assign AssignLimits
	// Breaker sets the circuit breakers' numbers (default the Queen coordinator's: 3 failures, 5s, 5m).
	Breaker breaker.Config
	// Thresholds turn heartbeat age into instance status (schema defaults).
	Thresholds schema.Thresholds
	// Pprof serves net/http/pprof under /debug/pprof/ (admin requests only).
	Pprof bool

	// stdFrontEnd serves plaintext through net/http's server too (tests of that front end).
	stdFrontEnd bool
}

func (c Config) withDefaults() Config {
	if c.ID == "" {
		h, _ := os.Hostname()
		c.ID = h + "-" + strconv.Itoa(os.Getpid())
	}
	if c.Addr == "" {
		c.Addr = ":8080"
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Registry == nil {
		c.Registry = prometheus.NewRegistry()
		c.Registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	if c.Retries == 0 {
		c.Retries = 2
	} else if c.Retries < 0 {
		c.Retries = 0
	}
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&c.RefreshWait, 500*time.Millisecond)
	def(&c.ReadHeaderTimeout, 5*time.Second)
	def(&c.IdleTimeout, 2*time.Minute)
	def(&c.BodyReadTimeout, 10*time.Second)
	def(&c.WriteTimeout, 30*time.Second)
	def(&c.TunnelIdleTimeout, 10*time.Minute)
	if c.MinBodyRate == 0 {
		c.MinBodyRate = 1024
	}
	if c.MaxConns == 0 {
		c.MaxConns = 10000
	}
	if c.MaxStreams <= 0 {
		c.MaxStreams = 250
	}
	if c.MaxConnsPerIP == 0 {
		c.MaxConnsPerIP = 1000
	}
	def(&c.ShutdownTimeout, 30*time.Second)
	def(&c.ConnectTimeout, time.Second)
	if c.MaxReplayBody <= 0 {
		c.MaxReplayBody = 1 << 20
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = 32 << 20
	}
	if c.MaxHeaderBytes <= 0 {
		c.MaxHeaderBytes = 64 << 10
	}
	c.Assign = c.Assign.withDefaults()
	if c.FailedTokens == 0 {
		c.FailedTokens = 10
	}
	if c.FailedTokensBurst <= 0 {
		c.FailedTokensBurst = 100
	}
	if c.MaxIdleConnsPerHost <= 0 {
		c.MaxIdleConnsPerHost = 256
	}
	return c
}

// Gateway routes tenant traffic. Create with New, serve with Run. It keeps its config and the
// parts the stages use (pipeline.go); the stages themselves are methods in their own files.
type Gateway struct {
	cfg     Config
	log     *slog.Logger
	store   *schema.Store
	reg     *registry    // routes, directory and kinds as an immutable snapshot
	holds   *holdBuffer  // the hold stage's per-tenant queues
	tenants interned     // tenant ids as strings
	conns   *connLimiter // client connections, overall and per address
	assigns *assignLimiter
	// unseen bounds placedUnseen's reads: a client past its assignment budget must not turn
	// each request for a made-up tenant into a read from the stream leader.
	unseen *rate.Limiter
	// forwardAuthz: kinds that get the client's Authorization with edge identity on.
	forwardAuthz map[string]bool
	// tokenFails: refused tokens per client address (nil: no bound).
	tokenFails *tenantLimiter
	// proofs: kind -> *gatesig.Signer with the kind's key (ShardKey set).
	proofs  sync.Map
	engine  *engine   // the send stage's upstream connections
	pe      policyEnv // what the kinds' policies get from the gateway (policy.go)
	up      *upstream // the send stage's HTTP/2 connections, for gRPC calls (grpc.go)
	metrics *gwMetrics
	admin   *http.ServeMux
	// health checks the servers registered through the gateway (control plane, not requests).
	health *http.Client
	// reqCtx is the parent of the requests of the gateway's own front end.
	reqCtx    context.Context
	reqCancel context.CancelFunc

	// telemetryName is cfg.ID as a subject token, naming the gateway's circuit reports.
	telemetryName string

	// changed is closed and replaced on a placement change while someone waits (after a 421).
	changed atomic.Pointer[chan struct{}]
	waiters atomic.Int64

	assignMu  sync.Mutex
	assigning map[holdKey]*assignCall

	ready     chan struct{}
	readyOnce sync.Once
	synced    chan struct{} // registry: routes, directory and kinds are in
	syncOnce  sync.Once

	// Background work: watchers started as kinds appear run under bgCtx and bg.
	bgCtx  context.Context
	bgStop context.CancelFunc
	bg     sync.WaitGroup
	addr   atomic.Pointer[net.Addr]
	ran    atomic.Bool
}

// New makes a gateway. It starts nothing until Run.
func New(cfg Config) (*Gateway, error) {
	if cfg.Store == nil {
		return nil, errors.New("gateway: Config.Store is required")
	}
	cfg = cfg.withDefaults()
	g := &Gateway{
		cfg:       cfg,
		log:       cfg.Logger,
		store:     cfg.Store,
		assigning: map[holdKey]*assignCall{},
		ready:     make(chan struct{}),
		synced:    make(chan struct{}),

		telemetryName: tokenName(cfg.ID),
	}
	ch := make(chan struct{})
	g.changed.Store(&ch)
	g.bgCtx, g.bgStop = context.WithCancel(context.Background())
	g.reg = newRegistry(g)
	g.pe = policyEnv{snap: &g.reg.snap, retries: cfg.Retries, refreshWait: cfg.RefreshWait, refresh: g.refresh,
		owners: g.affCtl(), log: g.log}
	g.conns = newConnLimiter(cfg)
	g.assigns = newAssignLimiter(cfg.Assign)
	g.unseen = rate.NewLimiter(unseenPerSec, unseenPerSec)
	g.forwardAuthz = map[string]bool{}
	for _, k := range cfg.ForwardAuthorization {
		g.forwardAuthz[k] = true
	}
	if cfg.FailedTokens > 0 {
		g.tokenFails = newTenantLimiter(cfg.FailedTokens, cfg.FailedTokensBurst)
	}
	g.metrics = newMetrics(g, cfg.Registry)
	g.conns.refused = g.metrics.connsRefused
	g.holds = newHoldBuffer(cfg.Hold, g.metrics)
	g.engine = newEngine(cfg)
	g.up = newUpstream(cfg)
	g.health = &http.Client{Transport: &http.Transport{
		DialContext:         (&net.Dialer{Timeout: cfg.ConnectTimeout}).DialContext,
		TLSClientConfig:     &tls.Config{RootCAs: cfg.UpstreamCAs, MinVersion: tls.VersionTLS12},
		TLSHandshakeTimeout: cfg.ConnectTimeout + time.Second,
		MaxIdleConnsPerHost: 4,
		IdleConnTimeout:     90 * time.Second,
	}}
	g.reqCtx, g.reqCancel = context.WithCancel(context.Background())
	g.admin = g.adminMux()
	return g, nil
}

// Ready is closed once routes, directory, kinds and every kind's placement are in. It stays
// closed when NATS goes away later (static stability).
func (g *Gateway) Ready() <-chan struct{} { return g.ready }

// Addr is the address the gateway listens on, once Run has started listening.
func (g *Gateway) Addr() net.Addr {
	if a := g.addr.Load(); a != nil {
		return *a
	}
	return nil
}

// Staleness is how long the routing state has been cut off from NATS (0 while following).
func (g *Gateway) Staleness() time.Duration { return g.reg.staleness(time.Now()) }

// Run follows the state in NATS and serves until ctx ends, then stops taking connections,
// finishes in-flight requests (bounded by ShutdownTimeout) and stops its watchers.
func (g *Gateway) Run(ctx context.Context) error {
	if !g.ran.CompareAndSwap(false, true) {
		return errors.New("gateway: Run called twice")
	}
	defer g.bgStop()
	ln := g.cfg.Listener
	if ln == nil {
		var err error
		if ln, err = net.Listen("tcp", g.cfg.Addr); err != nil {
			return fmt.Errorf("gateway: listen on %s: %w", g.cfg.Addr, err)
		}
	}
	a := ln.Addr()
	g.addr.Store(&a)
	if err := g.start(); err != nil {
		ln.Close()
		g.bgStop()
		g.bg.Wait()
		return err
	}
	srv := &http.Server{
		Handler:           g,
		MaxHeaderBytes:    g.cfg.MaxHeaderBytes,
		ReadHeaderTimeout: g.cfg.ReadHeaderTimeout,
		IdleTimeout:       g.cfg.IdleTimeout,
		ErrorLog:          slog.NewLogLogger(g.log.Handler(), slog.LevelDebug),
		// HTTP/2 by ALPN on TLS listeners, and with prior knowledge (h2c) on connections the
		// own front end hands over when they open with the HTTP/2 preface.
		Protocols: serverProtocols(),
		HTTP2: &http.HTTP2Config{
			MaxConcurrentStreams: g.cfg.MaxStreams,
			// Stream and connection windows bound what one client may have buffered here.
			MaxReceiveBufferPerStream:     1 << 20,
			MaxReceiveBufferPerConnection: 4 << 20,
			SendPingTimeout:               time.Minute,
			PingTimeout:                   15 * time.Second,
			WriteByteTimeout:              g.cfg.WriteTimeout,
		},
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			if _, ok := c.(*replayConn); ok {
				return context.WithValue(ctx, handedOffKey{}, true)
			}
			return ctx
		},
	}
	serveErr := make(chan error, 2)
	var front *frontEnd
	if g.cfg.TLS != nil {
		go func() { serveErr <- srv.Serve(tls.NewListener(limitListener{ln, g.conns}, g.cfg.TLS)) }()
	} else if g.cfg.stdFrontEnd {
		go func() { serveErr <- srv.Serve(limitListener{ln, g.conns}) }()
	} else {
		// The gateway's own HTTP/1.1 front end; net/http's server takes the connections it
		// hands over.
		front = newFrontEnd(g, a)
		go func() { serveErr <- srv.Serve(front.handoff) }()
		go func() { serveErr <- front.serve(ln) }()
	}
	g.log.Info("gateway listening", "addr", a.String(), "id", g.cfg.ID)
	if g.cfg.Auth == nil {
		g.log.Warn("TENANT IDENTITY IS NOT CHECKED: x-tenant-id is believed as the client sends it; anyone who reaches this gateway may act as any tenant. Only run it so behind something that sets x-tenant-id itself; otherwise check a bearer JWT (--jwt-jwks-url or --jwt-key-file)",
			"addr", a.String())
	}
	var err error
	select {
	case <-ctx.Done():
	case err = <-serveErr:
		err = fmt.Errorf("gateway: serve: %w", err)
	}
	sctx, cancel := context.WithTimeout(context.Background(), g.cfg.ShutdownTimeout)
	defer cancel()
	var wg sync.WaitGroup
	if front != nil {
		ln.Close()
		wg.Go(func() {
			if serr := front.shutdown(sctx); serr != nil {
				g.log.Warn("shutdown did not finish in time; closed connections", "err", serr)
			}
		})
	}
	wg.Go(func() {
		if serr := srv.Shutdown(sctx); serr != nil {
			g.log.Warn("shutdown did not finish in time; closing connections", "err", serr)
			srv.Close()
		}
	})
	wg.Wait()
	g.reqCancel()
	g.bgStop()
	g.bg.Wait()
	g.engine.closeIdle(true)
	g.up.close()
	g.health.CloseIdleConnections()
	return err
}

// serverProtocols: HTTP/1.1, HTTP/2 by ALPN, and HTTP/2 with prior knowledge (h2c).
func serverProtocols() *http.Protocols {
	p := new(http.Protocols)
	p.SetHTTP1(true)
	p.SetHTTP2(true)
	p.SetUnencryptedHTTP2(true)
	return p
}

// start launches the followers, the load subscription and the housekeeping loop.
func (g *Gateway) start() error {
	for _, b := range []string{schema.BucketRoutes, schema.BucketInstances, schema.BucketKinds} {
		f, err := kvwatch.New(kvwatch.Config{JS: g.store.JS().JetStream(), Bucket: b, Logger: g.log.With("bucket", b)},
			bucketHandler{r: g.reg, bucket: b})
		if err != nil {
			return err
		}
		g.reg.mu.Lock()
		g.reg.followed[b] = f
		g.reg.mu.Unlock()
		g.bg.Go(func() { _ = f.Run(g.bgCtx) })
	}
	sub, err := g.store.SubscribeLoad("", g.onLoad)
	if err != nil {
		return err
	}
	g.bg.Go(func() {
		<-g.bgCtx.Done()
		_ = sub.Unsubscribe()
	})
	g.bg.Go(g.housekeeping)
	g.bg.Go(g.affCtl().affinityHealth)
	g.bg.Go(func() { g.reg.rebuilder(g.bgCtx) })
	g.bg.Go(g.awaitReady)
	return nil
}

// startKind makes and runs the placement watcher of a kind seen for the first time (called by
// the registry, under its lock).
func (g *Gateway) startKind(ke *kindEntry) {
	w, err := placement.New(placement.Config{
		Store: g.store,
		Kinds: []string{ke.name},
		OnChange: func(c placement.Change) {
			if c.NewOK {
				ke.aff.SetOwners(c.Tenant, c.New.Owners)
			} else {
				ke.aff.SetOwners(c.Tenant, nil)
			}
			g.onChange(c)
		},
		Logger:     g.log.With("kind", ke.name),
		Registerer: g.cfg.Registry,
	})
	if err != nil {
		g.log.Error("cannot follow placement", "kind", ke.name, "err", err)
		return
	}
	ke.w.Store(w)
	if g.bgCtx.Err() != nil {
		return
	}
	g.bg.Go(func() {
		if err := w.Run(g.bgCtx); err != nil {
			g.log.Error("placement watcher stopped", "kind", ke.name, "err", err)
		}
	})
	// Placements loaded from a compacted snapshot never reach OnChange: once ready, give the
	// affinity selector their owners (only those at or below the snapshot's revision; anything
	// newer came through OnChange).
	g.bg.Go(func() {
		select {
		case <-w.Ready():
		case <-g.bgCtx.Done():
			return
		}
		st, _ := w.Stats(ke.name)
		if st.SnapshotRevision == 0 {
			return
		}
		w.Range(ke.name, func(tenant string, e placement.Entry) bool {
			if len(e.Owners) > 0 && e.Revision <= st.SnapshotRevision {
				ke.aff.SetOwners(tenant, e.Owners)
			}
			return true
		})
	})
}

// awaitReady closes Ready once the registry is synced and every kind known then has its
// placement in.
func (g *Gateway) awaitReady() {
	select {
	case <-g.synced:
	case <-g.bgCtx.Done():
		return
	}
	for _, ke := range g.reg.snap.Load().kinds {
		w := ke.w.Load()
		if w == nil {
			continue
		}
		select {
		case <-w.Ready():
		case <-g.bgCtx.Done():
			return
		}
	}
	g.readyOnce.Do(func() { close(g.ready) })
	g.log.Info("gateway ready", "routes", len(g.reg.snap.Load().routes))
}

// housekeeping publishes the circuits and drops idle rate-limit buckets and expired load-policy
// affinities (the rebuilder ages liveness).
func (g *Gateway) housekeeping() {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	n := 0
	for {
		select {
		case <-tick.C:
			if n%circuitEvery == 0 {
				g.publishCircuits()
			}
			if n++; n%30 == 0 {
				now := time.Now()
				for _, ke := range g.reg.snap.Load().kinds {
					if l := ke.limiter.Load(); l != nil {
						l.sweep(now, time.Minute)
					}
					ke.lt.Sweep() // expired load-policy affinities
				}
				g.assigns.sweep(now)
				g.sweepAssigned(g.reg.snap.Load(), now)
				if g.tokenFails != nil {
					g.tokenFails.sweep(now, time.Minute)
				}
			}
		case <-g.bgCtx.Done():
			return
		}
	}
}

// onLoad keeps each instance's last load report for /admin/balance, and its waiting consumers
// for producer routes.
func (g *Gateway) onLoad(r schema.LoadReport) {
	g.reg.mu.Lock()
	in := g.reg.insts[r.Key()]
	g.reg.mu.Unlock()
	if in != nil {
		in.load.Store(&r)
		if len(r.Consumers) > 0 || in.consumers.Load() != nil {
			in.consumers.Store(newConsumerSet(r.Consumers))
		}
	}
	if ke := g.reg.snap.Load().kinds[r.Kind]; ke != nil {
		ke.lt.Observe(r.Key(), r.InFlight, r.Queued, r.CPU)
	}
}

// onChange runs on a kind's placement apply goroutine for every change: it abandons the
// requests under way at a shard whose tenants are being taken over, ends holds when a handoff
// or takeover commits or aborts, and wakes requests waiting for a newer placement after a 421.
func (g *Gateway) onChange(c placement.Change) {
	if c.NewOK && c.New.Phase == schema.PhaseTakeover && !(c.OldOK && c.Old.Phase == schema.PhaseTakeover && c.Old.Shard == c.New.Shard) {
		g.abandonTenant(c.Kind, c.New.Shard, c.Tenant)
	}
	if c.OldOK && c.Old.Phase.Moving() && !(c.NewOK && c.New.Phase.Moving()) {
		aborted := !c.NewOK || c.New.Shard == c.Old.Shard
		g.holds.release(c.Kind, c.Tenant, aborted)
	}
	if g.waiters.Load() > 0 {
		ch := make(chan struct{})
		close(*g.changed.Swap(&ch))
	}
}

// abandonTenant ends the tenant's exchanges under way with kind's shard's instances: a takeover
// of it began there, because the shard had no live instance (dead, frozen, cut off). A request
// that went to a frozen instance would otherwise wait for its answer until the upstream
// timeout; abandoned, it goes to the new owner if it is safe to send again (GET, a kind that
// only reads, or an Idempotency-Key for a kind that honours it), else it is answered at once as
// failed with an unknown outcome. Per tenant, because a failover takes a shard's tenants over
// one by one: a request sent to the shard for a tenant whose takeover is yet to come is
// abandoned at that tenant's.
func (g *Gateway) abandonTenant(kind, shard, tenant string) {
	var hosts []string
	g.reg.mu.Lock()
	for _, in := range g.reg.insts {
		if in.id.Kind == kind && in.id.Shard == shard {
			if u := in.url.Load(); u != nil {
				hosts = append(hosts, u.Host)
			}
		}
	}
	g.reg.mu.Unlock()
	n := 0
	for _, h := range hosts {
		n += g.engine.abandon(h, tenant) + g.up.abandon(h, tenant)
	}
	if n > 0 {
		g.log.Warn("abandoned the requests under way at a shard taking over their tenant; those safe to resend go to the new owner",
			"kind", kind, "shard", shard, "tenant", tenant, "requests", n)
	}
}
