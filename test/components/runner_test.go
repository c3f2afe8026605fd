package components_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/services/runner"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// startRunner runs a runner service of shard's instance on st with cfg (Store and ID set here;
// no sagas unless cfg names some) until the test ends. The caller gives it a shard: hooks is
// how a test changes what the service's hooks do (nil: as they are).
func startRunner(t testing.TB, st *schema.Store, shard, instance string, cfg runner.Config) *runner.Service {
	t.Helper()
	cfg.Store = st
	cfg.ID = schema.InstanceID{Kind: runner.Kind, Shard: shard, Instance: instance}
	if cfg.Sagas == nil {
		cfg.Sagas = []runner.Saga{}
	}
	s, err := runner.New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	runService(t, s.Run)
	return s
}

// serveRunner gives s a shard instance on real HTTP (its routes behind the gate) and returns
// the shard and its URL.
func serveRunner(t testing.TB, st *schema.Store, s *runner.Service, id schema.InstanceID) (*shardkit.Shard, string) {
	t.Helper()
	return serveShard(t, shardkit.Config{Store: st, ID: id, Routes: s.Routes(), Hooks: s.Hooks(), Heartbeat: 100 * time.Millisecond},
		func(r chi.Router, sk *shardkit.Shard) { s.Mount(r, sk.Gate, sk.RequireAdmin) })
}

// owning waits until s has (want) or has not acquired tenant.
func owning(t testing.TB, s *runner.Service, tenant string, want bool) {
	t.Helper()
	tmtest.WaitFor(t, 5*time.Second, tmtest.Until(fmt.Sprintf("owning %s = %v", tenant, want), func() bool {
		return slices.Contains(s.Owned(), tenant) == want
	}))
}

// createJobs enqueues n jobs nj for tenant on s and returns their ids.
func createJobs(t testing.TB, s *runner.Service, tenant string, n int, nj runner.NewJob) []string {
	t.Helper()
	ids := make([]string, n)
	for i := range n {
		r, _, err := s.Create(context.Background(), tenant, nj)
		if err != nil {
			t.Fatal(err)
		}
		ids[i] = r.ID
	}
	return ids
}

// dropQueueEntry deletes job id's entry from tenant's queue in the jobs stream, as a handoff
// that lost it would.
func dropQueueEntry(ctx context.Context, st *schema.Store, tenant, id string) error {
	jobs, err := st.JS().Stream(ctx, schema.StreamJobs)
	if err != nil {
		return err
	}
	for seq := uint64(1); ; {
		m, err := jobs.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(schema.JobSubject(tenant, "any")))
		if err != nil {
			return err
		}
		var e struct {
			ID string `json:"id"`
		}
		if json.Unmarshal(m.Data, &e) == nil && e.ID == id {
			return jobs.DeleteMsg(ctx, m.Sequence)
		}
		seq = m.Sequence + 1
	}
}

// TestVerifyQueueAtTheFence moves two tenants whose queues hold delayed jobs (waiting, never
// claimed) while other jobs run: their digests at the fence match, the jobs in flight left
// out. For the second tenant a job is lost in the handoff (its queue entry vanishes before
// the target looks): the target's queue differs from what the source left, and with verify on
// for the kind the source does not release the tenant.
func TestVerifyQueueAtTheFence(t *testing.T) {
	st, _ := kittest.Store(t)
	ctx := context.Background()
	verifiedKind(t, st, runner.Kind, "")
	src := startRunner(t, st, "runner-1", "i1", runner.Config{})
	dst := startRunner(t, st, "runner-2", "i1", runner.Config{})
	var lost string // the job whose entry the handoff loses
	var once sync.Once
	srcSK := kittest.Shard(t, shardkit.Config{Store: st, ID: schema.InstanceID{Kind: runner.Kind, Shard: "runner-1", Instance: "i1"}, Hooks: src.Hooks()})
	hooks := dst.Hooks()
	warm := hooks.Warm
	hooks.Warm = func(ctx context.Context, tenant string, fence uint64) error {
		if p, err := st.Placements(runner.Kind).Latest(ctx, tenant); err == nil && p.Phase == schema.PhaseHandoff && tenant == "lossy" {
			once.Do(func() {
				// The source reads its digest beside the handoff: lose the job once it has
				// recorded what it saw at the fence, as a target that lost it would.
				tmtest.WaitFor(t, 10*time.Second, tmtest.Until("the source's digest recorded", func() bool {
					recs, err := st.Digests().List(ctx, runner.Kind, tenant, p.Epoch)
					return err == nil && slices.ContainsFunc(recs, func(r schema.DigestRecord) bool { return r.Role == schema.RoleSource })
				}))
				if err := dropQueueEntry(ctx, st, tenant, lost); err != nil {
					t.Errorf("losing job %s: %v", lost, err)
				}
			})
		}
		return warm(ctx, tenant, fence)
	}
	kittest.Shard(t, shardkit.Config{Store: st, ID: schema.InstanceID{Kind: runner.Kind, Shard: "runner-2", Instance: "i1"}, Hooks: hooks})

	for _, tenant := range []string{"steady", "lossy"} {
		if _, err := st.Placements(runner.Kind).Create(ctx, schema.Placement{Tenant: tenant, Shard: "runner-1"}); err != nil {
			t.Fatal(err)
		}
		owning(t, src, tenant, true)
		ids := createJobs(t, src, tenant, 5, runner.NewJob{Type: "noop", Delay: "1h"})
		createJobs(t, src, tenant, 2, runner.NewJob{Type: "sleep", Payload: []byte(`{"ms":300}`)})
		if tenant == "lossy" {
			lost = ids[2]
		}
	}

	m := moveWithEngine(t, st, runner.Kind, "steady", "runner-2", "")
	v, err := rebalancer.VerifyMove(ctx, st, m)
	if err != nil || v.Result != schema.VerifyMatch {
		t.Fatalf("a faithful handoff: %v %+v", err, v)
	}
	if q, _ := v.Target[0].Digest.Part("queue"); q.Items != 5 {
		t.Fatalf("the target's digest covers %d waiting jobs, want 5: %+v", q.Items, v.Target[0].Digest)
	}

	m = moveWithEngine(t, st, runner.Kind, "lossy", "runner-2", "")
	v, err = rebalancer.VerifyMove(ctx, st, m)
	if err != nil || v.Result != schema.VerifyMismatch {
		t.Fatalf("a handoff that lost a job: %v %+v", err, v)
	}
	t.Logf("lost job: %s", v.Detail)
	if held := srcSK.HeldTenants(); len(held) != 1 || held[0].Tenant != "lossy" {
		t.Fatalf("held: %+v", held)
	}
}

