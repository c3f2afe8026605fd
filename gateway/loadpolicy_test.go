package gateway

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

var qRoute = schema.Route{Method: "*", Prefix: "/q/", Kind: "queue"}

// publishScore publishes one load report for b whose score is s (through cpu) and waits until
// the gateway's smoothed score for it has moved to want.
func (e *env) publishLoad(b *backend, inflight int, want float64) {
	e.t.Helper()
	ke := e.gw.reg.snap.Load().kinds["queue"]
	eventually(e.t, 10*time.Second, "load score of "+b.id.Key(), func() bool {
		if math.Abs(ke.lt.Load(b.id.Key())-want) < 1e-6 {
			return true
		}
		_ = e.st.PublishLoad(schema.LoadReport{InstanceID: b.id, InFlight: inflight})
		return math.Abs(ke.lt.Load(b.id.Key())-want) < 1e-6
	})
}

// The load policy end to end: telemetry -> EMA scores -> soft affinity, broken at 0.90, and the
// balance endpoint.
func TestLoadPolicy(t *testing.T) {
	var a, b, c *backend
	e := newEnv(t, Config{}, []schema.KindConfig{{Kind: "queue", Policy: schema.PolicyLoad,
		Load: &schema.LoadConfig{EMAAlpha: 1}}}, func(e *env) {
		a = newBackend(t, "queue", "queue-1", "a")
		b = newBackend(t, "queue", "queue-1", "b")
		c = newBackend(t, "queue", "queue-1", "c")
		for _, x := range []*backend{a, b, c} {
			e.register(x, "", 100, qRoute)
		}
	})
	// Unplaced tenants are assigned to the shard (managed rule); the instance is the policy's.
	resp, _ := e.do("GET", "/q/pop", "t1", "", nil)
	if resp.StatusCode != 200 {
		t.Fatal(resp.StatusCode)
	}
	first := resp.Header.Get(tmhttp.HeaderServedBy)
	for range 10 {
		resp, _ := e.do("GET", "/q/pop", "t1", "", nil)
		if got := resp.Header.Get(tmhttp.HeaderServedBy); got != first {
			t.Fatalf("soft affinity not kept: %s then %s", first, got)
		}
	}
	by := map[string]*backend{a.id.Key(): a, b.id.Key(): b, c.id.Key(): c}
	// 0.80 on the target with peers at 0.2: gain 0.6 > 0.15 -> migrates with probability 0.6;
	// below 0.70 it stays. Push it to 0.95: the affinity breaks.
	e.publishLoad(by[first], 150, 0.6) // 0.4*150/100 = 0.6: under 0.70, respected
	for range 5 {
		resp, _ := e.do("GET", "/q/pop", "t1", "", nil)
		if got := resp.Header.Get(tmhttp.HeaderServedBy); got != first {
			t.Fatalf("affinity under 0.70 not respected: %s", got)
		}
	}
	for k, x := range by {
		if k != first {
			e.publishLoad(x, 50, 0.2)
		}
	}
	e.publishLoad(by[first], 238, 0.952)
	resp, _ = e.do("GET", "/q/pop", "t1", "", nil)
	broke := resp.Header.Get(tmhttp.HeaderServedBy)
	if broke == first {
		t.Fatalf("affinity not broken at 0.95")
	}
	resp, _ = e.do("GET", "/q/pop", "t1", "", nil)
	if got := resp.Header.Get(tmhttp.HeaderServedBy); got != broke {
		t.Fatalf("new affinity not kept: %s then %s", broke, got)
	}

	var bal Balance
	resp, body := e.do("GET", "/admin/balance", "", "", nil)
	if resp.StatusCode != 200 || jsonUnmarshal(body, &bal) != nil {
		t.Fatalf("balance %d %s", resp.StatusCode, body)
	}
	if bal.Balanced || math.Abs(bal.ImbalanceScore-0.752) > 1e-6 || len(bal.Servers) != 3 {
		t.Fatalf("balance %+v", bal)
	}
	for _, s := range bal.Servers {
		if s.ServerID == first && (math.Abs(s.LoadScore-0.952) > 1e-6 || !s.Healthy || s.URL == "") {
			t.Fatalf("server %+v", s)
		}
	}
}

