// Package shardmain is a shard binary's whole main: the standard flags and their TM_* variables,
// logging, the NATS connection (credentials, nkey, user/password or token, TLS: see
// [natsconn.Options]), the schema store, a [shardkit.Shard] (gate, registration, heartbeats,
// moves, admin routes), the HTTP server with its timeouts, and a clean shutdown on SIGINT or
// SIGTERM: not ready, drain, unregister, stop serving.
//
// # Overview
//
// A service implements [App] (its hooks, its routes and its HTTP handler) and its main is:
//
//	func main() {
//		shardmain.Exit("notes", func(m *shardmain.Main) (shardmain.Builder, error) {
//			return func(ctx context.Context, env shardmain.Env) (shardmain.App, error) {
//				return notes.New(env.Logger), nil
//			}, nil
//		})
//	}
//
// Run it with --shard notes-1 --instance a --addr 127.0.0.1:9301 and --nats-creds (or the
// TM_SHARD, TM_INSTANCE, TM_ADDR and TM_NATS_CREDS variables); --help lists every flag. Tests
// build a [Main] themselves and call [Main.Run] with their own context; [Main.Listening] says
// where it serves.
//
// The HTTP handler is any http.Handler: shardmain serves the shard's own routes (/healthz,
// /readyz, /metrics, /admin/drain, /admin/reload, /admin/tenants) beside it, and the App puts its
// tenant routes behind [shardkit.Shard.Gate] and its own admin routes behind
// [shardkit.Shard.RequireAdmin].
package shardmain

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"google.golang.org/grpc"

	"github.com/tenantmesh/tenantmesh/internal/certfile"
	"github.com/tenantmesh/tenantmesh/internal/envflag"
	"github.com/tenantmesh/tenantmesh/internal/gatesig"
	"github.com/tenantmesh/tenantmesh/internal/tmlog"
	"github.com/tenantmesh/tenantmesh/internal/tracing"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/natsconn"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// App is a shard service built on shardkit.
type App interface {
	// Hooks connect the service's state to moves (all optional: a stateless service returns
	// the zero Hooks).
	Hooks() shardkit.Hooks
	// Routes the service serves (method and path prefix), published in the route registry: the
	// gateway sends a tenant's requests for them to the shard that owns the tenant.
	Routes() []schema.Route
	// Handler serves the service's routes, called once the shard is made: tenant routes behind
	// sk.Gate, the service's own /admin/... routes behind sk.RequireAdmin. Any router works.
	Handler(sk *shardkit.Shard) http.Handler
}

// GRPCApp is an App that also serves gRPC: shardmain makes a grpc.Server, lets the App
// register its services, publishes a route per service (POST /<package.Service>) and serves
// the calls on the same port as HTTP (HTTP/2 with prior knowledge, or TLS with ALPN h2) behind
// the shard's gate: the tenant is the x-tenant-id metadata, and the gate's refusals are gRPC
// statuses. A handler reads the call's tenant with tmgrpc.Tenant and maps its errors with
// tmgrpc.Status; a server stream ends when shardkit.Leaving closes.
type GRPCApp interface {
	RegisterGRPC(s grpc.ServiceRegistrar)
}

// MaxGRPCMessage bounds a gRPC message either way (grpc-go's default receive bound).
const MaxGRPCMessage = 4 << 20

// grpcRoutes are the routes of the services registered on gs: one per service.
func grpcRoutes(gs *grpc.Server) []schema.Route {
	var out []schema.Route
	for name := range gs.GetServiceInfo() {
		out = append(out, schema.Route{Method: "POST", Prefix: "/" + name})
	}
	slices.SortFunc(out, func(a, b schema.Route) int { return strings.Compare(a.Prefix, b.Prefix) })
	return out
}

// Runner is an App with background work: Run is called when serving starts, and its ctx ends
// after the shard has shut down cleanly.
type Runner interface {
	Run(ctx context.Context) error
}

