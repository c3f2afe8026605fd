package scale

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/gateway"
	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/natsauth"
	"github.com/tenantmesh/tenantmesh/rebalancer/server"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/natsperm"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Connection names say the role: "<role>:<name>". The NATS servers' per-connection counters
// are summed by role.
const (
	roleShard      = "shard"
	roleGateway    = "gateway"
	roleRebalancer = "rebalancer"
	roleWatcher    = "placement-watcher" // the harness's one placement watcher per kind, shared by its instances
	roleHarness    = "harness"
)

const adminToken = "scale-admin-token"

// harness owns everything a run starts; t.Cleanup stops it in reverse order.
type harness struct {
	t       *testing.T
	p       params
	ctx     context.Context
	cluster *natstest.Cluster
	admin   *schema.Store

	watchers map[string]*placement.Watcher // kind -> the watcher the kind's instances share
	rebURL   string
	reb      *server.Server
	gateways []string // base URLs

	mu    sync.Mutex
	fleet map[string]*instance // instance key -> running instance
}

// instance is one shard instance: shardkit's own code on its own NATS connection and listener.
type instance struct {
	sk   *shardkit.Shard
	stop func()
}

func newHarness(t *testing.T, p params, ctx context.Context) *harness {
	return &harness{t: t, p: p, ctx: ctx, watchers: map[string]*placement.Watcher{}, fleet: map[string]*instance{}}
}

// connect opens a NATS connection as role, named for the role statistics.
func (h *harness) connect(role natsauth.Role, name string) *nats.Conn {
	return natstest.ConnectAs(h.t, h.cluster.URLs(), role, nats.Name(name))
}

func (h *harness) open(nc *nats.Conn, attach bool) *schema.Store {
	st, err := h.openErr(nc, attach)
	if err != nil {
		h.t.Fatal(err)
	}
	return st
}

// openErr opens a store on nc; a busy cluster (a thousand instances starting) may take a while.
func (h *harness) openErr(nc *nats.Conn, attach bool) (*schema.Store, error) {
	ctx, cancel := context.WithTimeout(h.ctx, 3*time.Minute)
	defer cancel()
	st, err := schema.Open(ctx, nc, schema.Options{Replicas: h.p.Replicas, Attach: attach})
	if err != nil {
		return nil, fmt.Errorf("open store as %s: %w", nc.Opts.Name, err)
	}
	return st, nil
}

// start brings up the cluster and provisions tenantmesh's buckets.
func (h *harness) start() {
	withRole("nats", func() { h.cluster = natstest.NewCluster(h.t) })
	h.admin = h.open(h.connect(natsperm.Rebalancer(), roleHarness+":admin"), false)
	ctx, cancel := context.WithTimeout(h.ctx, time.Minute)
	defer cancel()
	if err := h.admin.Provision(ctx); err != nil {
		h.t.Fatal(err)
	}
	for _, k := range kinds {
		if _, err := h.admin.Placements(k).KV(ctx); err != nil {
			h.t.Fatal(err)
		}
	}
}

// load places p.Tenants tenants in each kind, tenant i on shard i mod maxShards, with async
// publishes (a window of 2,000 outstanding, nats.go's stall limit being 4,000).
func (h *harness) load() time.Duration {
	t0 := time.Now()
	js := h.admin.JS().JetStream()
	shards := h.p.maxShards()
	for _, k := range kinds {
		prefix := schema.PlacementSubjectPrefix(k)
		for i := range h.p.Tenants {
			val := fmt.Sprintf(`{"kind":%q,"tenant":%q,"shard":%q,"epoch":1,"phase":"active","updated_at":"2026-11-25T10:00:00Z"}`,
				k, tenantName(i), shardName(k, i%shards))
			if _, err := js.PublishAsync(prefix+tenantName(i), []byte(val)); err != nil {
				h.t.Fatal(err)
			}
			if i%2000 == 1999 {
				h.awaitPublishes(js)
			}
		}
		h.awaitPublishes(js)
	}
	return time.Since(t0)
}

func (h *harness) awaitPublishes(js interface{ PublishAsyncComplete() <-chan struct{} }) {
	select {
	case <-js.PublishAsyncComplete():
	case <-time.After(time.Minute):
		h.t.Fatal("placement publishes not acknowledged within a minute")
	}
}

// startWatchers starts one placement watcher per kind for the kind's instances to share (from
// the snapshots).
func (h *harness) startWatchers() {
	withRole(roleWatcher, func() {
		for _, k := range kinds {
			st := h.open(h.connect(natsperm.Shard(k, "watcher", natsperm.Assets{}), roleWatcher+":"+k), true)
			w, err := placement.New(placement.Config{Store: st, Kinds: []string{k}, Confirm: time.Second})
			if err != nil {
				h.t.Fatal(err)
			}
			h.watchers[k] = w
			h.goRun("watcher "+k, w.Run)
		}
	})
	for _, k := range kinds {
		ctx, cancel := context.WithTimeout(h.ctx, 5*time.Minute)
		if err := h.watchers[k].WaitReady(ctx); err != nil {
			cancel()
			h.t.Fatal(err)
		}
		cancel()
	}
}

