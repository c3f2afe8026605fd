package rebalancer

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// A pause recorded by another process (here another engine, as `rebalance pause` is beside a
// `rebalance serve` that applies the plan) reaches the apply through its watch of the plan
// record: the move under way finishes and no other starts.
func TestPauseFromAnotherProcess(t *testing.T) {
	st := openStore(t)
	startShard(t, st, "s-1")
	warming := make(chan string, 4)
	gate := make(chan struct{})
	kittest.Shard(t, shardkit.Config{Store: st, ID: schema.InstanceID{Kind: "aggregate", Shard: "s-2"},
		Hooks: shardkit.Hooks{Warm: func(ctx context.Context, tenant string, _ uint64) error {
			select {
			case warming <- tenant:
			default:
			}
			select {
			case <-gate:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}}})
	var ps []schema.Placement
	for i := range 3 {
		ps = append(ps, place(t, st, fmt.Sprintf("t%d", i), "s-1"))
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	applier := newEngine(t, st, Config{Holder: "r1"})
	plan := planOf(ps...)
	plan.Concurrency = 1
	rec, err := applier.CreatePlan(ctx, plan, "test")
	if err != nil {
		t.Fatal(err)
	}
	applied := make(chan PlanRecord, 1)
	go func() {
		got, err := applier.Apply(ctx, rec.ID)
		if err != nil {
			t.Error(err)
		}
		applied <- got
	}()
	select {
	case <-warming:
	case <-ctx.Done():
		t.Fatal("no move started warming")
	}
	if _, err := newEngine(t, st, Config{Holder: "r2"}).SetControl(ctx, rec.ID, ControlPause, "ops"); err != nil {
		t.Fatal(err)
	}
	// The applier hears of it through its watch only: wait for that before the move under
	// way may finish.
	c, ok := applier.controls.Load(rec.ID)
	if !ok {
		t.Fatal("the apply has no control")
	}
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("the apply hears of the pause", c.(*planControl).halted))
	close(gate)
	var got PlanRecord
	select {
	case got = <-applied:
	case <-ctx.Done():
		t.Fatal("the paused apply did not return")
	}
	_, moves, err := applier.Plan(ctx, rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	if got.Status != PlanPaused || moves[0].State != MoveDone || moves[1].State != MovePending || moves[2].State != MovePending {
		t.Fatalf("plan %s, moves %s %s %s; want paused, done pending pending", got.Status, moves[0].State, moves[1].State, moves[2].State)
	}
}
