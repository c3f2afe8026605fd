package runner

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// applyMove moves tenant's runner placement to shard to with the rebalancer's engine.
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

// TestVerifyQueueAtTheFence moves two tenants whose queues hold delayed jobs (waiting, never
// claimed) while other jobs run: their digests at the fence match, the jobs in flight left
// out. For the second tenant a job is lost in the handoff (its queue entry vanishes before
// the target looks): the target's queue differs from what the source left, and with verify on
// for the kind the source does not release the tenant.
func TestVerifyQueueAtTheFence(t *testing.T) {
	if testing.Short() {
		t.Skip("integration: two runner shards and the rebalancer's engine")
	}
	st := openStore(t)
	ctx := context.Background()
	kc := schema.DefaultKindConfig(Kind)
	kc.Verify = true
	if _, err := st.Kinds().Put(ctx, kc); err != nil {
		t.Fatal(err)
	}
	src := startService(t, st, "runner-1", "i1", Config{})
	dst := startService(t, st, "runner-2", "i1", Config{})
	var lost string // the job whose entry the handoff loses
	var once sync.Once
	srcSK := kittest.Shard(t, shardkit.Config{Store: st, ID: src.cfg.ID, Hooks: src.Hooks()})
	hooks := dst.Hooks()
	warm := hooks.Warm
	hooks.Warm = func(ctx context.Context, tenant string, fence uint64) error {
		if p, err := st.Placements(Kind).Latest(ctx, tenant); err == nil && p.Phase == schema.PhaseHandoff && tenant == "lossy" {
			once.Do(func() {
				// The source reads its digest beside the handoff: lose the job once it has
				// recorded what it saw at the fence, as a target that lost it would.
				tmtest.WaitFor(t, 10*time.Second, tmtest.Until("the source's digest recorded", func() bool {
					recs, err := st.Digests().List(ctx, Kind, tenant, p.Epoch)
					return err == nil && slices.ContainsFunc(recs, func(r schema.DigestRecord) bool { return r.Role == schema.RoleSource })
				}))
				if err := dropEntry(ctx, src, tenant, lost); err != nil {
					t.Errorf("losing job %s: %v", lost, err)
				}
			})
		}
		return warm(ctx, tenant, fence)
	}
	kittest.Shard(t, shardkit.Config{Store: st, ID: dst.cfg.ID, Hooks: hooks})

	for _, tenant := range []string{"steady", "lossy"} {
		place(t, st, tenant, "runner-1")
		owning(t, src, tenant, true)
		ids := create(t, src, tenant, 5, NewJob{Type: "noop", Delay: "1h"})
		create(t, src, tenant, 2, NewJob{Type: "sleep", Payload: []byte(`{"ms":300}`)})
		if tenant == "lossy" {
			lost = ids[2]
		}
	}

	m := applyMove(t, st, "steady", "runner-2")
	v, err := rebalancer.VerifyMove(ctx, st, m)
	if err != nil || v.Result != schema.VerifyMatch {
		t.Fatalf("a faithful handoff: %v %+v", err, v)
	}
	if q, _ := v.Target[0].Digest.Part("queue"); q.Items != 5 {
		t.Fatalf("the target's digest covers %d waiting jobs, want 5: %+v", q.Items, v.Target[0].Digest)
	}

	m = applyMove(t, st, "lossy", "runner-2")
	v, err = rebalancer.VerifyMove(ctx, st, m)
	if err != nil || v.Result != schema.VerifyMismatch {
		t.Fatalf("a handoff that lost a job: %v %+v", err, v)
	}
	t.Logf("lost job: %s", v.Detail)
	if held := srcSK.HeldTenants(); len(held) != 1 || held[0].Tenant != "lossy" {
		t.Fatalf("held: %+v", held)
	}
}

// dropEntry deletes job id's queue entry, as a handoff that lost it would.
func dropEntry(ctx context.Context, s *Service, tenant, id string) error {
	for seq := uint64(1); ; {
		m, err := s.jobs.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(anySubject(tenant)))
		if err != nil {
			return err
		}
		var e queueEntry
		if json.Unmarshal(m.Data, &e) == nil && e.ID == id {
			return s.jobs.DeleteMsg(ctx, m.Sequence)
		}
		seq = m.Sequence + 1
	}
}

// BenchmarkQueueDigest is what a runner move's digest costs inside the handoff pause, on each
// side, by the number of jobs waiting in the tenant's queue.
func BenchmarkQueueDigest(b *testing.B) {
	st := openStore(b)
	kc := schema.DefaultKindConfig(Kind)
	kc.Verify = true
	if _, err := st.Kinds().Put(context.Background(), kc); err != nil {
		b.Fatal(err)
	}
	s := startService(b, st, "runner-1", "i1", Config{})
	for _, n := range []int{0, 10, 100} {
		tenant := fmt.Sprintf("t%d", n)
		place(b, st, tenant, "runner-1")
		owning(b, s, tenant, true)
		if n > 0 {
			create(b, s, tenant, n, NewJob{Type: "noop", Delay: "1h"})
		}
		b.Run(fmt.Sprintf("waiting=%d", n), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				d, err := s.queueDigest(context.Background(), tenant, 0)
				if err != nil || d.Items != n {
					b.Fatalf("%v %+v", err, d)
				}
			}
		})
	}
}
