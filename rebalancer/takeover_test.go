package rebalancer

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
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
			kittest.Shard(t, shardkit.Config{Store: st, ID: schema.InstanceID{Kind: "aggregate", Shard: "s-1"},
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
			got, _ := st.Placements("aggregate").Latest(ctx, "acme")
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
		p, err := st.Placements("aggregate").Latest(context.Background(), tenant)
		if err == nil && ok(p) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("placement of %s: %+v (%v)", tenant, p, err)
		}
		time.Sleep(20 * time.Millisecond) // polling the placement: the test has no watch of its own
	}
}

// Presence calls an instance gone (no lease to wait out) only when its NATS connection is gone
// and nothing listens at its address any more. One whose process still listens (it lost NATS:
// a NATS server restarted, a link broke) serves under its lease: it is only silent, and dead
// after DeadAfter.
func TestPresenceGoneOnlyWithoutAProcess(t *testing.T) {
	st := openStore(t)
	ctx := context.Background()
	listening := httptest.NewServer(http.NotFoundHandler())
	defer listening.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := "http://" + ln.Addr().String()
	ln.Close() // nothing listens: a connection is refused
	for shard, url := range map[string]string{"s-alive": listening.URL, "s-dead": closed} {
		// Registered, never answering its ping (it has no NATS connection).
		if _, err := st.Directory().PutMember(ctx, schema.Instance{InstanceID: schema.InstanceID{Kind: "aggregate", Shard: shard, Instance: "i1"},
			URL: url, Capacity: 10, Reported: schema.StatusOnline, Started: time.Now().UTC()}); err != nil {
			t.Fatal(err)
		}
	}
	pr := NewPresence(st, PresenceConfig{SuspectAfter: 100 * time.Millisecond, DeadAfter: time.Hour, ProbeEvery: 50 * time.Millisecond})
	pctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = pr.Run(pctx) }()
	defer func() { cancel(); <-done }()
	deadline := time.After(10 * time.Second)
	for pr.Shard("aggregate", "s-dead").Gone == 0 {
		select {
		case <-pr.Changed():
		case <-time.After(50 * time.Millisecond): // probes find nothing new until the first answer
		case <-deadline:
			t.Fatalf("the instance with no process was not found gone: %+v", pr.Shard("aggregate", "s-dead"))
		}
	}
	// s-alive is probed at the same pace: over ten more probe rounds it is never found gone.
	for end := time.Now().Add(500 * time.Millisecond); time.Now().Before(end); {
		if sp := pr.Shard("aggregate", "s-alive"); sp.Gone != 0 || sp.Live != 1 {
			t.Fatalf("an instance whose process still listens: %+v, want live (silent, not gone) until DeadAfter", sp)
		}
		time.Sleep(10 * time.Millisecond) // watching for a finding that must not come
	}
}
