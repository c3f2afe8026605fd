package gateway

import (
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
