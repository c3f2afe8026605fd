// Command shardgroup runs a group of shard instances in one process, for the scale harness
// (test/scale): each instance is shardkit's own code (registration, heartbeats, memberships,
// telemetry, routes, the gate and the move protocol) on its own NATS connection, with its
// shard's least-privilege credentials (--creds-dir/shard-<kind>-<shard>.creds, as natsauth's
// WriteCreds names them), and its own HTTP listener on 127.0.0.1 whose handler answers "ok"
// to the requests its gate lets in. The group's instances of one kind share one placement
// watcher (credentials shard-<kind>-watcher.creds). It prints "ready" on stdout once every
// instance runs, and stops them all on SIGTERM or SIGINT.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/internal/tmlog"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/natsconn"
	"github.com/tenantmesh/tenantmesh/shardkit/natsperm"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Connection names say the role, "<role>:<name>": the harness sums the NATS servers'
// per-connection counters by role.
const (
	roleShard   = "shard"
	roleWatcher = "placement-watcher"
)

// config is the group's flags.
type config struct {
	name       string
	natsURL    string
	credsDir   string
	instances  []schema.InstanceID
	heartbeat  time.Duration
	replicas   int
	parallel   int
	adminToken string
	logLevel   string
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	cfg, err := parseFlags(os.Args[1:])
	if err == nil {
		err = run(ctx, cfg)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "shardgroup:", err)
		os.Exit(1)
	}
}

func parseFlags(args []string) (config, error) {
	var c config
	var instances string
	fs := flag.NewFlagSet("shardgroup", flag.ContinueOnError)
	fs.StringVar(&c.name, "name", "shards", "the group's name, in its watchers' connection names")
	fs.StringVar(&c.natsURL, "nats-url", natsconn.DefaultURL, "NATS server URLs, comma-separated")
	fs.StringVar(&c.credsDir, "creds-dir", "", "directory of the shards' credentials (natsauth WriteCreds files)")
	fs.StringVar(&instances, "instances", "", "the instances to run: keys kind.shard.instance, comma-separated")
	fs.DurationVar(&c.heartbeat, "heartbeat", time.Second, "the instances' heartbeat")
	fs.IntVar(&c.replicas, "replicas", 1, "replicas of the buckets (3 in a cluster)")
	fs.IntVar(&c.parallel, "parallel", 8, "instances started at once")
	fs.StringVar(&c.adminToken, "admin-token", "", "bearer token for the instances' /admin/*")
	fs.StringVar(&c.logLevel, "log-level", "warn", "debug, info, warn or error")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if c.credsDir == "" {
		return c, errors.New("--creds-dir is required: the directory the harness wrote the shards' credentials to")
	}
	for _, key := range strings.Split(instances, ",") {
		if key = strings.TrimSpace(key); key == "" {
			continue
		}
		parts := strings.SplitN(key, ".", 3)
		if len(parts) != 3 {
			return c, fmt.Errorf("--instances: %q is not kind.shard.instance", key)
		}
		id := schema.InstanceID{Kind: parts[0], Shard: parts[1], Instance: parts[2]}
		if err := id.Check(); err != nil {
			return c, fmt.Errorf("--instances: %w", err)
		}
		c.instances = append(c.instances, id)
	}
	if len(c.instances) == 0 {
		return c, errors.New("--instances names no instance: give kind.shard.instance keys, comma-separated")
	}
	return c, nil
}

// group is the running group: its watchers and instances, each stopped by its stop func.
type group struct {
	cfg      config
	log      *slog.Logger
	watchers map[string]*placement.Watcher

	mu        sync.Mutex
	instances []func() // each stops one instance and closes its connection
	stops     []func() // the watchers' and their connections', in the order made
}

func run(ctx context.Context, cfg config) error {
	log, err := tmlog.New(os.Stderr, cfg.logLevel, "text")
	if err != nil {
		return err
	}
	g := &group{cfg: cfg, log: log.With("group", cfg.name), watchers: map[string]*placement.Watcher{}}
	defer g.stop()
	if err := g.startWatchers(ctx); err != nil {
		return err
	}
	if err := g.startInstances(ctx); err != nil {
		return err
	}
	fmt.Println("ready")
	<-ctx.Done()
	return nil
}

// onStop adds fn to what stop runs after the instances (in reverse order).
func (g *group) onStop(fn func()) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.stops = append(g.stops, fn)
}

// stop stops the instances (in parallel), then the watchers and their connections.
func (g *group) stop() {
	g.mu.Lock()
	instances, stops := g.instances, g.stops
	g.instances, g.stops = nil, nil
	g.mu.Unlock()
	var wg sync.WaitGroup
	for _, fn := range instances {
		wg.Go(fn)
	}
	wg.Wait()
	for i := len(stops) - 1; i >= 0; i-- {
		stops[i]()
	}
}