// postSchedule creates a schedule through shardkit's gate at base, as a gateway would (epoch
// header).
func postSchedule(t *testing.T, base, tenant string, epoch uint64, body string) runner.Schedule {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, base+"/schedules", strings.NewReader(body))
	req.Header.Set(tmhttp.HeaderTenant, tenant)
	req.Header.Set(tmhttp.HeaderEpoch, strconv.FormatUint(epoch, 10))
	resp, err := tmtest.HTTP.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var sch runner.Schedule
	if err := json.NewDecoder(resp.Body).Decode(&sch); err != nil || resp.StatusCode != http.StatusCreated {
		t.Fatalf("POST /schedules through the gate: %d, %v", resp.StatusCode, err)
	}
	return sch
}

// fired waits until the schedule has fired at least n due times, and returns it.
func fired(t *testing.T, s *runner.Service, tenant, id string, n uint64, d time.Duration) runner.Schedule {
	t.Helper()
	var sch runner.Schedule
	tmtest.WaitFor(t, d, tmtest.Until("the schedule to fire", func() bool {
		var err error
		sch, err = s.Schedules().Get(context.Background(), tenant, id)
		return err == nil && sch.Fired >= n
	}))
	return sch
}

// checkEveryDueOnce reads the schedule and its jobs and checks that there is exactly one job
// per due time, from the first due time to the last fired, a second apart (no gap, no
// duplicate). A job of a due time after the schedule's Last (being fired now) is left out.
func checkEveryDueOnce(t *testing.T, s *runner.Service, tenant, id string) []runner.Run {
	t.Helper()
	sch, err := s.Schedules().Get(context.Background(), tenant, id)
	if err != nil {
		t.Fatal(err)
	}
	runs, err := s.List(context.Background(), tenant, "", 1000)
	if err != nil {
		t.Fatal(err)
	}
	var mine []runner.Run
	for _, r := range runs {
		if r.Schedule == sch.ID && r.Due != nil && !r.Due.After(*sch.Last) {
			mine = append(mine, r)
		}
	}
	slices.SortFunc(mine, func(a, b runner.Run) int { return a.Due.Compare(*b.Due) })
	if uint64(len(mine)) != sch.Fired {
		t.Fatalf("%d jobs of schedule %s, it fired %d due times", len(mine), sch.ID, sch.Fired)
	}
	first := sch.CreatedAt.Truncate(time.Second).Add(time.Second)
	for i, r := range mine {
		if want := first.Add(time.Duration(i) * time.Second); !r.Due.Equal(want) {
			t.Fatalf("job %d of %d is due %s, want %s (a gap or a duplicate); dues: %v", i, len(mine), r.Due, want, dues(mine))
		}
	}
	return mine
}

func dues(runs []runner.Run) []string {
	var out []string
	for _, r := range runs {
		out = append(out, r.Due.Format("15:04:05.000"))
	}
	return out
}

// A schedule fires each due time once while the rebalancer's engine moves its tenant between
// two runner shards through the whole move protocol (shardkit's warm-up, handoff, commit and
// release on both sides).
func TestScheduleAcrossEngineMove(t *testing.T) {
	st, _ := kittest.Store(t)
	const tenant = "acme"
	p, err := st.Placements(runner.Kind).Create(context.Background(), schema.Placement{Tenant: tenant, Shard: "runner-1"})
	if err != nil {
		t.Fatal(err)
	}
	a := startRunner(t, st, "runner-1", "a", runner.Config{})
	b := startRunner(t, st, "runner-2", "b", runner.Config{})
	_, urlA := serveRunner(t, st, a, schema.InstanceID{Kind: runner.Kind, Shard: "runner-1", Instance: "a"})
	serveRunner(t, st, b, schema.InstanceID{Kind: runner.Kind, Shard: "runner-2", Instance: "b"})
	owning(t, a, tenant, true)
	sch := postSchedule(t, urlA, tenant, p.Epoch, `{"id":"tick","cron":"@every 1s","job":{"type":"noop"}}`)
	before := fired(t, a, tenant, sch.ID, 2, 10*time.Second)

	moveWithEngine(t, st, runner.Kind, tenant, "runner-2", "")
	owning(t, b, tenant, true)
	owning(t, a, tenant, false)
	fired(t, b, tenant, sch.ID, before.Fired+3, 10*time.Second)
	runs := checkEveryDueOnce(t, b, tenant, sch.ID)
	t.Logf("%d due times fired once each across the engine's move: %v", len(runs), dues(runs))
}
