package components_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/gateway"
	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/server"
	"github.com/tenantmesh/tenantmesh/rebalancer/sweeper"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// failingShard runs a runner-kind shard behind a real HTTP server whose service answers 500
// while failing is set, and whose load reports carry one recent run. Its directory entry is
// rewritten at every heartbeat (the page's metrics come from it).
func failingShard(t *testing.T, st *schema.Store, shard string, failing *atomic.Bool) *shardkit.Shard {
	t.Helper()
	r := chi.NewRouter()
	srv := httptest.NewUnstartedServer(r)
	t.Cleanup(srv.Close)
	now := time.Now().UTC()
	sk, err := shardkit.New(shardkit.Config{Store: st, ID: schema.InstanceID{Kind: "runner", Shard: shard, Instance: "i1"},
		URL: "http://" + srv.Listener.Addr().String(), Heartbeat: 200 * time.Millisecond, DirectoryRefresh: 200 * time.Millisecond,
		DrainTimeout: 2 * time.Second, Hooks: shardkit.Hooks{Report: func(lr *schema.LoadReport) {
			lr.Runs = []schema.RunSummary{{ID: "j1", Tenant: "acme", Type: "email", Status: "succeeded", Attempts: 1, Finished: &now}}
		}}})
	if err != nil {
		t.Fatal(err)
	}
	sk.Mount(r)
	r.With(sk.Gate).HandleFunc("/jobs", func(w http.ResponseWriter, _ *http.Request) {
		if failing.Load() {
			w.WriteHeader(http.StatusInternalServerError)
		}
	})
	srv.Start()
	kittest.Run(t, sk)
	return sk
}