// connect opens a NATS connection named name with the credentials of role, and the store on
// it; the caller closes the connection.
func (g *group) connect(role natsperm.Role, name string) (*schema.Store, *nats.Conn, error) {
	nc, err := natsconn.Connect(natsconn.Options{URL: g.cfg.natsURL, Creds: filepath.Join(g.cfg.credsDir, role.Name+".creds")}, name, g.log)
	if err != nil {
		return nil, nil, fmt.Errorf("connect as %s: %w", name, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute) // a busy cluster (a thousand instances starting): tried again until then
	defer cancel()
	st, err := schema.OpenRetry(ctx, nc, schema.Options{Replicas: g.cfg.replicas, Attach: true})
	if err != nil {
		nc.Close()
		return nil, nil, fmt.Errorf("open the store as %s: %w", name, err)
	}
	return st, nc, nil
}

// startWatchers starts one placement watcher per kind of the group's instances and waits
// until each is ready (from its kind's snapshot).
func (g *group) startWatchers(ctx context.Context) error {
	for _, id := range g.cfg.instances {
		k := id.Kind
		if g.watchers[k] != nil {
			continue
		}
		st, nc, err := g.connect(natsperm.Shard(k, "watcher", natsperm.Assets{}), roleWatcher+":"+g.cfg.name+":"+k)
		if err != nil {
			return err
		}
		g.onStop(nc.Close)
		w, err := placement.New(placement.Config{Store: st, Kinds: []string{k}, Confirm: time.Second, Logger: g.log.With("watcher", k)})
		if err != nil {
			return err
		}
		g.watchers[k] = w
		g.goRun("placement watcher "+k, w.Run)
		wctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
		err = w.WaitReady(wctx)
		cancel()
		if err != nil {
			return fmt.Errorf("placement watcher %s not ready: %w", k, err)
		}
	}
	return nil
}

// goRun runs fn until the group stops; an error before that is logged.
func (g *group) goRun(what string, fn func(context.Context) error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := fn(ctx); err != nil && ctx.Err() == nil {
			g.log.Error(what+" stopped", "err", err)
		}
	}()
	g.onStop(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(time.Minute):
			g.log.Error(what + " did not stop within a minute")
		}
	})
}

// startInstances starts every instance, cfg.parallel at a time, and returns once all run.
func (g *group) startInstances(ctx context.Context) error {
	sem := make(chan struct{}, max(g.cfg.parallel, 1))
	var wg sync.WaitGroup
	errs := make(chan error, len(g.cfg.instances))
	for _, id := range g.cfg.instances {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			wg.Wait()
			return ctx.Err()
		}
		wg.Go(func() {
			defer func() { <-sem }()
			if err := g.startInstance(ctx, id); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	var all []error
	for err := range errs {
		all = append(all, err)
	}
	return errors.Join(all...)
}

// routeOf is the path prefix each kind serves.
func routeOf(kind string) string { return "/" + kind + "/" }

// startInstance runs one instance and waits until it runs.
func (g *group) startInstance(ctx context.Context, id schema.InstanceID) error {
	st, nc, err := g.connect(natsperm.Shard(id.Kind, id.Shard, natsperm.Assets{}), roleShard+":"+id.Key())
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		nc.Close()
		return err
	}
	sk, err := shardkit.New(shardkit.Config{Store: st, ID: id, URL: "http://" + ln.Addr().String(), Watcher: g.watchers[id.Kind],
		Heartbeat: g.cfg.heartbeat, AdminToken: g.cfg.adminToken, DrainTimeout: 5 * time.Second, Logger: g.log.With("instance", id.Key()),
		Routes: []schema.Route{{Method: "*", Prefix: routeOf(id.Kind)}}})
	if err != nil {
		ln.Close()
		nc.Close()
		return err
	}
	r := chi.NewRouter()
	sk.Mount(r)
	r.With(sk.Gate).Handle(routeOf(id.Kind)+"*", http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok"))
	}))
	srv := &http.Server{Handler: r, ReadHeaderTimeout: 5 * time.Second}
	served := make(chan struct{})
	go func() { defer close(served); _ = srv.Serve(ln) }()
	runCtx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	var runErr error
	go func() { defer close(done); runErr = sk.Run(runCtx) }()
	g.mu.Lock()
	g.instances = append(g.instances, func() {
		cancel()
		select {
		case <-done:
		case <-time.After(time.Minute):
			g.log.Error("instance did not stop within a minute", "instance", id.Key())
		}
		sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = srv.Shutdown(sctx)
		scancel()
		<-served
		nc.Close()
	})
	g.mu.Unlock()
	select {
	case <-sk.Running():
		return nil
	case <-done:
		return fmt.Errorf("instance %s stopped at start: %w", id.Key(), runErr)
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(2 * time.Minute):
		return fmt.Errorf("instance %s not running within 2 minutes", id.Key())
	}
}