// An instance that leaves takes its load-policy state with it (the Queen coordinator: "server
// dies -> all its affinities invalidated"): the affinities to it and its smoothed score are
// dropped, so when it comes back its score is its new reports' alone, and the tenant that was on
// it is assigned afresh.
func TestLoadPolicyForgetsAnInstanceThatLeft(t *testing.T) {
	var a, b *backend
	e := newEnv(t, Config{}, []schema.KindConfig{{Kind: "queue", Policy: schema.PolicyLoad,
		Load: &schema.LoadConfig{EMAAlpha: 0.5}}}, func(e *env) {
		a = newBackend(t, "queue", "queue-1", "a")
		b = newBackend(t, "queue", "queue-1", "b")
		e.register(a, "", 100, qRoute)
		e.register(b, "", 100, qRoute)
	})
	resp, _ := e.do("GET", "/q/pop", "t1", "", nil)
	first := resp.Header.Get(tmhttp.HeaderServedBy)
	by := map[string]*backend{a.id.Key(): a, b.id.Key(): b}
	gone := by[first]
	ke := e.gw.reg.snap.Load().kinds["queue"]
	_ = e.st.PublishLoad(schema.LoadReport{InstanceID: gone.id, InFlight: 150}) // score 0.6
	eventually(t, 10*time.Second, "the first report's score", func() bool { return ke.lt.Load(first) > 0 })
	if err := e.st.Directory().Unregister(context.Background(), gone.id); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, first+" forgotten", func() bool {
		_, has := ke.lt.Affinity("t1")
		return !has && ke.lt.Load(first) == 0
	})
	// Back, with an idle report: its score is that report's, 0, not half of the old 0.6.
	e.register(gone, "", 100, qRoute)
	eventually(t, 10*time.Second, first+" routed again", func() bool {
		rt := e.gw.reg.snap.Load().match("GET", "/q/pop")
		return rt != nil && len(rt.byShard["queue-1"]) == 2
	})
	_ = e.st.PublishLoad(schema.LoadReport{InstanceID: gone.id, InFlight: 0})
	eventually(t, 10*time.Second, "the new report seen", func() bool {
		var bal Balance
		_, body := e.do("GET", "/admin/balance", "", "", nil)
		if jsonUnmarshal(body, &bal) != nil {
			return false
		}
		for _, s := range bal.Servers {
			if s.ServerID == first {
				return s.LoadScore == 0
			}
		}
		return false
	})
}

// Consumer routes (the Queen coordinator's "Routes to Wrap"): the load policy's affinity is kept
// per queue:group (or queue:partition:group, namespace:task:group), not per tenant, so one
// tenant's groups spread by load while each sticks where it was assigned.
func TestConsumerRouteAffinityKeys(t *testing.T) {
	popQueue := schema.Route{Method: "GET", Prefix: "/pop/queue/", Kind: "queue", Consumer: &schema.ConsumerRoute{Key: []string{"path:0", "query:group"}}}
	popPartition := schema.Route{Method: "GET", Prefix: "/pop/partition/", Kind: "queue", Consumer: &schema.ConsumerRoute{Key: []string{"path:0", "path:1", "query:group"}}}
	popNamespace := schema.Route{Method: "GET", Prefix: "/pop/ns", Kind: "queue", Consumer: &schema.ConsumerRoute{Key: []string{"query:namespace", "query:task", "query:group"}}}
	var a, b *backend
	e := newEnv(t, Config{}, []schema.KindConfig{{Kind: "queue", Policy: schema.PolicyLoad,
		Load: &schema.LoadConfig{EMAAlpha: 1}}}, func(e *env) {
		a = newBackend(t, "queue", "queue-1", "a")
		b = newBackend(t, "queue", "queue-1", "b")
		for _, x := range []*backend{a, b} {
			e.register(x, "", 100, popQueue, popPartition, popNamespace)
		}
	})
	eventually(t, 10*time.Second, "the consumer routes", func() bool {
		rt := e.gw.reg.snap.Load().match("GET", "/pop/ns")
		return rt != nil && rt.consumer != nil && len(rt.byShard["queue-1"]) == 2
	})
	by := map[string]*backend{a.id.Key(): a, b.id.Key(): b}
	served := func(path string) string {
		t.Helper()
		resp, _ := e.do("GET", path, "t1", "", nil)
		if resp.StatusCode != 200 {
			t.Fatalf("%s: %d", path, resp.StatusCode)
		}
		return resp.Header.Get(tmhttp.HeaderServedBy)
	}
	for _, c := range []struct{ first, second, key1, key2 string }{
		{"/pop/queue/orders?group=g1", "/pop/queue/orders?group=g2", "orders:g1", "orders:g2"},
		{"/pop/partition/orders/p1?group=g1", "/pop/partition/orders/p2?group=g1", "orders:p1:g1", "orders:p2:g1"},
		{"/pop/ns?namespace=billing&task=send&group=g1", "/pop/ns?namespace=billing&task=bill&group=g1", "billing:send:g1", "billing:bill:g1"},
	} {
		// Both instances idle: the first key goes where it goes, and is loaded to 0.6 there
		// (under the 0.70 migrate threshold: its affinity stays).
		for _, x := range by {
			e.publishLoad(x, 0, 0)
		}
		first := served(c.first)
		e.publishLoad(by[first], 150, 0.6)
		second := served(c.second)
		if second == first {
			t.Fatalf("%s: a new key of the same tenant went to the loaded %s; the affinity is per tenant, not per key", c.second, first)
		}
		for range 3 {
			if got := served(c.first); got != first {
				t.Fatalf("%s: affinity not kept: %s, then %s", c.first, first, got)
			}
		}
		ke := e.gw.reg.snap.Load().kinds["queue"]
		for key, want := range map[string]string{c.key1: first, c.key2: second} {
			if got, ok := ke.lt.Affinity("t1\x00" + key); !ok || got != want {
				t.Fatalf("affinity of %s: %s %v, want %s", key, got, ok, want)
			}
		}
	}
}
