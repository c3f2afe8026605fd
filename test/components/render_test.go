package components_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
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

// startRender runs one render instance (its own shard) with shardkit, as shardmain would.
func startRender(t *testing.T, st *schema.Store, name string, capacity int) *renderInstance {
	t.Helper()
	r := chi.NewRouter()
	srv := httptest.NewUnstartedServer(r)
	svc := render.New(render.Config{Capacity: capacity, LoadTime: 2 * time.Millisecond, RenderTime: time.Microsecond})
	id := schema.InstanceID{Kind: render.Kind, Shard: "render-" + name, Instance: name}
	sk, err := shardkit.New(shardkit.Config{Store: st, ID: id, URL: "http://" + srv.Listener.Addr().String(), Capacity: capacity,
		Routes: svc.Routes(), Hooks: svc.Hooks(), Heartbeat: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	sk.Mount(r)
	r.Mount("/", svc.Handler(sk))
	srv.Start()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 2)
	go func() { done <- sk.Run(ctx) }()
	go func() { _ = svc.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			t.Error("render instance did not stop")
		}
		srv.Close()
	})
	select {
	case <-sk.Running():
	case err := <-done:
		t.Fatal(err)
	case <-time.After(20 * time.Second):
		t.Fatal("render instance not running")
	}
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
	a := startRender(t, st, "a", 2)
	b := startRender(t, st, "b", 2)
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
