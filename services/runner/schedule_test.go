package runner

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// serveHTTP serves s's routes on a real HTTP server, without shardkit's gate and token.
func serveHTTP(t *testing.T, s *Service) string {
	t.Helper()
	r := chi.NewRouter()
	pass := func(h http.Handler) http.Handler { return h }
	s.Mount(r, pass, pass)
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)
	return srv.URL
}

func postSchedule(t *testing.T, base, tenant, body string) Schedule {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, base+"/schedules", strings.NewReader(body))
	req.Header.Set(tmhttp.HeaderTenant, tenant)
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var sch Schedule
	if err := json.NewDecoder(resp.Body).Decode(&sch); err != nil || resp.StatusCode != http.StatusCreated {
		t.Fatalf("POST /schedules: %d, %v", resp.StatusCode, err)
	}
	return sch
}

// fired waits until the schedule has fired at least n due times, and returns it.
func fired(t *testing.T, s *Service, tenant, id string, n uint64, d time.Duration) Schedule {
	t.Helper()
	var sch Schedule
	waitUntil(t, d, "the schedule to fire", func() bool {
		var err error
		sch, err = s.Schedules().Get(context.Background(), tenant, id)
		return err == nil && sch.Fired >= n
	})
	return sch
}

// passed waits until the schedule's stored due time is in the past, with nobody firing it.
func passed(t *testing.T, s *Service, tenant, id string, by time.Duration) Schedule {
	t.Helper()
	sch, err := s.Schedules().Get(context.Background(), tenant, id)
	if err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 10*time.Second, "the due time to pass", func() bool { return time.Now().After(sch.Next.Add(by)) })
	return sch
}

