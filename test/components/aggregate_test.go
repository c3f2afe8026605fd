package components_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/services/aggregate"
	"github.com/tenantmesh/tenantmesh/services/aggregate/ledgertest"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// aggregateInstance is one aggregate shard instance (the service with shardkit) on real HTTP,
// with its own metrics.
type aggregateInstance struct {
	url string
	svc *aggregate.Service
	sk  *shardkit.Shard
	reg *prometheus.Registry
}

// startAggregate runs an aggregate instance of shard on st with cfg (Store and Registerer set
// here) until the test ends.
func startAggregate(t testing.TB, st *schema.Store, shard string, cfg aggregate.Config) *aggregateInstance {
	t.Helper()
	in := &aggregateInstance{reg: prometheus.NewRegistry()}
	cfg.Store, cfg.Registerer = st, in.reg
	svc, err := aggregate.New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	runService(t, svc.Run)
	in.svc = svc
	in.sk, in.url = serveShard(t, shardkit.Config{Store: st, ID: schema.InstanceID{Kind: "aggregate", Shard: shard, Instance: "i1"},
		Routes: svc.Routes(), Hooks: svc.Hooks(), Heartbeat: 100 * time.Millisecond},
		func(r chi.Router, sk *shardkit.Shard) { svc.Mount(r, sk.Gate, sk.RequireAdmin) })
	return in
}

// rehydrations counts the instance's tenant loads by strategy.
func (in *aggregateInstance) rehydrations(t *testing.T) map[string]uint64 {
	t.Helper()
	mfs, err := in.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]uint64{}
	for _, mf := range mfs {
		if mf.GetName() == "tm_aggregate_rehydrate_seconds" {
			for _, m := range mf.GetMetric() {
				out[m.GetLabel()[0].GetValue()] = m.GetHistogram().GetSampleCount()
			}
		}
	}
	return out
}