// One instance's page (the multi-host design's host page): its fields, tenants, recent runs,
// its circuit as a real gateway sees it, and a status history that records degraded from its
// error rate and from an operator's flag, which heartbeats keep until it is cleared.
func TestInstancePage(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	ctx := t.Context()
	kc, err := st.Kinds().Get(ctx, "runner")
	if err != nil {
		t.Fatal(err)
	}
	kc.DegradedErrorRate = 0.8
	if _, err := st.Kinds().Put(ctx, kc); err != nil {
		t.Fatal(err)
	}
	for tenant, shard := range map[string]string{"acme": "runner-1", "globex": "runner-1", "initech": "runner-2"} {
		if _, err := st.Placements("runner").Create(ctx, schema.Placement{Tenant: tenant, Shard: shard}); err != nil {
			t.Fatal(err)
		}
	}
	var failing atomic.Bool
	good := failingShard(t, st, "runner-1", &failing)
	// runner-2's one instance listens nowhere: the gateway's requests to it fail and open its circuit.
	dead := kittest.Shard(t, shardkit.Config{Store: st, ID: schema.InstanceID{Kind: "runner", Shard: "runner-2"},
		Routes: []schema.Route{{Method: "*", Prefix: "/jobs"}}})
	api := startRebalancer(t, st, "r1", sweeper.Config{Interval: 100 * time.Millisecond})
	gwURL := startGateway(t, st, gateway.Config{ID: "gw.test", AdminToken: "x"})

	page := func(key string) rebalancer.InstanceDetail {
		t.Helper()
		var d rebalancer.InstanceDetail
		if code, _ := call(t, "GET", api+"/api/instances/"+key, nil, &d); code != http.StatusOK {
			t.Fatalf("GET %s: %d", key, code)
		}
		return d
	}
	goodKey, deadKey := good.ID().Key(), dead.ID().Key()

	// Fields, tenants and the recent runs from telemetry.
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("the page with runs and history", func() bool {
		d := page(goodKey)
		return len(d.Runs) == 1 && len(d.History) > 0
	}))
	d := page(goodKey)
	if d.Key != goodKey || d.Shard != "runner-1" || d.TenantsTotal != 2 || len(d.Tenants) != 2 ||
		d.Tenants[0].Tenant != "acme" || d.Tenants[1].Tenant != "globex" || d.Runs[0].ID != "j1" || d.Status != schema.StatusOnline ||
		d.History[0].To != schema.StatusOnline {
		t.Fatalf("page: %+v", d)
	}

	// The gateways' circuits: requests to the dead instance open its circuit in the gateway.
	for range 4 {
		req, _ := http.NewRequest("GET", gwURL+"/jobs", nil)
		req.Header.Set(tmhttp.HeaderTenant, "initech")
		resp, err := tmtest.HTTP.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("the gateway's open circuit on the page", func() bool {
		c := page(deadKey).Circuits
		return len(c) == 1 && c[0].Gateway == "gw-test" && c[0].State == "open" && c[0].Failures >= 3
	}))
	if c := page(goodKey).Circuits; len(c) != 1 || c[0].State != "closed" {
		t.Fatalf("the healthy instance's circuits: %+v", c)
	}

	// Degraded from its error rate (the kind's threshold), and back.
	failing.Store(true)
	cl := &http.Client{Timeout: 5 * time.Second}
	jobsURL := instURL(t, st, good.ID()) + "/jobs"
	tmtest.WaitFor(t, 20*time.Second, tmtest.Until("degraded from the error rate", func() bool {
		for range 20 {
			req, _ := http.NewRequest("GET", jobsURL, nil)
			req.Header.Set(tmhttp.HeaderTenant, "acme")
			if resp, err := cl.Do(req); err == nil {
				resp.Body.Close()
			}
		}
		return strings.Contains(history(page(goodKey)), "error rate")
	}))
	failing.Store(false)
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("online once the errors stop", func() bool {
		d := page(goodKey)
		return d.Status == schema.StatusOnline && strings.HasSuffix(history(d), "online: ")
	}))

	// The operator's flag: set through the API, kept by heartbeats, respected by every reader of
	// the directory (schema.Thresholds, which gateway and planner use), then cleared.
	if code, _ := tmtest.CallJSON(t, "", "PUT", api+"/api/instances/"+goodKey+"/degraded", map[string]string{"reason": "disk"}, nil); code != http.StatusUnauthorized {
		t.Fatalf("unauthenticated flag: %d", code)
	}
	var v rebalancer.InstanceView
	if code, _ := call(t, "PUT", api+"/api/instances/"+goodKey+"/degraded", map[string]string{"reason": "disk replacement"}, &v); code != http.StatusOK ||
		v.Status != schema.StatusDegraded || v.Flag == nil || v.Flag.Reason != "disk replacement" {
		t.Fatalf("flag: %d %+v", code, v)
	}
	flagged := v.Heartbeat
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("heartbeats after the flag keep it", func() bool {
		inst, err := st.Directory().Instance(ctx, good.ID())
		return err == nil && inst.Heartbeat.After(flagged.Add(time.Second)) && inst.Flag != nil &&
			schema.Thresholds{}.Status(inst, time.Now()) == schema.StatusDegraded
	}))
	var cleared rebalancer.InstanceView
	if code, _ := call(t, "DELETE", api+"/api/instances/"+goodKey+"/degraded", nil, &cleared); code != http.StatusOK || cleared.Flag != nil {
		t.Fatalf("clear: %d %+v", code, cleared)
	}
	var h string
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("history: %s", h)
		}
	})
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("the flag and its clearing in the history", func() bool {
		h = history(page(goodKey))
		return strings.Contains(h, "degraded: flagged degraded by api/r1: disk replacement") && strings.HasSuffix(h, "online: ")
	}))

	// Unknown and malformed keys.
	if code, _ := call(t, "GET", api+"/api/instances/runner.runner-9.x", nil, nil); code != http.StatusNotFound {
		t.Fatalf("unknown instance: %d", code)
	}
	if code, _ := call(t, "PUT", api+"/api/instances/runner.runner-9.x/degraded", nil, nil); code != http.StatusNotFound {
		t.Fatalf("flag on an unknown instance: %d", code)
	}
	if code, _ := call(t, "GET", api+"/api/instances/nodots", nil, nil); code != http.StatusBadRequest {
		t.Fatalf("malformed key: %d", code)
	}
}

// history renders an instance's status history as "to: reason | ...".
func history(d rebalancer.InstanceDetail) string {
	var out []string
	for _, c := range d.History {
		out = append(out, string(c.To)+": "+c.Reason)
	}
	return strings.Join(out, " | ")
}

func instURL(t *testing.T, st *schema.Store, id schema.InstanceID) string {
	t.Helper()
	inst, err := st.Directory().Instance(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	return inst.URL
}

// startRebalancer runs a rebalancer server (`rebalance serve`) on st as holder until the test
// ends, and returns its API's base URL. It leads once the lease is its own: the tests wait for
// what the leader does, not for the leadership.
func startRebalancer(t *testing.T, st *schema.Store, holder string, sc sweeper.Config) string {
	t.Helper()
	s, err := server.New(server.Config{Store: st, Holder: holder, LeaseTTL: 900 * time.Millisecond, Sweep: sc, AdminToken: adminToken,
		Health: rebalancer.Health{Thresholds: schema.Thresholds{OfflineAfter: 2 * time.Minute}}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if err := s.Start(ctx); err != nil {
		cancel()
		t.Fatal(err)
	}
	ts := httptest.NewServer(s.Handler())
	t.Cleanup(func() { cancel(); s.Wait(); ts.Close() })
	return ts.URL
}

// call sends a request with the admin token adminToken and decodes the answer into out.
func call(t *testing.T, method, url string, body any, out any) (int, http.Header) {
	t.Helper()
	return tmtest.CallJSON(t, adminToken, method, url, body, out)
}
