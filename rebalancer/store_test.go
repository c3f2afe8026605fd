package rebalancer

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// manyMoves is a plan of n moves of distinct tenants (their placements need not exist: a
// plan is stored as given).
func manyMoves(n int) *planner.Plan {
	p := &planner.Plan{Strategy: "manual", Concurrency: 4, Waves: 1}
	for i := range n {
		p.Moves = append(p.Moves, planner.Move{Kind: "aggregate", Tenant: fmt.Sprintf("t%05d", i), From: "s-1", To: "s-2", Revision: uint64(i + 1), Wave: 1})
	}
	return p
}

// A plan's moves are written several at once: every one is stored, in its place, with the
// revision it was written at, and the plan reads back the same.
func TestStorePlanKeepsEveryMoveInOrder(t *testing.T) {
	st := openStore(t)
	e := newEngine(t, st, Config{})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const n = directReadMoves + 44 // read back by listing, not one by one
	rec, stored, err := e.CreatePlanMoves(ctx, manyMoves(n), "test")
	if err != nil {
		t.Fatal(err)
	}
	_, read, err := e.Plan(ctx, rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	if len(stored) != n || len(read) != n {
		t.Fatalf("stored %d moves and read %d back, want %d", len(stored), len(read), n)
	}
	for i := range n {
		s, r := stored[i], read[i]
		if s.ID != moveID(i) || s.Tenant != fmt.Sprintf("t%05d", i) || s.RecordRev == 0 {
			t.Fatalf("move %d as stored: %+v", i, s)
		}
		if r.ID != s.ID || r.Tenant != s.Tenant || r.RecordRev != s.RecordRev || r.State != MovePending {
			t.Fatalf("move %d read back as %+v, stored as %+v", i, r, s)
		}
	}
}

// BenchmarkStorePlan stores a 1,000-move plan on a 3-node cluster, its moves written one at a
// time (as before) and storeWorkers at once, side by side.
func BenchmarkStorePlan(b *testing.B) {
	c := natstest.NewCluster(b)
	nc := natstest.Connect(b, c.URLs())
	octx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	st, err := schema.OpenRetry(octx, nc, schema.Options{Replicas: 3, Timeout: 5 * time.Second})
	cancel()
	if err != nil {
		b.Fatal(err)
	}
	e, err := New(Config{Store: st, Holder: "bench"})
	if err != nil {
		b.Fatal(err)
	}
	p := manyMoves(1000)
	for _, workers := range []int{1, storeWorkers} {
		b.Run(fmt.Sprintf("workers=%d", workers), func(b *testing.B) {
			defer func(w int) { storeWorkers = w }(storeWorkers)
			storeWorkers = workers
			for b.Loop() {
				if _, err := e.CreatePlan(context.Background(), p, "bench"); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