// command runs one ledger command on svc directly (not through the gate: the tests place the
// tenant on svc's shard first) and fails the test on error.
func command(t testing.TB, svc *aggregate.Service, tenant, account, name string, amount int64, key string) aggregate.Result {
	t.Helper()
	r, err := svc.Handle(context.Background(), tenant, ledgertest.Command(account, name, amount, key))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// startLedger runs an aggregate service on st without a shard (the ledger the projection
// tests write through) until the test ends.
func startLedger(t testing.TB, st *schema.Store) *aggregate.Service {
	t.Helper()
	svc, err := aggregate.New(context.Background(), aggregate.Config{Store: st})
	if err != nil {
		t.Fatal(err)
	}
	runService(t, svc.Run)
	return svc
}

// adminTenants reads an instance's GET /admin/tenants.
func adminTenants(t *testing.T, url string) (sizes []schema.TenantSize, total uint64) {
	t.Helper()
	var body struct {
		Sizes       []schema.TenantSize `json:"sizes"`
		StoredBytes uint64              `json:"stored_bytes"`
	}
	if code, _ := call(t, "GET", url+"/admin/tenants", nil, &body); code != http.StatusOK {
		t.Fatalf("GET /admin/tenants: %d", code)
	}
	return body.Sizes, body.StoredBytes
}

// The planner reads the tenants' sizes from telemetry and chooses, per move, snapshot
// migration for the tenant whose events weigh more than the kind's threshold and cold replay
// for the lighter one; the dry run shows both with a predicted warm-up; applied by the
// rebalancer's engine, the target loads each tenant with the strategy chosen (its rehydrate
// metric, by strategy). The sizes are also in /admin/tenants.
func TestWarmupStrategyBySize(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	st, _ := kittest.Store(t)
	ctx := context.Background()
	kc := schema.DefaultKindConfig("aggregate")
	kc.Warmup = &schema.WarmupConfig{SnapshotAboveBytes: 100 << 10, SLO: schema.Duration(time.Hour)}
	if _, err := st.Kinds().Put(ctx, kc); err != nil {
		t.Fatal(err)
	}
	src := startAggregate(t, st, "aggregate-1", aggregate.Config{SnapshotEvery: 100})
	dst := startAggregate(t, st, "aggregate-2", aggregate.Config{SnapshotEvery: 100})
	events := map[string]int{"big": 1500, "small": 150} // ~375 KB and ~37 KB of events
	for tenant, n := range events {
		if _, err := st.Placements("aggregate").Create(ctx, schema.Placement{Tenant: tenant, Shard: "aggregate-1"}); err != nil {
			t.Fatal(err)
		}
		command(t, src.svc, tenant, "acc", aggregate.CmdOpen, 0, "open")
		for i := 1; i < n; i++ {
			command(t, src.svc, tenant, "acc", aggregate.CmdDeposit, 1, fmt.Sprintf("d%d", i))
		}
	}

	tel, err := rebalancer.WatchTelemetry(st, "aggregate")
	if err != nil {
		t.Fatal(err)
	}
	defer tel.Stop()
	sized := func() map[string]schema.TenantSize {
		out := map[string]schema.TenantSize{}
		for _, r := range tel.Reports("aggregate", time.Now(), 5*time.Second) {
			for _, z := range r.Sizes {
				out[z.Tenant] = z
			}
		}
		return out
	}
	tmtest.WaitFor(t, 20*time.Second, tmtest.Until("telemetry with both tenants' events and snapshots", func() bool {
		z := sized()
		return z["big"].Events == 1500 && z["small"].Events == 150 && z["big"].SnapshotBytes > 0 && z["small"].SnapshotBytes > 0
	}))
	z := sized()
	if big, small := z["big"].EventBytes, z["small"].EventBytes; big < 100<<10 || small >= 100<<10 || big < 8*small {
		t.Fatalf("event bytes: big %d, small %d; want big over the 100 KiB threshold, small under it", big, small)
	}
	sizes, total := adminTenants(t, src.url)
	if len(sizes) != 2 || sizes[0].Tenant != "big" || sizes[0].EventBytes != z["big"].EventBytes || total < sizes[0].Bytes() {
		t.Fatalf("/admin/tenants sizes %+v (total %d), want big first with the telemetry's bytes", sizes, total)
	}

	plan, err := rebalancer.MakePlan(ctx, st, planner.Request{Strategy: planner.StrategyManual, Kind: "aggregate",
		Moves: []planner.ManualMove{{Tenant: "big", To: "aggregate-2"}, {Tenant: "small", To: "aggregate-2"}}},
		rebalancer.WorldOptions{Telemetry: tel})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"big": planner.WarmupSnapshot, "small": planner.WarmupReplay}
	for _, m := range plan.Moves {
		if m.Warmup != want[m.Tenant] || !(m.WarmupSeconds > 0) || m.Bytes == 0 {
			t.Fatalf("move of %s: warm-up %q in %vs, %d bytes; want %s", m.Tenant, m.Warmup, m.WarmupSeconds, m.Bytes, want[m.Tenant])
		}
	}
	dry := plan.String()
	if !strings.Contains(dry, "snapshot") || !strings.Contains(dry, "replay") || !strings.Contains(dry, "PREDICTED") {
		t.Fatalf("the dry run does not show the strategies:\n%s", dry)
	}
	t.Log("\n" + dry)

	before := dst.rehydrations(t)
	e, err := rebalancer.New(rebalancer.Config{Store: st, Holder: "r1"})
	if err != nil {
		t.Fatal(err)
	}
	rec, err := e.CreatePlan(ctx, plan, "test")
	if err != nil {
		t.Fatal(err)
	}
	if rec, err = e.Apply(ctx, rec.ID); err != nil || rec.Status != rebalancer.PlanDone {
		t.Fatalf("apply: %v, status %v", err, rec.Status)
	}
	after := dst.rehydrations(t)
	if after["snapshot"]-before["snapshot"] != 1 || after["replay"]-before["replay"] != 1 {
		t.Fatalf("the target loaded by strategy %v (before the moves %v), want one snapshot load and one replay", after, before)
	}
	for tenant, n := range events {
		if !slices.Contains(dst.svc.Hosted(), tenant) {
			t.Fatalf("the target does not hold %s after the moves", tenant)
		}
		if r := command(t, dst.svc, tenant, "acc", aggregate.CmdDeposit, 1, "after-move"); r.Version != uint64(n)+1 {
			t.Fatalf("%s after the move: version %d, want %d (every event loaded)", tenant, r.Version, n+1)
		}
	}
}

