package projection

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/services/aggregate"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// applyMove moves tenant's projection to shard to with the rebalancer's engine.
func applyMove(t *testing.T, st *schema.Store, tenant, to string) rebalancer.MoveRecord {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	p, err := st.Placements(Kind).Get(ctx, tenant)
	if err != nil {
		t.Fatal(err)
	}
	eng, err := rebalancer.New(rebalancer.Config{Store: st, Holder: "test"})
	if err != nil {
		t.Fatal(err)
	}
	rec, err := eng.CreatePlan(ctx, &planner.Plan{Strategy: planner.StrategyManual, Concurrency: 1, Waves: 1,
		Moves: []planner.Move{{Kind: Kind, Tenant: tenant, From: p.Shard, To: to, Revision: p.Revision, Wave: 1}}}, "test")
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

// TestVerifyViewsAtTheFence moves two tenants' projections. One moves while the ledger keeps
// writing to it, so both shards apply events past the fence before their digests are asked
// for: the digests at the fence (the source's taken at its fence, the target's from its
// history) match. The other's target loads stored views someone damaged (a balance off by
// 1000): its digest differs, and with verify on for the kind the source keeps the tenant.
func TestVerifyViewsAtTheFence(t *testing.T) {
	st := openStore(t)
	a := newAggregate(t, st)
	ctx := context.Background()
	kc := schema.DefaultKindConfig(Kind)
	kc.Verify = true
	if _, err := st.Kinds().Put(ctx, kc); err != nil {
		t.Fatal(err)
	}
	for _, tenant := range []string{"busy", "acme"} {
		if _, err := st.Placements(Kind).Create(ctx, schema.Placement{Tenant: tenant, Shard: "projection-1"}); err != nil {
			t.Fatal(err)
		}
	}
	src := startInstance(t, st, "projection-1")
	dst := startInstance(t, st, "projection-2")

	stop, progress := make(chan struct{}), make(chan int)
	done := writer(t, a, "busy", stop, progress)
	waitProgress(t, progress, 50)
	m := applyMove(t, st, "busy", "projection-2")
	waitProgress(t, progress, 20) // the ledger goes on after the move
	close(stop)
	<-done
	v, err := rebalancer.VerifyMove(ctx, st, m)
	if err != nil || v.Result != schema.VerifyMatch || v.Fence == 0 {
		t.Fatalf("a move under writes: %v %+v", err, v)
	}
	t.Logf("under writes: %s; digests took %dus (source), %dus (target)", v.Detail, v.Source[0].TookMicros, v.Target[0].TookMicros)

	for i := range 5 {
		do(t, a, "acme", command("acc"+string(rune('0'+i)), aggregate.CmdOpen, 0))
		do(t, a, "acme", command("acc"+string(rune('0'+i)), aggregate.CmdDeposit, int64(10*(i+1))))
	}
	last := do(t, a, "acme", command("acc0", aggregate.CmdDeposit, 1))
	warm(t, src.svc, "acme", last.Seq)
	snap := viewsOf(src.svc.lookup("acme"))
	damaged := snapshot{Tenant: snap.Tenant, Applied: snap.Applied, Transactions: snap.Transactions}
	for _, acc := range snap.Accounts {
		c := *acc
		if c.ID == "acc2" {
			c.Balance += 1000
		}
		damaged.Accounts = append(damaged.Accounts, &c)
	}
	if _, _, err := src.svc.st.save(ctx, damaged, storedViews{}); err != nil {
		t.Fatal(err)
	}
	m = applyMove(t, st, "acme", "projection-2")
	v, err = rebalancer.VerifyMove(ctx, st, m)
	if err != nil || v.Result != schema.VerifyMismatch {
		t.Fatalf("a target loaded from damaged views: %v %+v", err, v)
	}
	t.Logf("damaged: %s", v.Detail)
	if held := src.sk.HeldTenants(); len(held) != 1 || held[0].Tenant != "acme" {
		t.Fatalf("held: %+v", held)
	}
	// The source's placement watch sees the move end; it must not drop what shardkit holds.
	// Two reloads, each waited for: the second wait ends with a pass that began after the
	// first reload, so the tenant was looked at.
	for range 2 {
		passes := src.svc.passes.Load()
		if err := src.svc.Reload(ctx); err != nil {
			t.Fatal(err)
		}
		tmtest.WaitFor(t, 10*time.Second, tmtest.Until("the placement watch's pass over the reloaded tenants", func() bool {
			return src.svc.passes.Load() > passes
		}))
	}
	if !slices.Contains(src.svc.Tenants(), "acme") {
		t.Fatal("the source dropped a tenant its move verification holds")
	}
	if err := src.sk.ReleaseHeld(ctx, "acme"); err != nil {
		t.Fatal(err)
	}
	if slices.Contains(src.svc.Tenants(), "acme") {
		t.Fatal("the operator's release did not drop the held tenant")
	}
	_ = dst
}
