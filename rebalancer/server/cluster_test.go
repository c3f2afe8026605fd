package server

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/internal/embednats"
	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// TestAPIOnClusterLosingNodes runs the plan API on a 3-node cluster (replicas 3) while nodes go
// away and come back. A plan is readable as soon as POST /api/plans answered it, from a server
// connected to a replica that was away while it was written; while NATS cannot serve (no
// quorum: no stream or meta leader), the API answers 503 with Retry-After, never 500, and
// never 404 for a plan that exists; when the nodes are back, plans are made and read again.
func TestAPIOnClusterLosingNodes(t *testing.T) {
	if testing.Short() {
		t.Skip("integration: 3-node cluster")
	}
	c := natstest.NewCluster(t)
	reconnected := make(chan struct{}, 16)
	nc := natstest.Connect(t, c.URLs(), nats.ReconnectHandler(func(*nats.Conn) {
		select {
		case reconnected <- struct{}{}:
		default:
		}
	}))
	ctx := context.Background()
	octx, cancel := context.WithTimeout(ctx, 30*time.Second)
	st, err := schema.OpenRetry(octx, nc, schema.Options{Replicas: 3, Timeout: 2 * time.Second}) // peers may still be joining
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	for _, shard := range []string{"s-1", "s-2"} {
		if _, err := st.Directory().Register(ctx, schema.Instance{InstanceID: schema.InstanceID{Kind: "aggregate", Shard: shard, Instance: "i1"},
			URL: "http://127.0.0.1:9", Capacity: 100}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := st.Placements("aggregate").Create(ctx, schema.Placement{Tenant: "acme", Shard: "s-1"}); err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{Store: st, Holder: "r1", AdminToken: testToken, Health: rebalancer.Health{Thresholds: schema.Thresholds{OfflineAfter: time.Hour}}})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(s.Handler())
	defer ts.Close()
	base := ts.URL
	move := map[string]any{"strategy": "move-tenant", "tenant": "acme", "targets": map[string]string{"aggregate": "s-2"}}

	// createPlan posts a plan until it is created; meanwhile only 503 with Retry-After may come.
	createPlan := func(within time.Duration) string {
		t.Helper()
		deadline := time.Now().Add(within)
		for {
			var pr PlanResponse
			code, h := call(t, "POST", base+"/api/plans", move, &pr)
			if code == http.StatusCreated && len(pr.Moves) == 1 {
				return pr.Plan.ID
			}
			if code != http.StatusServiceUnavailable || h.Get("Retry-After") == "" {
				t.Fatalf("POST /api/plans: %d %+v, want 201 (or 503 with Retry-After while NATS recovers)", code, pr)
			}
			if time.Now().After(deadline) {
				t.Fatalf("POST /api/plans: still 503 after %s", within)
			}
			time.Sleep(100 * time.Millisecond) // a client's retry: Retry-After says when
		}
	}
	// readPlan requires GET /api/plans/{id} to answer the plan at once.
	readPlan := func(id string) {
		t.Helper()
		var pr PlanResponse
		if code, _ := call(t, "GET", base+"/api/plans/"+id, nil, &pr); code != http.StatusOK || pr.Plan.ID != id || len(pr.Moves) != 1 {
			t.Fatalf("GET /api/plans/%s right after it was created: %d %+v", id, code, pr)
		}
	}
	// unavailable requires a 503 problem with Retry-After, the answer while NATS has no quorum.
	unavailable := func(method, path string, body any) {
		t.Helper()
		var p tmhttp.Problem
		code, h := call(t, method, base+path, body, &p)
		if code != http.StatusServiceUnavailable || h.Get("Retry-After") == "" || h.Get("Content-Type") != tmhttp.ContentTypeProblem ||
			p.Type != tmhttp.TypeBase+"store-unavailable" {
			t.Fatalf("%s %s without quorum: %d %v %+v, want 503 store-unavailable with Retry-After", method, path, code, h, p)
		}
	}

	p1 := createPlan(30 * time.Second)
	readPlan(p1)

	// Stop a follower of the plans' stream, write a plan without it, then leave it alone.
	info, err := st.JS().JetStream().Stream(ctx, "KV_"+schema.BucketRebalance)
	if err != nil {
		t.Fatal(err)
	}
	leader := info.CachedInfo().Cluster.Leader
	follower := -1
	for i, srv := range c.Servers {
		if srv.Name() != leader {
			follower = i
		}
	}
	cfgs := make([]embednats.Config, len(c.Servers))
	for i, srv := range c.Servers {
		cfgs[i] = srv.Config()
	}
	fcfg := cfgs[follower]
	c.Servers[follower].Stop()
	t.Logf("stopped %s (a follower of %s; the leader is %s)", fcfg.Name, "KV_"+schema.BucketRebalance, leader)
	p2 := createPlan(30 * time.Second)
	readPlan(p2)

	var others []int
	for i := range c.Servers {
		if i != follower {
			others = append(others, i)
			c.Servers[i].Stop()
		}
	}
	c.Servers[follower] = natstest.Restart(t, fcfg)
	awaitConnectedTo(t, nc, reconnected, fcfg.Name, 30*time.Second)
	t.Logf("only %s runs, without %s", fcfg.Name, p2)

	// Alone, the node has no quorum: no leader answers, and its own copy lacks p2.
	unavailable("GET", "/api/plans/"+p2, nil)
	unavailable("POST", "/api/plans", move)
	unavailable("GET", "/api/plans", nil)

	for _, i := range others {
		c.Servers[i] = natstest.Restart(t, cfgs[i])
	}
	p3 := createPlan(60 * time.Second)
	readPlan(p3)
	readPlan(p2)
	readPlan(p1)
}

// awaitConnectedTo waits until nc is connected to the server named name.
func awaitConnectedTo(t *testing.T, nc *nats.Conn, reconnected <-chan struct{}, name string, within time.Duration) {
	t.Helper()
	deadline := time.After(within)
	for !nc.IsConnected() || nc.ConnectedServerName() != name {
		select {
		case <-reconnected:
		case <-deadline:
			t.Fatalf("not connected to %s within %s (connected: %v to %q)", name, within, nc.IsConnected(), nc.ConnectedServerName())
		}
	}
}