// Env is what a service gets to build itself.
type Env struct {
	// Store is the schema store on the instance's NATS connection: placements, kinds, and
	// Store.JetStream() for the service's own streams and buckets.
	Store *schema.Store
	// ID is the instance's kind, shard and instance name.
	ID schema.InstanceID
	// Logger logs with the instance's name attached.
	Logger *slog.Logger
	// Registerer is the registry /metrics serves; register the service's collectors here.
	Registerer prometheus.Registerer
}

// Builder makes the App once NATS and the store are up.
type Builder func(ctx context.Context, env Env) (App, error)

// Main is one shard binary's configuration: what [Main.ParseFlags] reads from the flags and
// TM_* variables (--help describes each), or what a test sets.
type Main struct {
	// Kind is the service kind, e.g. "notes".
	Kind string

	// Addr is the listen address (default 127.0.0.1:0); URL where others reach this instance
	// (default http(s)://<listen address>).
	Addr, URL string
	// NATS says where NATS is and which credentials and TLS to use.
	NATS natsconn.Options
	// TLSCert and TLSKey, when set, serve HTTPS (renewed files are picked up).
	TLSCert, TLSKey string
	// Shard and Instance name this instance (default <kind>-1 and <host>-<pid>).
	Shard, Instance string
	// AdminToken guards /admin/*; Labels are k=v,k=v instance labels.
	AdminToken, Labels string
	// GatewayKeyFile holds the kind's gateway key (`rebalance auth gate-key`): the gate then
	// serves only requests a gateway proved (shardkit.Config.GatewayKey).
	GatewayKeyFile string
	// LogLevel (debug, info, warn, error) and LogFormat (auto, text, json).
	LogLevel, LogFormat string
	// Version is published in the instance directory.
	Version string
	// Capacity is how many tenants this instance hosts (0: the kind's default); Replicas the
	// replicas of buckets and streams this process creates.
	Capacity, Replicas int
	// Forward proxies other shards' tenants to their owner instead of answering 421.
	Forward bool
	// ForwardFallback serves a forwarded tenant here when its owner fails twice (not for
	// single-writer kinds; see shardkit.Config.ForwardFallback).
	ForwardFallback bool
	// DrainTimeout bounds a drain's wait for in-flight requests; Heartbeat is the directory
	// heartbeat and telemetry interval.
	DrainTimeout, Heartbeat, DirectoryRefresh time.Duration
	// ShutdownGrace is how long a stopping instance keeps serving after it reports not ready.
	ShutdownGrace time.Duration
	// ReadHeaderTimeout bounds reading a request's headers. The server also bounds headers to
	// 64 KiB and idle connections to 2 minutes.
	ReadHeaderTimeout time.Duration
	// Stderr receives the logs (default os.Stderr).
	Stderr io.Writer
	// Extra, if set, defines a binary's own flags on the flag set ParseFlags reads.
	Extra func(fs *flag.FlagSet)
	ready chan string
}

