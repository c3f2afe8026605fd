package components_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/gateway"
	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/services/render"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

type renderInstance struct {
	svc *render.Service
	sk  *shardkit.Shard
	key string
}

// startRender runs one render instance of shard with shardkit on real HTTP, as shardmain
// would: capacity is its registered capacity (tenants placed), cfg the service's (its page
// pool and timings).
func startRender(t *testing.T, st *schema.Store, shard, name string, capacity int, cfg render.Config) *renderInstance {
	t.Helper()
	svc := render.New(cfg)
	id := schema.InstanceID{Kind: render.Kind, Shard: shard, Instance: name}
	runService(t, svc.Run)
	sk, _ := serveShard(t, shardkit.Config{Store: st, ID: id, Capacity: capacity, Routes: svc.Routes(), Hooks: svc.Hooks(), Heartbeat: 100 * time.Millisecond},
		func(r chi.Router, sk *shardkit.Shard) { r.Mount("/", svc.Handler(sk)) })
	return &renderInstance{svc: svc, sk: sk, key: id.Key()}
}

func callRender(t *testing.T, base, tenant string) (int, string, string) {
	t.Helper()
	req, _ := http.NewRequest("POST", base+"/render", strings.NewReader(`{"path":"/"}`))
	req.Header.Set("X-Tenant-Id", tenant)
	resp, err := tmtest.HTTP.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Logf("%s: %d %s", tenant, resp.StatusCode, b)
	}
	return resp.StatusCode, resp.Header.Get(gateway.HeaderTarget), resp.Header.Get(render.HeaderCache)
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until(what, cond))
}

// The affinity policy end to end over real render instances: registration with capacity
// through shardkit, assignment, warm pages, pressure mode, LRU disposal calling Release, and
// the mapping shrinking in KV.
func TestRenderAffinityEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	st := kittest.StoreAt(t, natstest.Server(t).URL())
	ctx := context.Background()
	if _, err := st.Kinds().Put(ctx, render.KindConfig()); err != nil {
		t.Fatal(err)
	}
	a := startRender(t, st, "render-a", "a", 2, render.Config{Capacity: 2, LoadTime: 2 * time.Millisecond, RenderTime: time.Microsecond})
	b := startRender(t, st, "render-b", "b", 2, render.Config{Capacity: 2, LoadTime: 2 * time.Millisecond, RenderTime: time.Microsecond})
	insts, err := st.Directory().Instances(ctx, render.Kind)
	if err != nil || len(insts) != 2 || insts[0].Capacity != 2 {
		t.Fatalf("registration with capacity: %+v %v", insts, err)
	}
	base := startGateway(t, st, gateway.Config{})
	eventually(t, "route with both instances", func() bool {
		rt, err := st.Routes().Get(ctx, "render", "POST", "/render")
		return err == nil && len(rt.Instances) == 2
	})
	per := map[string]int{}
	for _, tn := range []string{"t1", "t2", "t3", "t4"} {
		code, tgt, cache := callRender(t, base, tn)
		if code != 200 || cache != "miss" {
			t.Fatalf("%s: %d %s", tn, code, cache)
		}
		per[tgt]++
		if code, tgt2, cache := callRender(t, base, tn); code != 200 || tgt2 != tgt || cache != "hit" {
			t.Fatalf("%s again: %d on %s (%s), first on %s", tn, code, tgt2, cache, tgt)
		}
	}
	if per[a.key] != 2 || per[b.key] != 2 {
		t.Fatalf("tenants per instance %v", per)
	}
	// t1 is the least recently used: pressure sends t5 to t1's owner, which disposes t1.
	p1, err := st.Placements(render.Kind).Get(ctx, "t1")
	if err != nil {
		t.Fatal(err)
	}
	code, tgt, _ := callRender(t, base, "t5")
	if code != 200 || tgt != p1.Owners[0] {
		t.Fatalf("pressure: %d on %s, want t1's owner %s", code, tgt, p1.Owners[0])
	}
	eventually(t, "t1 released after disposal", func() bool {
		_, err := st.Placements(render.Kind).Get(ctx, "t1")
		return errors.Is(err, schema.ErrNotFound)
	})
	p5, err := st.Placements(render.Kind).Get(ctx, "t5")
	if err != nil || !slices.Equal(p5.Owners, []string{tgt}) {
		t.Fatalf("t5 placement %+v %v", p5, err)
	}
	// t1 comes back: cold, assigned again.
	if code, _, cache := callRender(t, base, "t1"); code != 200 || cache != "miss" {
		t.Fatalf("t1 again: %d %s", code, cache)
	}
}
