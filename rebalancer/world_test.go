package rebalancer

import (
	"context"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

var t0 = time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)

func inst(shard, name string, capacity int, age time.Duration, reported schema.Status, labels map[string]string) schema.Instance {
	return schema.Instance{InstanceID: schema.InstanceID{Kind: "aggregate", Shard: shard, Instance: name}, URL: "http://x", Capacity: capacity,
		Labels: labels, Heartbeat: t0.Add(-age), Reported: reported}
}

func pl(tenant, shard string, rev uint64) schema.Placement {
	return schema.Placement{Kind: "aggregate", Tenant: tenant, Shard: shard, Epoch: 1, Phase: schema.PhaseActive, Revision: rev}
}

func shardByName(w planner.World, name string) planner.Shard {
	for _, s := range w.Shards {
		if s.Name == name {
			return s
		}
	}
	return planner.Shard{}
}

func tenantByID(w planner.World, id string) planner.Tenant {
	for _, t := range w.Tenants {
		if t.ID == id {
			return t
		}
	}
	return planner.Tenant{}
}

// TestAssembleWorldShards checks shards from the directory: live capacity summed, shared
// labels, draining when no instance is live or all drain, and shards known only from placements.
func TestAssembleWorldShards(t *testing.T) {
	eu := map[string]string{"region": "eu", "disk": "ssd"}
	insts := []schema.Instance{
		inst("a-1", "i1", 100, 0, schema.StatusOnline, eu),
		inst("a-1", "i2", 50, time.Second, schema.StatusOnline, map[string]string{"region": "eu", "disk": "hdd"}),
		inst("a-1", "dead", 1000, 5*time.Minute, schema.StatusOnline, nil), // offline: not counted
		inst("a-2", "i1", 100, 0, schema.StatusDraining, nil),              // all draining
		inst("a-3", "i1", 100, 10*time.Second, schema.StatusOnline, nil),   // degraded is live
	}
	pls := []schema.Placement{pl("z", "a-1", 3), pl("b", "a-2", 4), pl("c", "gone", 5)}
	p := pl("m", "a-1", 6)
	p.Phase, p.Target = schema.PhaseWarming, "a-3"
	pls = append(pls, p)
	pinned := pl("pin", "a-3", 7)
	pinned.Pinned = true
	pls = append(pls, pinned)
	w := assembleWorld("aggregate", insts, pls, nil, WorldOptions{Now: func() time.Time { return t0 }}.withDefaults())

	if got := fmt.Sprint(len(w.Shards)); got != "4" {
		t.Fatalf("shards %+v", w.Shards)
	}
	a1 := shardByName(w, "a-1")
	if a1.MaxTenants != 150 || a1.Capacity != 150 || a1.Draining || fmt.Sprint(a1.Labels) != "map[region:eu]" {
		t.Errorf("a-1: %+v", a1)
	}
	if a2 := shardByName(w, "a-2"); !a2.Draining || a2.Capacity != 0 {
		t.Errorf("a-2 (all draining): %+v", a2)
	}
	if a3 := shardByName(w, "a-3"); a3.Draining || a3.MaxTenants != 100 {
		t.Errorf("a-3 (degraded): %+v", a3)
	}
	if g := shardByName(w, "gone"); g.Name != "gone" || !g.Draining {
		t.Errorf("shard known only from a placement: %+v", g)
	}
	if w.Tenants[0].ID != "b" || w.Tenants[len(w.Tenants)-1].ID != "z" {
		t.Errorf("tenants not sorted: %+v", w.Tenants)
	}
	if m := tenantByID(w, "m"); !m.Moving || m.Pinned {
		t.Errorf("a tenant mid-move must be left alone (moving, not pinned by the operator): %+v", m)
	}
	if tp := tenantByID(w, "pin"); !tp.Pinned || tp.Revision != 7 {
		t.Errorf("pinned tenant: %+v", tp)
	}
	for _, tn := range w.Tenants {
		if tn.Load != 1 {
			t.Errorf("without telemetry every tenant weighs the floor: %+v", tn)
		}
	}
}

// TestAssembleWorldLoad checks per-tenant load from Top lists, the residual shared by tenants
// without telemetry, the floor, and capacity in load units.
func TestAssembleWorldLoad(t *testing.T) {
	insts := []schema.Instance{
		inst("a-1", "i1", 100, 0, schema.StatusOnline, nil),
		inst("a-1", "i2", 100, 0, schema.StatusOnline, nil),
		inst("a-2", "i1", 200, 0, schema.StatusOnline, nil),
		inst("a-2", "old", 200, 5*time.Minute, schema.StatusOnline, nil),
	}
	pls := []schema.Placement{pl("hot", "a-1", 1), pl("warm", "a-1", 2), pl("q1", "a-1", 3), pl("q2", "a-1", 4), pl("cold", "a-2", 5)}
	rep := func(shard, name string, rate float64, top ...schema.TenantLoad) schema.LoadReport {
		return schema.LoadReport{InstanceID: schema.InstanceID{Kind: "aggregate", Shard: shard, Instance: name}, Time: t0, RatePerSec: rate, Top: top}
	}
	reports := []schema.LoadReport{
		rep("a-1", "i1", 70, schema.TenantLoad{Tenant: "hot", RatePerSec: 50}, schema.TenantLoad{Tenant: "warm", RatePerSec: 10}),
		rep("a-1", "i2", 60, schema.TenantLoad{Tenant: "hot", RatePerSec: 50}),
		rep("a-2", "i1", 0),
		rep("a-2", "old", 1000, schema.TenantLoad{Tenant: "cold", RatePerSec: 1000}), // offline instance: ignored
	}
	w := assembleWorld("aggregate", insts, pls, reports, WorldOptions{Now: func() time.Time { return t0 }}.withDefaults())
	want := map[string]float64{"hot": 100, "warm": 10, "q1": 10, "q2": 10, "cold": 1}
	total := 0.0
	for id, l := range want {
		if got := tenantByID(w, id).Load; got != l {
			t.Errorf("%s: load %v, want %v", id, got, l)
		}
		total += l
	}
	a1, a2 := shardByName(w, "a-1"), shardByName(w, "a-2")
	if math.Abs(a1.Capacity-2*total*200/400) > 1e-9 || math.Abs(a2.Capacity-2*total*200/400) > 1e-9 {
		t.Errorf("capacities %v %v, want the shard's share of capacity times total load times 2", a1.Capacity, a2.Capacity)
	}
}