// ParseFlags reads flags (defaults from TM_* variables) for a service of kind. With kind ""
// (a binary that serves any kind, like the sidecar) the kind is the --kind flag. Extra, if
// set, defines the binary's own flags on the same set.
func (m *Main) ParseFlags(kind string, args []string) error {
	m.Kind = kind
	name, shardDefault := kind, kind+"-1"
	if kind == "" {
		name, shardDefault = "shard", ""
	}
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.Usage = func() {
		k := kind
		if k == "" {
			k = "--kind"
		}
		fmt.Fprintf(fs.Output(), "Usage: %s [flags]\n\nRuns one instance of a shard of kind %s: it registers in the instance directory,\n"+
			"publishes its routes, serves the tenants placed on its shard and takes part in moves.\n\n"+
			"Example:\n  %s --shard %s-1 --instance a --addr 127.0.0.1:9101\n\nFlags (each also read from its TM_* variable):\n", name, k, name, strings.TrimPrefix(k, "--"))
		fs.PrintDefaults()
	}
	if kind == "" {
		envflag.String(fs, &m.Kind, "kind", "", "the service kind this instance serves (required)")
	}
	if m.Extra != nil {
		m.Extra(fs)
	}
	host, _ := os.Hostname()
	envflag.String(fs, &m.Addr, "addr", "127.0.0.1:0", "listen address")
	envflag.String(fs, &m.URL, "url", "", "URL other processes reach this instance at (default: http://<listen address>)")
	m.NATS.AddFlags(fs)
	envflag.String(fs, &m.TLSCert, "tls-cert", "", "serve HTTPS with this certificate (PEM; renewed files are picked up); the gateway then needs --upstream-ca")
	envflag.String(fs, &m.TLSKey, "tls-key", "", "key (PEM) of --tls-cert")
	envflag.String(fs, &m.Shard, "shard", shardDefault, "shard this instance belongs to (default <kind>-1)")
	envflag.String(fs, &m.Instance, "instance", sanitize(host)+"-"+strconv.Itoa(os.Getpid()), "instance name, unique within the shard")
	envflag.Secret(fs, &m.AdminToken, "admin-token", "bearer token for /admin/* (unset: admin routes are refused)")
	envflag.String(fs, &m.GatewayKeyFile, "gateway-key-file", "", "file with the kind's gateway key (rebalance auth gate-key): serve only requests a gateway proved (unset: anyone who reaches this port may name any tenant)")
	envflag.String(fs, &m.Labels, "labels", "", "instance labels, k=v,k=v (e.g. region=eu)")
	envflag.String(fs, &m.LogLevel, "log-level", "info", "debug, info, warn or error")
	envflag.String(fs, &m.LogFormat, "log-format", "auto", "auto (text on a terminal, JSON otherwise), text or json")
	envflag.String(fs, &m.Version, "version", "dev", "version published in the directory")
	envflag.Int(fs, &m.Capacity, "capacity", 0, "tenants this instance can host (0: the kind's default)")
	envflag.Int(fs, &m.Replicas, "replicas", 1, "replicas for buckets and streams this process creates (3 in a cluster)")
	envflag.Bool(fs, &m.Forward, "forward", false, "proxy requests for other shards' tenants to their owner instead of answering 421")
	envflag.Bool(fs, &m.ForwardFallback, "forward-fallback", false, "with --forward, serve a tenant here when its owner fails twice (answers carry X-Fallback: true; refused for single-writer kinds)")
	envflag.Duration(fs, &m.DrainTimeout, "drain-timeout", 10*time.Second, "how long a drain waits for in-flight requests")
	envflag.Duration(fs, &m.Heartbeat, "heartbeat", time.Second, "load report interval (core NATS; the heartbeat gateways and the rebalancer hear)")
	envflag.Duration(fs, &m.DirectoryRefresh, "directory-refresh", 15*time.Second, "how often the directory entry is rewritten when nothing in it changed")
	envflag.Duration(fs, &m.ShutdownGrace, "shutdown-grace", 2*time.Second, "how long a stopping instance keeps serving after it reports not ready")
	envflag.Duration(fs, &m.ReadHeaderTimeout, "read-header-timeout", 5*time.Second, "bound on reading a request's headers")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if err := envflag.Check(fs); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q; see --help", fs.Args())
	}
	if m.Kind == "" {
		return errors.New("--kind (TM_KIND) is required: the service kind this instance serves")
	}
	if m.Shard == "" {
		m.Shard = m.Kind + "-1"
	}
	return nil
}

func sanitize(s string) string {
	var b strings.Builder
	for _, c := range s {
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' {
			b.WriteRune(c)
		}
	}
	if b.Len() == 0 {
		return "host"
	}
	return b.String()
}

func parseLabels(s string) (map[string]string, error) {
	if s == "" {
		return nil, nil
	}
	out := map[string]string{}
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("label %q: want k=v", kv)
		}
		out[strings.TrimSpace(k)] = strings.TrimSpace(v)
	}
	return out, nil
}