// checkEveryDueOnce reads the schedule and its jobs and checks that there is exactly one job
// per due time, from the first due time to the last fired, a second apart (no gap, no
// duplicate). A job of a due time after the schedule's Last (being fired now) is left out.
func checkEveryDueOnce(t *testing.T, s *Service, tenant, id string) []Run {
	t.Helper()
	sch, err := s.Schedules().latest(context.Background(), tenant, id)
	if err != nil {
		t.Fatal(err)
	}
	runs, err := s.List(context.Background(), tenant, "", 1000)
	if err != nil {
		t.Fatal(err)
	}
	var mine []Run
	for _, r := range runs {
		if r.Schedule == sch.ID && r.Due != nil && !r.Due.After(*sch.Last) {
			mine = append(mine, r)
		}
	}
	slices.SortFunc(mine, func(a, b Run) int { return a.Due.Compare(*b.Due) })
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

func dues(runs []Run) []string {
	var out []string
	for _, r := range runs {
		out = append(out, r.Due.Format("15:04:05.000"))
	}
	return out
}

// A schedule fires each due time once while its tenant moves from one shard to another: due
// times that pass during the handoff (neither shard acquires the tenant) are fired by the new
// owner at the commit, none twice.
func TestScheduleAcrossMove(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	st := openStore(t)
	const tenant = "acme"
	p := place(t, st, tenant, "runner-1")
	a := startService(t, st, "runner-1", "a", Config{})
	b := startService(t, st, "runner-2", "b", Config{})
	owning(t, a, tenant, true)
	sch := postSchedule(t, serveHTTP(t, a), tenant, `{"id":"tick","cron":"@every 1s","job":{"type":"noop"}}`)
	fired(t, a, tenant, sch.ID, 2, 10*time.Second)

	p = step(t, st, p, func(p *schema.Placement) { p.Phase, p.Target = schema.PhaseWarming, "runner-2" })
	if err := b.Warm(context.Background(), tenant, 0); err != nil {
		t.Fatal(err)
	}
	p = step(t, st, p, func(p *schema.Placement) { p.Phase = schema.PhaseHandoff })
	a.Fence(tenant) // shardkit drains the source at handoff
	owning(t, a, tenant, false)
	atHandoff := passed(t, a, tenant, sch.ID, 1100*time.Millisecond) // two due times pass in the handoff
	p = kittest.Commit(t, st, p, "runner-2")
	owning(t, b, tenant, true)
	step(t, st, p, func(p *schema.Placement) { p.Phase, p.Source = schema.PhaseActive, "" })
	fired(t, b, tenant, sch.ID, atHandoff.Fired+4, 10*time.Second)
	runs := checkEveryDueOnce(t, b, tenant, sch.ID)
	t.Logf("%d due times fired once each across the move: %v", len(runs), dues(runs))
}

// A schedule fires each due time once across an instance that died: one due time's job was
// created by the dying instance, which did not live to advance the schedule, and more due
// times passed while no instance ran. Its successor creates the missed jobs, late, and not the
// one that exists again.
func TestScheduleAcrossKilledInstance(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	st := openStore(t)
	const tenant = "acme"
	place(t, st, tenant, "runner-1")
	a, kill := startStoppable(t, st, "runner-1", "a", Config{})
	owning(t, a, tenant, true)
	sch := postSchedule(t, serveHTTP(t, a), tenant, `{"id":"tick","cron":"@every 1s","job":{"type":"noop"}}`)
	fired(t, a, tenant, sch.ID, 2, 10*time.Second)
	kill() // no drain, no release: the process is gone
	at, err := a.Schedules().latest(context.Background(), tenant, sch.ID)
	if err != nil {
		t.Fatal(err)
	}
	// What the instance did in its last moment: the job of the next due time, not the advance.
	nj := at.Job
	nj.IdempotencyKey, nj.schedule, nj.due = dueKey(at.ID, at.Next), at.ID, at.Next
	if _, created, err := a.Create(context.Background(), tenant, nj); err != nil || !created {
		t.Fatalf("the dying instance's create: created=%v, %v", created, err)
	}
	passed(t, a, tenant, sch.ID, 2100*time.Millisecond) // three due times pass with nobody
	a2 := startService(t, st, "runner-1", "a2", Config{})
	owning(t, a2, tenant, true)
	fired(t, a2, tenant, sch.ID, at.Fired+5, 10*time.Second)
	runs := checkEveryDueOnce(t, a2, tenant, sch.ID)
	t.Logf("%d due times fired once each across the instance's death: %v", len(runs), dues(runs))
}

// A job with delay or run_at waits for its time, on the instance that owns its tenant then.
func TestDelayedJob(t *testing.T) {
	st := openStore(t)
	const tenant = "acme"
	place(t, st, tenant, "runner-1")
	a := startService(t, st, "runner-1", "a", Config{})
	owning(t, a, tenant, true)
	base := serveHTTP(t, a)
	code, r := post(t, base, tenant, `{"type":"noop","delay":"700ms"}`)
	if code != http.StatusAccepted || r.Due == nil || r.NotBefore == nil {
		t.Fatalf("POST /jobs with a delay: %d %+v", code, r)
	}
	if code, _ := post(t, base, tenant, `{"type":"noop","delay":"1s","run_at":"2030-01-01T00:00:00Z"}`); code != http.StatusBadRequest {
		t.Fatalf("delay and run_at together: %d, want 400", code)
	}
	done := waitDone(t, a, tenant, []string{r.ID}, 10*time.Second)[r.ID]
	if done.Status != StatusSucceeded || done.StartedAt.Before(*r.Due) {
		t.Fatalf("run %+v started before it was due at %s", done, r.Due)
	}
}

// The due counts are labelled for the top tenants only, the rest summed as other; the tenant
// view shows a tenant's schedules and due count.
func TestScheduleDueFigures(t *testing.T) {
	st := openStore(t)
	reg := prometheus.NewRegistry()
	// Not running, so nothing but the test changes its scheduler's set.
	idle, err := New(context.Background(), Config{Store: st, ID: schema.InstanceID{Kind: Kind, Shard: "runner-1", Instance: "idle"}, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	past := time.Now().Add(-time.Hour).UTC()
	idle.sched.mu.Lock()
	for i := range dueTopN + 3 {
		m := map[string]*Schedule{}
		for j := range i + 1 {
			id := fmt.Sprintf("s%d", j)
			m[id] = &Schedule{ID: id, Tenant: fmt.Sprintf("t%02d", i), Next: past}
		}
		idle.sched.tenants[fmt.Sprintf("t%02d", i)] = m
	}
	idle.sched.mu.Unlock()
	idle.sched.setDue()
	got := map[string]float64{}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "tm_runner_schedules_due" {
			for _, m := range mf.GetMetric() {
				got[m.GetLabel()[0].GetValue()] = m.GetGauge().GetValue()
			}
		}
	}
	// t12 has 13 due, ... t03 has 4: the top 10; t00..t02 (1+2+3) are other.
	if len(got) != dueTopN+1 || got["t12"] != 13 || got["t03"] != 4 || got["other"] != 6 || got["t02"] != 0 {
		t.Fatalf("tm_runner_schedules_due = %v", got)
	}

	a := startService(t, st, "runner-1", "a", Config{})
	place(t, st, "acme", "runner-1")
	owning(t, a, "acme", true)
	base := serveHTTP(t, a)
	postSchedule(t, base, "acme", `{"id":"nightly","cron":"0 3 * * *","job":{"type":"noop"}}`)
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Get(base + "/admin/runner/tenant?tenant_id=acme")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var ts TenantStats
	if err := json.NewDecoder(resp.Body).Decode(&ts); err != nil || ts.Schedules != 1 || ts.Due != 0 || ts.NextDue == nil || ts.NextDue.Hour() != 3 {
		t.Fatalf("/admin/runner/tenant: %+v, %v", ts, err)
	}
}

// postScheduleVia creates a schedule through shardkit's gate, as a gateway would (epoch header).
func postScheduleVia(t *testing.T, base, tenant string, epoch uint64, body string) Schedule {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, base+"/schedules", strings.NewReader(body))
	req.Header.Set(tmhttp.HeaderTenant, tenant)
	req.Header.Set(tmhttp.HeaderEpoch, strconv.FormatUint(epoch, 10))
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var sch Schedule
	if err := json.NewDecoder(resp.Body).Decode(&sch); err != nil || resp.StatusCode != http.StatusCreated {
		t.Fatalf("POST /schedules through the gate: %d, %v", resp.StatusCode, err)
	}
	return sch
}

// The runner binary, connected as the runner role with least privilege, keeps and fires a
// schedule: its user may create, read (from the stream leader), list and update
// tm_runner_schedules.
func TestBinaryFiresSchedule(t *testing.T) {
	srv := natstest.Server(t)
	nc := natstest.Connect(t, srv.URL())
	ctx := context.Background()
	st, err := schema.Open(ctx, nc, schema.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	const tenant = "acme"
	p := place(t, st, tenant, "runner-1")
	url := binary(t, srv.URL(), "runner-1", "a")
	sch := postScheduleVia(t, url, tenant, p.Epoch, `{"id":"tick","cron":"@every 1s","job":{"type":"noop"}}`)
	kv, err := nc.JetStream()
	if err != nil {
		t.Fatal(err)
	}
	b, err := kv.KeyValue(schema.BucketRunnerSchedules)
	if err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 10*time.Second, "the binary to fire the schedule twice", func() bool {
		e, err := b.Get(tenant + "." + sch.ID)
		var got Schedule
		return err == nil && json.Unmarshal(e.Value(), &got) == nil && got.Fired >= 2
	})
}