func TestBuildWorldFromNATS(t *testing.T) {
	st := openStore(t)
	ctx := context.Background()
	for _, sh := range []string{"s-1", "s-2"} {
		if _, err := st.Directory().Register(ctx, schema.Instance{InstanceID: schema.InstanceID{Kind: "aggregate", Shard: sh, Instance: "i1"},
			URL: "http://127.0.0.1:9", Capacity: 1000}); err != nil {
			t.Fatal(err)
		}
	}
	place(t, st, "acme", "s-1")
	place(t, st, "globex", "s-1")

	tel := &Telemetry{latest: map[string]schema.LoadReport{}, added: make(chan struct{}, 64)}
	sub, err := st.SubscribeLoad("aggregate", tel.Add)
	if err != nil {
		t.Fatal(err)
	}
	tel.sub = sub
	defer tel.Stop()
	if err := st.PublishLoad(schema.LoadReport{InstanceID: schema.InstanceID{Kind: "aggregate", Shard: "s-1", Instance: "i1"},
		RatePerSec: 42, Top: []schema.TenantLoad{{Tenant: "acme", RatePerSec: 40}}}); err != nil {
		t.Fatal(err)
	}
	deadline := time.After(10 * time.Second)
	for {
		rs := tel.Reports("aggregate", time.Now(), 0)
		found := false
		for _, r := range rs {
			found = found || r.RatePerSec == 42
		}
		if found {
			break
		}
		select {
		case <-tel.added:
		case <-deadline:
			t.Fatal("the load report never arrived")
		}
	}
	w, err := BuildWorld(ctx, st, "aggregate", WorldOptions{Telemetry: tel})
	if err != nil {
		t.Fatal(err)
	}
	if len(w.Shards) != 2 || shardByName(w, "s-1").MaxTenants != 1000 {
		t.Fatalf("shards %+v", w.Shards)
	}
	if a, g := tenantByID(w, "acme"), tenantByID(w, "globex"); a.Load != 40 || g.Load != 2 || a.Revision == 0 {
		t.Fatalf("acme %+v globex %+v (globex gets the shard's unexplained 2/s)", a, g)
	}
}

// TestBalanceSkewedLoadApplied plans a balance on placements concentrated on one shard with
// synthetic telemetry, applies it against real shard instances, and checks the kind's
// max/mean utilisation ends within the tolerance.
func TestBalanceSkewedLoadApplied(t *testing.T) {
	if testing.Short() {
		t.Skip("applies moves against real shards")
	}
	st := openStore(t)
	ctx := context.Background()
	for _, s := range []string{"s-1", "s-2", "s-3"} {
		startShard(t, st, s)
	}
	loads := map[string]float64{}
	tel := &Telemetry{latest: map[string]schema.LoadReport{}}
	var top []schema.TenantLoad
	total := 0.0
	for i := range 12 {
		id := fmt.Sprintf("t%02d", i)
		shard := "s-1"
		if i >= 10 {
			shard = "s-2"
		}
		place(t, st, id, shard)
		loads[id] = float64(10 + 5*(i%4))
		top = append(top, schema.TenantLoad{Tenant: id, RatePerSec: loads[id]})
		total += loads[id]
	}
	// One report names every tenant's rate; the planner does not care which instance said it.
	tel.Add(schema.LoadReport{InstanceID: schema.InstanceID{Kind: "aggregate", Shard: "s-1", Instance: "i1"}, Time: time.Now(), RatePerSec: total, Top: top})
	opts := WorldOptions{Telemetry: tel}
	const tol = 0.15
	p, err := MakePlan(ctx, st, planner.Request{Strategy: planner.StrategyBalance, Kind: "aggregate", Options: planner.Options{Tolerance: tol}}, opts)
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Moves) == 0 || p.Summary("aggregate").Before.MaxOverMean < 2 {
		t.Fatalf("expected a skewed start and moves: %s", p)
	}
	e := newEngine(t, st, Config{})
	rec, err := e.CreatePlan(ctx, p, "test")
	if err != nil {
		t.Fatal(err)
	}
	if rec, err = e.Apply(ctx, rec.ID); err != nil || rec.Status != PlanDone {
		t.Fatalf("apply: %v, status %s", err, rec.Status)
	}
	w, err := BuildWorld(ctx, st, "aggregate", opts)
	if err != nil {
		t.Fatal(err)
	}
	load := map[string]float64{}
	for _, tn := range w.Tenants {
		load[tn.Shard] += loads[tn.ID]
	}
	var maxU, sumL, sumC float64
	for _, s := range w.Shards {
		maxU = max(maxU, load[s.Name]/s.Capacity)
		sumL += load[s.Name]
		sumC += s.Capacity
	}
	if ratio := maxU / (sumL / sumC); ratio > 1+tol+1e-9 {
		t.Fatalf("after apply max/mean = %.3f > %.2f; load per shard %v\n%s", ratio, 1+tol, load, p)
	}
}