// Listening returns a channel that receives the instance's URL once it serves.
func (m *Main) Listening() <-chan string {
	if m.ready == nil {
		m.ready = make(chan string, 1)
	}
	return m.ready
}

// Run serves until ctx ends, then shuts down cleanly: not ready, drain, unregister.
func (m *Main) Run(ctx context.Context, build Builder) error {
	stderr := m.Stderr
	if stderr == nil {
		stderr = os.Stderr
	}
	log, err := tmlog.New(stderr, m.LogLevel, m.LogFormat)
	if err != nil {
		return err
	}
	id := schema.InstanceID{Kind: m.Kind, Shard: m.Shard, Instance: m.Instance}
	if err := id.Check(); err != nil {
		return err
	}
	labels, err := parseLabels(m.Labels)
	if err != nil {
		return err
	}
	log = log.With("instance", id.Key())
	nc, err := natsconn.Connect(m.NATS, id.Key(), log)
	if err != nil {
		return err
	}
	defer nc.Close()
	octx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	st, err := schema.OpenRetry(octx, nc, schema.Options{Replicas: m.Replicas, Logger: log, Attach: true})
	cancel()
	if err != nil {
		return fmt.Errorf("open NATS state at %s: %w", m.NATS.Redacted(), err)
	}
	// The move protocol's messages (placement changes, signals and notes, the commit, the
	// lease's confirmations, heartbeats) get a connection of their own, so they never queue
	// behind the service's data (a projection's event deliveries, an aggregate's appends) in
	// one socket and one server-side write loop.
	ctlNC, err := natsconn.Connect(m.NATS, id.Key()+"/control", log)
	if err != nil {
		return err
	}
	defer ctlNC.Close()
	octx, cancel = context.WithTimeout(ctx, 2*time.Minute)
	ctl, err := schema.OpenRetry(octx, ctlNC, schema.Options{Replicas: m.Replicas, Logger: log, Attach: true})
	cancel()
	if err != nil {
		return fmt.Errorf("open NATS state at %s (control connection): %w", m.NATS.Redacted(), err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	app, err := build(ctx, Env{Store: st, ID: id, Logger: log, Registerer: reg})
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", m.Addr)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", m.Addr, err)
	}
	url := m.URL
	if url == "" {
		url = "http://" + ln.Addr().String()
	}
	if (m.TLSCert == "") != (m.TLSKey == "") {
		ln.Close()
		return errors.New("--tls-cert and --tls-key go together")
	}
	if m.TLSCert != "" {
		rl, err := certfile.New(m.TLSCert, m.TLSKey, log)
		if err != nil {
			ln.Close()
			return fmt.Errorf("--tls-cert/--tls-key: %w", err)
		}
		ln = tls.NewListener(ln, rl.ServerConfig())
		if m.URL == "" {
			url = "https://" + ln.Addr().String()
		}
	}
	var gateKey []byte
	if m.GatewayKeyFile != "" {
		if gateKey, err = gatesig.ReadKeyFile(m.GatewayKeyFile); err != nil {
			ln.Close()
			return fmt.Errorf("--gateway-key-file: %w", err)
		}
	} else {
		log.Warn("REQUESTS ARE NOT CHECKED FOR A GATEWAY'S PROOF: anyone who reaches this instance's port may name any tenant in x-tenant-id, past the gateway's identity check; set --gateway-key-file, or keep everything but the gateways away from the port")
	}
	routes := app.Routes()
	var gs *grpc.Server
	if ga, ok := app.(GRPCApp); ok {
		gs = grpc.NewServer(grpc.MaxRecvMsgSize(MaxGRPCMessage), grpc.MaxSendMsgSize(MaxGRPCMessage))
		ga.RegisterGRPC(gs)
		routes = append(slices.Clip(routes), grpcRoutes(gs)...)
	}
	sk, err := shardkit.New(shardkit.Config{
		GatewayKey: gateKey,
		Store:      ctl, ID: id, URL: url, Capacity: m.Capacity, Labels: labels, Version: m.Version,
		Routes: routes, Hooks: app.Hooks(), Forward: m.Forward, ForwardFallback: m.ForwardFallback, AdminToken: m.AdminToken,
		DrainTimeout: m.DrainTimeout, Heartbeat: m.Heartbeat, DirectoryRefresh: m.DirectoryRefresh, ShutdownGrace: m.ShutdownGrace,
		Registerer: reg, Gatherer: reg, Logger: log,
	})
	if err != nil {
		ln.Close()
		return err
	}
	mux := http.NewServeMux()
	sk.MountMux(mux)
	mux.Handle("/", app.Handler(sk))
	var handler http.Handler = mux
	if gs != nil {
		handler = grpcOrHTTP(sk.Gate(gs), mux)
	}
	srv := &http.Server{Handler: tracing.Handler(id.Kind, handler), ReadHeaderTimeout: m.ReadHeaderTimeout, MaxHeaderBytes: 64 << 10,
		IdleTimeout: 2 * time.Minute, ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn),
		Protocols: serverProtocols(), HTTP2: &http.HTTP2Config{MaxConcurrentStreams: 1000, SendPingTimeout: 30 * time.Second, PingTimeout: 10 * time.Second}}
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("http server failed", "err", err)
		}
	})
	appCtx, stopApp := context.WithCancel(context.WithoutCancel(ctx))
	if rn, ok := app.(Runner); ok {
		wg.Go(func() {
			if err := rn.Run(appCtx); err != nil {
				log.Error("service stopped", "err", err)
			}
		})
	}
	go func() {
		select {
		case <-sk.Running():
			if m.ready != nil {
				m.ready <- url
			}
		case <-sk.Stopped():
		}
	}()
	runErr := sk.Run(ctx) // returns after the clean shutdown (not ready, drain, unregister)
	if gs != nil {
		defer gs.Stop() // the calls' transports (srv.Shutdown ends their HTTP/2 streams)
	}
	sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	if err := srv.Shutdown(sctx); err != nil {
		log.Warn("http shutdown", "err", err)
	}
	scancel()
	stopApp()
	wg.Wait()
	dctx, dcancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer dcancel()
	_ = nc.FlushWithContext(dctx)
	log.Info("stopped")
	return runErr
}