// writeSnapshots writes each kind's compacted snapshot, as the rebalancer leader does every
// CompactEvery changes, from a full read, for the cold starts that follow.
func (h *harness) writeSnapshots() {
	w, err := placement.New(placement.Config{Store: h.admin, Kinds: kinds, NoSnapshot: true})
	if err != nil {
		h.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(h.ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(ctx) }()
	defer func() { cancel(); <-done }()
	wctx, wcancel := context.WithTimeout(h.ctx, 5*time.Minute)
	defer wcancel()
	if err := w.WaitReady(wctx); err != nil {
		h.t.Fatal(err)
	}
	for _, k := range kinds {
		if err := w.WriteSnapshot(wctx, k); err != nil {
			h.t.Fatalf("snapshot of %s: %v", k, err)
		}
	}
}

// goRun runs fn until the test ends.
func (h *harness) goRun(what string, fn func(context.Context) error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := fn(ctx); err != nil && ctx.Err() == nil {
			h.t.Errorf("%s: %v", what, err)
		}
	}()
	h.t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(time.Minute):
			h.t.Errorf("%s did not stop within a minute", what)
		}
	})
}

func listen(t *testing.T) net.Listener {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return ln
}

// startRebalancer runs `rebalancer serve` in process: leader lease, sweeper, compaction, API.
func (h *harness) startRebalancer() {
	var st *schema.Store
	withRole(roleRebalancer, func() { st = h.open(h.connect(natsperm.Rebalancer(), roleRebalancer+":r1"), false) })
	s, err := server.New(server.Config{Store: st, Holder: "r1", AdminToken: adminToken, PauseBudget: h.p.PauseBudget,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	if err != nil {
		h.t.Fatal(err)
	}
	ln := listen(h.t)
	h.reb, h.rebURL = s, "http://"+ln.Addr().String()
	withRole(roleRebalancer, func() {
		h.goRun("rebalancer", func(ctx context.Context) error { return s.Serve(ctx, ln) })
	})
	deadline := time.Now().Add(time.Minute)
	for !s.IsLeader() {
		if time.Now().After(deadline) {
			h.t.Fatal("the rebalancer did not take the lease within a minute")
		}
		time.Sleep(50 * time.Millisecond) // polling the lease; the server offers no event for it
	}
}

// coldStart is one gateway's start: time to ready and the heap it keeps.
type coldStart struct {
	Ready     time.Duration
	HeapBytes int64
}

// startGateway runs a gateway in process and measures its cold start; the heap it adds is
// measured with the rest of the process quiet (before the fleet starts).
func (h *harness) startGateway(i int) coldStart {
	before := heapInUse()
	t0 := time.Now()
	var g *gateway.Gateway
	ln := listen(h.t)
	withRole(roleGateway, func() {
		st := h.open(h.connect(natsperm.DefaultGateway(), fmt.Sprintf("%s:gw%d", roleGateway, i)), true)
		var err error
		g, err = gateway.New(gateway.Config{Store: st, Listener: ln, ID: fmt.Sprintf("gw%d", i), ShutdownTimeout: 5 * time.Second,
			AdminToken: adminToken})
		if err != nil {
			h.t.Fatal(err)
		}
		h.goRun(fmt.Sprintf("gateway %d", i), g.Run)
	})
	select {
	case <-g.Ready():
	case <-time.After(5 * time.Minute):
		h.t.Fatalf("gateway %d not ready within 5 minutes", i)
	}
	cs := coldStart{Ready: time.Since(t0)}
	cs.HeapBytes = heapInUse() - before
	h.gateways = append(h.gateways, "http://"+ln.Addr().String())
	return cs
}

func heapInUse() int64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}

// growFleet starts instances until the fleet has n: shards 0..shardsPerKind(n)-1 of every
// kind, PerShard instances each, a few at a time.
func (h *harness) growFleet(n int) int {
	shards := h.p.shardsPerKind(n)
	type want struct {
		kind  string
		shard int
		inst  int
	}
	var todo []want
	for s := range shards {
		for _, k := range kinds {
			for i := range h.p.PerShard {
				if h.fleet[schema.InstanceID{Kind: k, Shard: shardName(k, s), Instance: fmt.Sprintf("i%d", i)}.Key()] == nil {
					todo = append(todo, want{k, s, i})
				}
			}
		}
	}
	sem := make(chan struct{}, 8)
	var wg sync.WaitGroup
	errs := make(chan error, len(todo))
	started := time.Now()
	for i, w := range todo {
		if i > 0 && i%100 == 0 {
			h.t.Logf("starting instances: %d of %d after %s", i, len(todo), time.Since(started).Round(time.Millisecond))
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			var err error
			withRole(roleShard, func() { err = h.startInstance(w.kind, shardName(w.kind, w.shard), fmt.Sprintf("i%d", w.inst)) })
			if err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	if len(todo) > 0 {
		h.t.Logf("started %d instances", len(todo))
	}
	for err := range errs {
		h.t.Fatal(err)
	}
	return len(h.fleet)
}

// routeOf is the path prefix each kind serves.
func routeOf(kind string) string { return "/" + kind + "/" }

// startInstance runs one shard instance: shardkit registers, heartbeats, publishes telemetry
// and answers the move protocol; its handler answers 200 for the tenants its gate lets in.
func (h *harness) startInstance(kind, shard, name string) error {
	id := schema.InstanceID{Kind: kind, Shard: shard, Instance: name}
	nc := h.connect(natsperm.Shard(kind, shard, natsperm.Assets{}), roleShard+":"+id.Key())
	st, err := h.openErr(nc, true)
	if err != nil {
		return err
	}
	ln := listen(h.t)
	sk, err := shardkit.New(shardkit.Config{Store: st, ID: id, URL: "http://" + ln.Addr().String(), Watcher: h.watchers[kind],
		Heartbeat: h.p.Heartbeat, AdminToken: adminToken, DrainTimeout: 5 * time.Second,
		Routes: []schema.Route{{Method: "*", Prefix: routeOf(kind)}}})
	if err != nil {
		return err
	}
	r := chi.NewRouter()
	sk.Mount(r)
	r.With(sk.Gate).Handle(routeOf(kind)+"*", http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok"))
	}))
	srv := &http.Server{Handler: r, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	var runErr error
	go func() { defer close(done); runErr = sk.Run(ctx) }()
	stop := func() {
		cancel()
		select {
		case <-done:
		case <-time.After(time.Minute):
		}
		sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = srv.Shutdown(sctx)
		scancel()
	}
	h.t.Cleanup(stop)
	select {
	case <-sk.Running():
	case <-done:
		return fmt.Errorf("instance %s stopped at start: %w", id.Key(), runErr)
	case <-time.After(2 * time.Minute):
		return fmt.Errorf("instance %s not running within 2 minutes", id.Key())
	}
	h.mu.Lock()
	h.fleet[id.Key()] = &instance{sk: sk, stop: stop}
	h.mu.Unlock()
	return nil
}

// roleStats are one role's NATS counters, summed over its connections on every server.
type roleStats struct {
	Conns             int
	InMsgs, OutMsgs   int64 // InMsgs: what the role's connections sent; OutMsgs: what they received
	InBytes, OutBytes int64
}

// natsStats sums every server's per-connection counters by role (the connection name's prefix).
func (h *harness) natsStats() map[string]roleStats {
	out := map[string]roleStats{}
	for _, s := range h.cluster.Servers {
		cz, err := s.Connz(&natsserver.ConnzOptions{Limit: 1 << 20})
		if err != nil {
			h.t.Fatal(err)
		}
		for _, c := range cz.Conns {
			role, _, _ := strings.Cut(c.Name, ":")
			if role == "" {
				role = "other"
			}
			r := out[role]
			r.Conns++
			r.InMsgs += c.InMsgs
			r.OutMsgs += c.OutMsgs
			r.InBytes += c.InBytes
			r.OutBytes += c.OutBytes
			out[role] = r
		}
	}
	return out
}

// logTopSubs logs role's 8 busiest subscriptions (messages delivered since each was made,
// summed by subject over the role's connections and the servers): what a role receives, by
// what it asked for.
func (h *harness) logTopSubs(role string) {
	bySubject := map[string]uint64{}
	for _, s := range h.cluster.Servers {
		cz, err := s.Connz(&natsserver.ConnzOptions{Limit: 1 << 20, SubscriptionsDetail: true})
		if err != nil {
			h.t.Error(err)
			return
		}
		for _, c := range cz.Conns {
			if r, _, _ := strings.Cut(c.Name, ":"); r != role {
				continue
			}
			for _, sd := range c.SubsDetail {
				bySubject[sd.Subject] += uint64(sd.Msgs)
			}
		}
	}
	subjects := slices.Collect(maps.Keys(bySubject))
	slices.SortFunc(subjects, func(a, b string) int { return cmp.Compare(bySubject[b], bySubject[a]) })
	for _, subj := range subjects[:min(8, len(subjects))] {
		h.t.Logf("%s receives on %s: %d messages", role, subj, bySubject[subj])
	}
}

// rates is what each role received and sent per second between two natsStats.
type rates struct {
	Conns                                    int
	RecvMsgs, RecvBytes, SentMsgs, SentBytes float64 // per second, all connections of the role
}

func diffStats(a, b map[string]roleStats, d time.Duration) map[string]rates {
	out := map[string]rates{}
	s := d.Seconds()
	for role, y := range b {
		x := a[role]
		out[role] = rates{Conns: y.Conns, RecvMsgs: float64(y.OutMsgs-x.OutMsgs) / s, RecvBytes: float64(y.OutBytes-x.OutBytes) / s,
			SentMsgs: float64(y.InMsgs-x.InMsgs) / s, SentBytes: float64(y.InBytes-x.InBytes) / s}
	}
	return out
}
