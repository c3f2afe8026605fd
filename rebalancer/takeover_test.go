package rebalancer

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// A move whose target dies aborts as soon as Presence says the target has no live instance,
// while it warms (the source still serves) and in its handoff (the tenant's requests are held
// meanwhile): the source owns the tenant again at the same epoch, and no timeout is waited out.
func TestMoveToADeadTargetAborts(t *testing.T) {
	for _, phase := range []schema.Phase{schema.PhaseWarming, schema.PhaseHandoff} {
		t.Run(string(phase), func(t *testing.T) {
			st := openStore(t)
			ctx := context.Background()
			// s-1 has applied up to 5: a handoff's fence. s-2 never gets past 1: in the handoff
			// variant it is ready at warming and never at the fence; in the warming variant its
			// Warm never returns. The move waits for it in the phase under test until it dies.
			tmtest.Shard(t, shardkit.Config{Store: st, ID: schema.InstanceID{Kind: "aggregate", Shard: "s-1"},
				Hooks: shardkit.Hooks{Applied: func(string) uint64 { return 5 }}})
			stuck := func(ctx context.Context, tenant string, fence uint64) error {
				if phase == schema.PhaseHandoff {
					return nil
				}
				<-ctx.Done()
				return ctx.Err()
			}
			sk, err := shardkit.New(shardkit.Config{Store: st, ID: schema.InstanceID{Kind: "aggregate", Shard: "s-2", Instance: "i1"},
				URL: "http://127.0.0.1:9", Heartbeat: 200 * time.Millisecond, DrainTimeout: 2 * time.Second,
				Hooks: shardkit.Hooks{Warm: stuck, Applied: func(string) uint64 { return 1 }}})
			if err != nil {
				t.Fatal(err)
			}
			skCtx, kill := context.WithCancel(ctx)
			stopped := make(chan struct{})
			go func() { defer close(stopped); _ = sk.Run(skCtx) }()
			defer func() { kill(); <-stopped }()
			<-sk.Running()

			p := place(t, st, "acme", "s-1")
			e := newEngine(t, st, Config{WarmTimeout: time.Minute, HandoffTimeout: time.Minute, Presence: runPresence(t, st)})
			rec, _ := e.CreatePlan(ctx, planOf(p), "test")
			applied := make(chan error, 1)
			go func() { _, err := e.Apply(ctx, rec.ID); applied <- err }()
			waitPlacement(t, st, "acme", func(p schema.Placement) bool { return p.Phase == phase })
			kill()
			<-stopped
			select {
			case err := <-applied:
				if err != nil {
					t.Fatal(err)
				}
			case <-time.After(30 * time.Second):
				t.Fatal("the move to a dead target did not end within 30s")
			}
			_, moves, _ := e.Plan(ctx, rec.ID)
			got, _ := st.LatestPlacement(ctx, "aggregate", "acme")
			if m := moves[0]; m.State != MoveAborted || !strings.Contains(m.Reason, "no live instance") ||
				got.Shard != "s-1" || got.Phase != schema.PhaseActive || got.Epoch != 1 {
				t.Fatalf("move %s (%s), placement %s@%d %s; want aborted for the dead target, s-1@1 active", m.State, m.Reason, got.Shard, got.Epoch, got.Phase)
			}
		})
	}
}

// waitPlacement waits (up to 20s) until the tenant's aggregate placement satisfies ok.
func waitPlacement(t *testing.T, st *schema.Store, tenant string, ok func(schema.Placement) bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		p, err := st.LatestPlacement(context.Background(), "aggregate", tenant)
		if err == nil && ok(p) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("placement of %s: %+v (%v)", tenant, p, err)
		}
		time.Sleep(20 * time.Millisecond) // polling the placement: the test has no watch of its own
	}
}