// serverProtocols: HTTP/1.1, HTTP/2 by ALPN on TLS, and HTTP/2 with prior knowledge (h2c)
// on plaintext, which is how the gateway reaches a shard's gRPC services.
func serverProtocols() *http.Protocols {
	p := new(http.Protocols)
	p.SetHTTP1(true)
	p.SetHTTP2(true)
	p.SetUnencryptedHTTP2(true)
	return p
}

// grpcOrHTTP sends gRPC calls to grpcH and everything else to httpH.
func grpcOrHTTP(grpcH, httpH http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if tmhttp.IsGRPC(r) {
			grpcH.ServeHTTP(w, r)
			return
		}
		httpH.ServeHTTP(w, r)
	})
}

// Exit is a shard binary's whole main: it parses the flags (exit 2 on a usage error, 0 for
// --help), calls setup (a configuration error there also exits 2), runs the App it builds until
// SIGINT or SIGTERM and a clean shutdown, and exits 1 if that fails.
func Exit(kind string, setup func(m *Main) (Builder, error)) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	fail := func(code int, err error) {
		fmt.Fprintf(os.Stderr, "%s: %v\n", kind, err)
		stop()
		os.Exit(code)
	}
	var m Main
	if err := m.ParseFlags(kind, os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fail(2, err)
	}
	build, err := setup(&m)
	if err != nil {
		fail(2, err)
	}
	flush, err := tracing.Main(ctx, "tenantmesh-"+kind)
	if err != nil {
		fail(2, err)
	}
	defer flush()
	if err := m.Run(ctx, build); err != nil {
		flush()
		fail(1, err)
	}
}
