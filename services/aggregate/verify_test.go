package aggregate

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit/events"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// applyMove moves tenant to the other aggregate shard with the rebalancer's engine, the target
// told to load the tenant's snapshot, and returns the finished move.
func applyMove(t *testing.T, st *schema.Store, tenant, to string) rebalancer.MoveRecord {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	p, err := st.Placements("aggregate").Get(ctx, tenant)
	if err != nil {
		t.Fatal(err)
	}
	eng, err := rebalancer.New(rebalancer.Config{Store: st, Holder: "test"})
	if err != nil {
		t.Fatal(err)
	}
	rec, err := eng.CreatePlan(ctx, &planner.Plan{Strategy: planner.StrategyManual, Concurrency: 1, Waves: 1,
		Moves: []planner.Move{{Kind: "aggregate", Tenant: tenant, From: p.Shard, To: to, Revision: p.Revision, Wave: 1,
			Warmup: string(events.StrategySnapshot)}}}, "test")
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

// corruptSnapshot stores a snapshot of tenant that equals its ledger except for one account's
// balance, as a target loading it would see a snapshot damaged in the object store.
func corruptSnapshot(t *testing.T, st *schema.Store, tenant, account string) {
	t.Helper()
	ctx := context.Background()
	scratch := newService(t, st, Config{})
	type position struct {
		Version uint64 `json:"version"`
		Seq     uint64 `json:"seq"`
	}
	snap := map[string]any{"format": 2, "tenant": tenant, "recent": []any{}}
	err := scratch.log.Read(ctx, tenant, "", func(s *ledgerState, applied uint64) error {
		subjects := map[string]position{}
		for id, a := range s.Accounts {
			subjects[subject(id)] = position{a.Version, a.LastSeq}
		}
		b, _ := json.Marshal(s) // a copy, so the scratch state is not changed
		var state ledgerState
		if err := json.Unmarshal(b, &state); err != nil {
			return err
		}
		state.Accounts[account].Balance += 1000
		snap["applied"], snap["subjects"], snap["state"] = applied, subjects, &state
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(snap)
	os, err := st.JS().ObjectStore(ctx, schema.ServiceBucket("aggregate", "snapshots"), "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.PutBytes(ctx, tenant, b); err != nil {
		t.Fatal(err)
	}
}

// TestVerifyCatchesACorruptSnapshot moves two tenants whose target loads their snapshot: one
// as stored by the ledger, one whose snapshot was damaged (an account's balance off by 1000).
// The per-account digests at the fence match for the first and differ for the second; with
// verify on for the kind, the source keeps the damaged tenant's ledger (it is not released).
func TestVerifyCatchesACorruptSnapshot(t *testing.T) {
	if testing.Short() {
		t.Skip("integration: two shards, the rebalancer's engine")
	}
	st := openStore(t)
	ctx := context.Background()
	kc := schema.DefaultKindConfig("aggregate")
	kc.Verify = true
	if _, err := st.Kinds().Put(ctx, kc); err != nil {
		t.Fatal(err)
	}
	for _, tenant := range []string{"good", "acme"} {
		if _, err := st.Placements("aggregate").Create(ctx, schema.Placement{Tenant: tenant, Shard: "aggregate-1"}); err != nil {
			t.Fatal(err)
		}
	}
	a := startInstance(t, st, "aggregate-1")
	b := startInstance(t, st, "aggregate-2")
	c := &client{st: st, urls: map[string]string{"aggregate-1": a.url, "aggregate-2": b.url},
		hc: &http.Client{Timeout: 10 * time.Second}, acked: map[string]int64{}}
	for _, tenant := range []string{"good", "acme"} {
		for i := range 3 {
			c.send(t, tenant, cmd(fmt.Sprintf("acc%d", i), CmdOpen, 0, fmt.Sprintf("%s-open-%d", tenant, i)), 0)
			c.send(t, tenant, cmd(fmt.Sprintf("acc%d", i), CmdDeposit, int64(10*(i+1)), fmt.Sprintf("%s-dep-%d", tenant, i)), int64(10*(i+1)))
		}
	}
	if t.Failed() {
		return
	}

	m := applyMove(t, st, "good", "aggregate-2")
	v, err := rebalancer.VerifyMove(ctx, st, m)
	if err != nil || v.Result != schema.VerifyMatch || len(v.Target) != 1 || v.Target[0].Digest.Items != 4 {
		t.Fatalf("a faithful target: %v %+v", err, v)
	}
	if slices.Contains(a.svc.Hosted(), "good") {
		t.Error("the source still holds a tenant whose move verified")
	}

	corruptSnapshot(t, st, "acme", "acc1")
	m = applyMove(t, st, "acme", "aggregate-2")
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
