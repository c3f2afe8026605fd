package components_test

import (
	"context"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// serveShard runs a shardkit instance of cfg (URL set here) behind a real HTTP server, with
// its admin endpoints and whatever mount adds (nil: nothing), until the test ends; it returns
// the shard once it runs and its URL.
func serveShard(t testing.TB, cfg shardkit.Config, mount func(chi.Router, *shardkit.Shard)) (*shardkit.Shard, string) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cfg.URL = "http://" + ln.Addr().String()
	if cfg.Heartbeat == 0 {
		cfg.Heartbeat = 200 * time.Millisecond
	}
	if cfg.DrainTimeout == 0 {
		cfg.DrainTimeout = 5 * time.Second
	}
	if cfg.AdminToken == "" {
		cfg.AdminToken = adminToken
	}
	sk, err := shardkit.New(cfg)
	if err != nil {
		ln.Close()
		t.Fatal(err)
	}
	r := chi.NewRouter()
	sk.Mount(r)
	if mount != nil {
		mount(r, sk)
	}
	srv := &http.Server{Handler: r, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() }) // after kittest.Run's stop: cleanups run last first
	kittest.Run(t, sk)
	return sk, cfg.URL
}

// moveWithEngine moves tenant of kind to shard to with the rebalancer's engine (a manual plan
// of one move; warmup names the target's strategy, "" for the planner's default) and returns
// the move as it ended.
func moveWithEngine(t testing.TB, st *schema.Store, kind, tenant, to, warmup string) rebalancer.MoveRecord {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	p, err := st.Placements(kind).Get(ctx, tenant)
	if err != nil {
		t.Fatal(err)
	}
	eng, err := rebalancer.New(rebalancer.Config{Store: st, Holder: "test"})
	if err != nil {
		t.Fatal(err)
	}
	rec, err := eng.CreatePlan(ctx, &planner.Plan{Strategy: planner.StrategyManual, Concurrency: 1, Waves: 1,
		Moves: []planner.Move{{Kind: kind, Tenant: tenant, From: p.Shard, To: to, Revision: p.Revision, Wave: 1, Warmup: warmup}}}, "test")
	if err != nil {
		t.Fatal(err)
	}
	if rec, err = eng.Apply(ctx, rec.ID); err != nil || rec.Status != rebalancer.PlanDone {
		t.Fatalf("apply: %v (%s)", err, rec.Status)
	}
	_, moves, err := eng.Plan(ctx, rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	return moves[0]
}

// verifiedKind turns verify on for kind (its default config otherwise) and places tenants on
// shard, for a test of move verification.
func verifiedKind(t testing.TB, st *schema.Store, kind, shard string, tenants ...string) {
	t.Helper()
	ctx := context.Background()
	kc := schema.DefaultKindConfig(kind)
	kc.Verify = true
	if _, err := st.Kinds().Put(ctx, kc); err != nil {
		t.Fatal(err)
	}
	for _, tenant := range tenants {
		if _, err := st.Placements(kind).Create(ctx, schema.Placement{Tenant: tenant, Shard: shard}); err != nil {
			t.Fatal(err)
		}
	}
}