// damageSnapshot waits until the stored snapshot of tenant covers sequence seq, then stores it
// again with account's balance 1000 higher: a snapshot damaged in the object store.
func damageSnapshot(t *testing.T, st *schema.Store, tenant, account string, seq uint64) {
	t.Helper()
	ctx := context.Background()
	os, err := st.JS().ObjectStore(ctx, schema.ServiceBucket("aggregate", "snapshots"), "")
	if err != nil {
		t.Fatal(err)
	}
	var snap map[string]any
	tmtest.WaitFor(t, 10*time.Second, func() error {
		b, err := os.GetBytes(ctx, tenant)
		if err != nil {
			return err
		}
		d := json.NewDecoder(bytes.NewReader(b))
		d.UseNumber()
		snap = nil
		if err := d.Decode(&snap); err != nil {
			return err
		}
		if applied, _ := snap["applied"].(json.Number).Int64(); uint64(applied) < seq {
			return fmt.Errorf("the snapshot is at %d, not yet %d", applied, seq)
		}
		return nil
	})
	acc := snap["state"].(map[string]any)["accounts"].(map[string]any)[account].(map[string]any)
	bal, _ := acc["balance"].(json.Number).Int64()
	acc["balance"] = bal + 1000
	b, _ := json.Marshal(snap)
	if _, err := os.PutBytes(ctx, tenant, b); err != nil {
		t.Fatal(err)
	}
}

// TestVerifyCatchesACorruptSnapshot moves two tenants whose target loads their snapshot: one
// as stored by the ledger, one whose snapshot was damaged (an account's balance off by 1000).
// The per-account digests at the fence match for the first and differ for the second; with
// verify on for the kind, the source keeps the damaged tenant's ledger (it is not released).
func TestVerifyCatchesACorruptSnapshot(t *testing.T) {
	st, _ := kittest.Store(t)
	ctx := context.Background()
	verifiedKind(t, st, "aggregate", "aggregate-1", "good", "acme")
	a := startAggregate(t, st, "aggregate-1", aggregate.Config{SnapshotEvery: 1})
	b := startAggregate(t, st, "aggregate-2", aggregate.Config{SnapshotEvery: 100})
	last := map[string]uint64{}
	for _, tenant := range []string{"good", "acme"} {
		for i := range 3 {
			command(t, a.svc, tenant, fmt.Sprintf("acc%d", i), aggregate.CmdOpen, 0, fmt.Sprintf("%s-open-%d", tenant, i))
			last[tenant] = command(t, a.svc, tenant, fmt.Sprintf("acc%d", i), aggregate.CmdDeposit, int64(10*(i+1)), fmt.Sprintf("%s-dep-%d", tenant, i)).Seq
		}
	}

	m := moveWithEngine(t, st, "aggregate", "good", "aggregate-2", string(aggregate.StrategySnapshot))
	v, err := rebalancer.VerifyMove(ctx, st, m)
	if err != nil || v.Result != schema.VerifyMatch || len(v.Target) != 1 || v.Target[0].Digest.Items != 4 {
		t.Fatalf("a faithful target: %v %+v", err, v)
	}
	if slices.Contains(a.svc.Hosted(), "good") {
		t.Error("the source still holds a tenant whose move verified")
	}

	damageSnapshot(t, st, "acme", "acc1", last["acme"])
	m = moveWithEngine(t, st, "aggregate", "acme", "aggregate-2", string(aggregate.StrategySnapshot))
	v, err = rebalancer.VerifyMove(ctx, st, m)
	if err != nil || v.Result != schema.VerifyMismatch {
		t.Fatalf("a target loaded from a damaged snapshot: %v %+v", err, v)
	}
	t.Logf("verdict: %s", v.Detail)
	if acc, err := b.svc.Account(ctx, "acme", "acc1"); err != nil || acc.Balance != 1020 {
		t.Fatalf("the target was meant to hold the damaged ledger: %+v %v", acc, err)
	}
	if !slices.Contains(a.svc.Hosted(), "acme") {
		t.Fatal("the source released the tenant although its target differs")
	}
	if held := a.sk.HeldTenants(); len(held) != 1 || held[0].Tenant != "acme" {
		t.Fatalf("held: %+v", held)
	}
}
