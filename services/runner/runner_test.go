package runner

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

func passthrough(h http.Handler) http.Handler { return h }

func serve(t *testing.T, s *Service) *httptest.Server {
	r := chi.NewRouter()
	s.Mount(r, passthrough, passthrough)
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)
	return srv
}

func call(t *testing.T, srv *httptest.Server, method, path, tenant, body string, hdr ...string) (*http.Response, map[string]any) {
	t.Helper()
	req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
	req.Header.Set(tmhttp.HeaderTenant, tenant)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := tmtest.HTTP.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out map[string]any
	_ = json.NewDecoder(resp.Body).Decode(&out)
	return resp, out
}

func TestJobsAPI(t *testing.T) {
	st := openStore(t)
	rc := newReceiver(t)
	place(t, st, "acme", "runner-1")
	s := startService(t, st, "runner-1", "a", Config{})
	srv := serve(t, s)
	owning(t, s, "acme", true)

	for _, tc := range []struct{ body, want string }{
		{`{`, "bad-job"},
		{`{"type":"nope"}`, "bad-job"},
		{`{"type":"log","extra":1}`, "bad-job"},
		{`{"type":"log","instance":"a.b"}`, "bad-job"},
		{`{"type":"log","instance":"ghost"}`, "bad-job"},
	} {
		resp, p := call(t, srv, "POST", "/jobs", "acme", tc.body)
		if resp.StatusCode != 400 || !strings.HasSuffix(fmt.Sprint(p["type"]), tc.want) {
			t.Errorf("POST %s: %d %v, want 400 %s", tc.body, resp.StatusCode, p, tc.want)
		}
	}
	body, _ := json.Marshal(hookJob(rc.URL, map[string]int{"n": 1}))
	resp, p := call(t, srv, "POST", "/jobs", "acme", string(body), "Idempotency-Key", "k1")
	if resp.StatusCode != http.StatusAccepted || p["status"] != "pending" {
		t.Fatalf("create: %d %v", resp.StatusCode, p)
	}
	id := p["id"].(string)
	resp, p = call(t, srv, "POST", "/jobs", "acme", string(body), "Idempotency-Key", "k1")
	if resp.StatusCode != http.StatusOK || p["id"] != id || resp.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replayed create: %d %v", resp.StatusCode, p)
	}
	rc.await(t, 1, 10*time.Second)
	waitDone(t, s, "acme", []string{id}, 10*time.Second)
	resp, p = call(t, srv, "GET", "/jobs/"+id, "acme", "")
	if resp.StatusCode != 200 || p["status"] != "succeeded" || p["attempts"].(float64) != 1 || p["started_at"] == nil || p["finished_at"] == nil {
		t.Fatalf("get: %d %v", resp.StatusCode, p)
	}
	if resp, _ := call(t, srv, "GET", "/jobs/"+id, "other", ""); resp.StatusCode != 404 {
		t.Fatalf("another tenant's job: %d, want 404", resp.StatusCode)
	}
	if resp, _ := call(t, srv, "GET", "/jobs/0123456789abcdef", "acme", ""); resp.StatusCode != 404 {
		t.Fatalf("unknown job: %d, want 404", resp.StatusCode)
	}
	resp, p = call(t, srv, "GET", "/jobs?status=succeeded", "acme", "")
	if jobs := p["jobs"].([]any); resp.StatusCode != 200 || len(jobs) != 1 {
		t.Fatalf("list succeeded: %d %v", resp.StatusCode, p)
	}
	resp, p = call(t, srv, "GET", "/jobs?status=pending", "acme", "")
	if jobs := p["jobs"].([]any); resp.StatusCode != 200 || len(jobs) != 0 {
		t.Fatalf("list pending: %d %v", resp.StatusCode, p)
	}
	if resp, _ := call(t, srv, "GET", "/jobs?status=bogus", "acme", ""); resp.StatusCode != 400 {
		t.Fatalf("bad status filter: %d", resp.StatusCode)
	}
	counts, _ := rc.snapshot()
	if counts["acme.job."+id+".0"] != 1 {
		t.Fatalf("receiver counts %v", counts)
	}
}

// A tenant whose queue is at its cap gets 429 with Retry-After; others are not affected.
func TestQueueCap(t *testing.T) {
	st := openStore(t)
	place(t, st, "busy", "runner-2") // owned by a shard with no instance: nothing runs
	s := startService(t, st, "runner-1", "a", Config{MaxQueued: 5})
	srv := serve(t, s)
	for i := range 5 {
		body := `{"type":"noop"}`
		if i == 0 {
			body = `{"type":"noop","idempotency_key":"first"}`
		}
		if resp, p := call(t, srv, "POST", "/jobs", "busy", body); resp.StatusCode != 202 {
			t.Fatalf("job %d: %d %v", i, resp.StatusCode, p)
		}
	}
	resp, p := call(t, srv, "POST", "/jobs", "busy", `{"type":"noop"}`)
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("over the cap: %d %v, want 429 with Retry-After", resp.StatusCode, p)
	}
	// A key used before answers with its job, full queue or not.
	if resp, p := call(t, srv, "POST", "/jobs", "busy", `{"type":"noop","idempotency_key":"first"}`); resp.StatusCode != http.StatusOK || resp.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("a replay at the cap: %d %v, want 200, replayed", resp.StatusCode, p)
	}
	// A keyed create refused at the cap leaves no run behind: its retry later is a new job.
	if resp, p := call(t, srv, "POST", "/jobs", "busy", `{"type":"noop","idempotency_key":"later"}`); resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("keyed, over the cap: %d %v, want 429", resp.StatusCode, p)
	}
	if r, err := s.Get(context.Background(), "busy", newID("busy", "later")); !errors.Is(err, ErrNoJob) {
		t.Fatalf("the refused keyed job's run: %+v %v, want none", r, err)
	}
	if resp, _ := call(t, srv, "POST", "/jobs", "calm", `{"type":"noop"}`); resp.StatusCode != 202 {
		t.Fatalf("another tenant: %d", resp.StatusCode)
	}
	// Only the owning shard acquires: runner-1 must not have run busy's jobs.
	runs, err := s.List(context.Background(), "busy", StatusPending, 100)
	if err != nil || len(runs) != 5 {
		t.Fatalf("busy's pending jobs: %d %v, want 5", len(runs), err)
	}
}

// Pinned jobs run only on their instance; unpinned ones on any instance of the shard.
func TestPinnedJobs(t *testing.T) {
	st := openStore(t)
	place(t, st, "acme", "runner-1")
	a := startService(t, st, "runner-1", "a", Config{})
	b := startService(t, st, "runner-1", "b", Config{})
	owning(t, a, "acme", true)
	owning(t, b, "acme", true)
	pinned := create(t, a, "acme", 100, NewJob{Type: "sleep", Payload: json.RawMessage(`{"ms":1}`), Instance: "b"})
	free := create(t, a, "acme", 100, NewJob{Type: "sleep", Payload: json.RawMessage(`{"ms":1}`)})
	runs := waitDone(t, a, "acme", append(pinned, free...), 30*time.Second)
	on := map[string]int{}
	for _, id := range pinned {
		if r := runs[id]; r.RanOn != "b" || r.Status != StatusSucceeded {
			t.Fatalf("pinned job %s ran on %q (%s), want b", id, r.RanOn, r.Status)
		}
	}
	for _, id := range free {
		on[runs[id].RanOn]++
	}
	t.Logf("unpinned jobs per instance: %v", on)
}

// The per-instance concurrency cap holds under load.
func TestConcurrencyCap(t *testing.T) {
	st := openStore(t)
	var cur, peak atomic.Int64
	probe := func(ctx context.Context, r Run) (Output, error) {
		n := cur.Add(1)
		for {
			p := peak.Load()
			if n <= p || peak.CompareAndSwap(p, n) {
				break
			}
		}
		defer cur.Add(-1)
		tm := time.NewTimer(3 * time.Millisecond)
		defer tm.Stop()
		select {
		case <-tm.C:
		case <-ctx.Done():
		}
		return Output{}, nil
	}
	const limit = 4
	s := startService(t, st, "runner-1", "a", Config{MaxConcurrent: limit, Handlers: map[string]Handler{"probe": probe}})
	tenants := []string{"t1", "t2", "t3", "t4", "t5", "t6"}
	for _, tn := range tenants {
		place(t, st, tn, "runner-1")
		owning(t, s, tn, true)
	}
	perTenant := 100
	if raceEnabled {
		perTenant = 40
	}
	ids := map[string][]string{}
	for _, tn := range tenants {
		ids[tn] = create(t, s, tn, perTenant, NewJob{Type: "probe"})
	}
	start := time.Now()
	for _, tn := range tenants {
		waitDone(t, s, tn, ids[tn], 60*time.Second)
	}
	el := time.Since(start)
	if p := peak.Load(); p > limit || p < 2 {
		t.Fatalf("peak concurrency %d, want the cap %d (never more)", p, limit)
	}
	n := perTenant * len(tenants)
	t.Logf("MEASURED concurrency cap %d: peak %d running; %d jobs of 3ms in %v (%.0f jobs/s)", limit, peak.Load(), n, el.Round(time.Millisecond), float64(n)/el.Seconds())
}

// The per-instance and per-tenant start rates hold; excess stays queued.
func TestRateLimits(t *testing.T) {
	for _, tc := range []struct {
		name             string
		inst, tenant     int // per minute
		wantInst, wantTn float64
	}{
		{"instance", 1800, 0, 30, 0},
		{"tenant", 0, 1200, 0, 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := openStore(t)
			var mu sync.Mutex
			starts := map[string][]time.Time{}
			stamp := func(_ context.Context, r Run) (Output, error) {
				mu.Lock()
				starts[r.Tenant] = append(starts[r.Tenant], time.Now())
				mu.Unlock()
				return Output{}, nil
			}
			s := startService(t, st, "runner-1", "a", Config{MaxConcurrent: 16, InstanceJobsPerMinute: tc.inst,
				TenantJobsPerMinute: tc.tenant, Handlers: map[string]Handler{"stamp": stamp}})
			ps := map[string]schema.Placement{}
			ids := map[string][]string{}
			for _, tn := range []string{"r1", "r2"} {
				ps[tn] = place(t, st, tn, "runner-9")
				ids[tn] = create(t, s, tn, 60, NewJob{Type: "stamp"})
			}
			t0 := time.Now() // no start before this: the tenants are not ours yet
			for _, tn := range []string{"r1", "r2"} {
				next := ps[tn]
				next.Shard, next.Epoch = "runner-1", next.Epoch+1
				if _, err := st.Placements(next.Kind).Update(context.Background(), ps[tn], next); err != nil {
					t.Fatal(err)
				}
			}
			for _, tn := range []string{"r1", "r2"} {
				waitDone(t, s, tn, ids[tn], 30*time.Second)
			}
			mu.Lock()
			defer mu.Unlock()
			all := append(append([]time.Time{}, starts["r1"]...), starts["r2"]...)
			if tc.wantInst > 0 {
				t.Logf("MEASURED instance rate %.1f jobs/s (cap %d/min = %.0f/s), 2 tenants x 60 jobs", steadyRate(all, int(tc.wantInst)), tc.inst, tc.wantInst)
				atLeastCapped(t, "instance", t0, all, tc.inst)
			}
			if tc.wantTn > 0 {
				t.Logf("MEASURED tenant rates r1 %.1f/s, r2 %.1f/s (cap %d/min = %.0f/s each)", steadyRate(starts["r1"], int(tc.wantTn)), steadyRate(starts["r2"], int(tc.wantTn)), tc.tenant, tc.wantTn)
				for _, tn := range []string{"r1", "r2"} {
					atLeastCapped(t, "tenant "+tn, t0, starts[tn], tc.tenant)
				}
			}
		})
	}
}

// atLeastCapped fails if starts came faster than a cap of perMinute allows. A limiter with a
// burst of one second's worth (B starts) lets the n-th start go no earlier than (n-B) intervals
// after the first could: so the last of n starts, stamped after its limiter admitted it, is at
// least that long after t0, a moment before any could start. A slow machine only makes the
// starts later, so this cannot fail from noise; it fails if the cap lets starts through early.
func atLeastCapped(t *testing.T, what string, t0 time.Time, starts []time.Time, perMinute int) {
	t.Helper()
	interval := time.Minute / time.Duration(perMinute)
	burst := max(perMinute/60, 1)
	last := t0
	for _, x := range starts {
		if x.After(last) {
			last = x
		}
	}
	if least := time.Duration(len(starts)-burst) * interval; last.Sub(t0) < least {
		t.Errorf("%s: %d starts within %v of the first possible one; a cap of %d/min needs at least %v",
			what, len(starts), last.Sub(t0).Round(time.Millisecond), perMinute, least)
	}
}

// steadyRate is the start rate after the burst: starts beyond the burst over the time they took.
func steadyRate(ts []time.Time, burst int) float64 {
	first, last := ts[0], ts[0]
	for _, x := range ts {
		if x.Before(first) {
			first = x
		}
		if x.After(last) {
			last = x
		}
	}
	return float64(len(ts)-burst) / last.Sub(first).Seconds()
}

// One tenant's flood does not starve another tenant on the same shard: while the small
// tenant has work, the two take turns.
func TestFairness(t *testing.T) {
	st := openStore(t)
	var mu sync.Mutex
	var order []string // tenants in the order their jobs started
	tick := func(ctx context.Context, r Run) (Output, error) {
		mu.Lock()
		order = append(order, r.Tenant)
		mu.Unlock()
		tm := time.NewTimer(2 * time.Millisecond)
		defer tm.Stop()
		select {
		case <-tm.C:
		case <-ctx.Done():
		}
		return Output{}, nil
	}
	s := startService(t, st, "runner-1", "a", Config{MaxConcurrent: 2, Handlers: map[string]Handler{"tick": tick}})
	// Both queues fill while another shard owns the tenants, then both move here.
	ps := map[string]schema.Placement{}
	for _, tn := range []string{"flood", "small"} {
		ps[tn] = place(t, st, tn, "runner-9")
	}
	flood := create(t, s, "flood", 1000, NewJob{Type: "tick"})
	small := create(t, s, "small", 20, NewJob{Type: "tick"})
	for _, tn := range []string{"flood", "small"} {
		next := ps[tn]
		next.Shard, next.Epoch = "runner-1", next.Epoch+1
		if _, err := st.Placements(next.Kind).Update(context.Background(), ps[tn], next); err != nil {
			t.Fatal(err)
		}
	}
	start := time.Now()
	waitDone(t, s, "small", small, 30*time.Second)
	el := time.Since(start)
	left, err := s.Depth(context.Background(), "flood")
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	first, last := -1, -1
	for i, tn := range order {
		if tn == "small" {
			if first < 0 {
				first = i
			}
			last = i
		}
	}
	between := last - first + 1 - len(small) // flood starts while small had work
	t.Logf("MEASURED fairness: the small tenant's 20 jobs finished in %v with %d of the flood's %d jobs still queued; "+
		"%d flood jobs started between the small tenant's first and last start (round robin: about 20)", el.Round(time.Millisecond), left, len(flood), between)
	if between > 2*len(small)+4 {
		t.Fatalf("%d flood jobs started while the small tenant waited with work: no turn taking", between)
	}
}

// The webhook retries transient failures with backoff; a 4xx fails the job for good.
func TestWebhookRetries(t *testing.T) {
	st := openStore(t)
	rc := newReceiver(t)
	rc.failFirst = 2
	place(t, st, "acme", "runner-1")
	s := startService(t, st, "runner-1", "a", Config{Effects: map[string]Effect{"webhook": &Webhook{Backoff: 5 * time.Millisecond, Allow: testReceivers}}})
	owning(t, s, "acme", true)
	ids := create(t, s, "acme", 1, hookJob(rc.URL, "x"))
	runs := waitDone(t, s, "acme", ids, 10*time.Second)
	counts, _ := rc.snapshot()
	if r := runs[ids[0]]; r.Status != StatusSucceeded || counts["acme.job."+ids[0]+".0"] != 1 || rc.tries["acme.job."+ids[0]+".0"] != 3 {
		t.Fatalf("run %+v, deliveries %v, tries %v", r, counts, rc.tries)
	}
	bad := newReceiver(t)
	bad.status = http.StatusBadRequest
	ids = create(t, s, "acme", 1, hookJob(bad.URL, "x"))
	runs = waitDone(t, s, "acme", ids, 10*time.Second)
	if r := runs[ids[0]]; r.Status != StatusFailed || r.Attempts != 1 || !strings.Contains(r.Error, "400") {
		t.Fatalf("run against a 400: %+v", r)
	}
}

// A delivery that fails for the whole attempt marks its marker failed; the job's next attempt
// takes the marker over and delivers the effect once.
func TestFailedDeliveryRetriedByTheNextAttempt(t *testing.T) {
	st := openStore(t)
	rc := newReceiver(t)
	rc.failFirst = 2 // the first attempt's two tries fail, the second attempt's first succeeds
	place(t, st, "acme", "runner-1")
	s := startService(t, st, "runner-1", "a", Config{RetryBackoff: 10 * time.Millisecond,
		Effects: map[string]Effect{"webhook": &Webhook{Attempts: 2, Backoff: 5 * time.Millisecond, Allow: testReceivers}}})
	owning(t, s, "acme", true)
	ids := create(t, s, "acme", 1, hookJob(rc.URL, "x"))
	r := waitDone(t, s, "acme", ids, 10*time.Second)[ids[0]]
	key := "acme.job." + ids[0] + ".0"
	counts, _ := rc.snapshot()
	if r.Status != StatusSucceeded || r.Attempts != 2 || counts[key] != 1 {
		t.Fatalf("run %+v, deliveries %v: want succeeded at attempt 2, delivered once", r, counts)
	}
	m, _, err := s.outbox.readMarker(context.Background(), key)
	if err != nil || m.State != markDelivered {
		t.Fatalf("marker %+v %v, want delivered", m, err)
	}
}

// A failing job is retried with backoff up to MaxAttempts.
func TestJobRetries(t *testing.T) {
	st := openStore(t)
	var calls atomic.Int32
	flaky := func(context.Context, Run) (Output, error) {
		if calls.Add(1) < 3 {
			return Output{}, errTest
		}
		return Output{Result: json.RawMessage(`{"ok":true}`)}, nil
	}
	place(t, st, "acme", "runner-1")
	s := startService(t, st, "runner-1", "a", Config{RetryBackoff: 10 * time.Millisecond, Handlers: map[string]Handler{"flaky": flaky}})
	owning(t, s, "acme", true)
	ids := create(t, s, "acme", 1, NewJob{Type: "flaky"})
	runs := waitDone(t, s, "acme", ids, 10*time.Second)
	if r := runs[ids[0]]; r.Status != StatusSucceeded || r.Attempts != 3 || string(r.Result) != `{"ok":true}` {
		t.Fatalf("run %+v", r)
	}
}

// Only the owning shard's instances acquire a tenant's jobs: a tenant placed on another shard
// keeps its jobs queued here, untouched, while this shard's tenant is served.
func TestOnlyOwnerAcquires(t *testing.T) {
	st := openStore(t)
	place(t, st, "theirs", "runner-2")
	place(t, st, "mine", "runner-1")
	s := startService(t, st, "runner-1", "a", Config{})
	owning(t, s, "mine", true)
	theirs := create(t, s, "theirs", 20, NewJob{Type: "noop"})
	mine := create(t, s, "mine", 20, NewJob{Type: "noop"})
	waitDone(t, s, "mine", mine, 10*time.Second)
	for _, id := range theirs {
		r, err := s.Get(context.Background(), "theirs", id)
		if err != nil || r.Status != StatusPending || r.Attempts != 0 {
			t.Fatalf("job of another shard's tenant: %+v %v", r, err)
		}
	}
	for _, o := range s.Owned() {
		if o == "theirs" {
			t.Fatal("runner-1 acquires runner-2's tenant")
		}
	}
}

// The per-tenant rate holds for the shard: two instances split it. Their statuses are written
// every second, so an instance counts its sibling out only after missing it for 4 s (three
// status intervals and a second): the split stays in force through the run even on a loaded
// machine, and a run where it did not is a failure, not a skip.
func TestTenantRateSplitOverInstances(t *testing.T) {
	st := openStore(t)
	var mu sync.Mutex
	var starts []time.Time
	stamp := func(_ context.Context, r Run) (Output, error) {
		mu.Lock()
		starts = append(starts, time.Now())
		mu.Unlock()
		return Output{}, nil
	}
	cfg := Config{TenantJobsPerMinute: 1200, StatusEvery: time.Second, Handlers: map[string]Handler{"stamp": stamp}}
	a := startService(t, st, "runner-1", "a", cfg)
	b := startService(t, st, "runner-1", "b", cfg)
	for _, s := range []*Service{a, b} {
		waitUntil(t, 10*time.Second, "instances counting each other", func() bool {
			s.mu.Lock()
			defer s.mu.Unlock()
			return s.siblings == 2
		})
	}
	resplits := func() int {
		n := 0
		for _, s := range []*Service{a, b} {
			s.mu.Lock()
			n += s.resplits
			s.mu.Unlock()
		}
		return n
	}
	before := resplits()
	p := place(t, st, "r1", "runner-9")
	ids := create(t, a, "r1", 80, NewJob{Type: "stamp"})
	next := p
	next.Shard, next.Epoch = "runner-1", p.Epoch+1
	t0 := time.Now() // no start before this: the tenant is not the shard's yet
	if _, err := st.Placements(next.Kind).Update(context.Background(), p, next); err != nil {
		t.Fatal(err)
	}
	runs := waitDone(t, a, "r1", ids, 30*time.Second)
	mu.Lock()
	defer mu.Unlock()
	on := map[string][]time.Time{}
	for _, r := range runs {
		on[r.RanOn] = append(on[r.RanOn], *r.StartedAt)
	}
	t.Logf("MEASURED tenant rate over 2 instances: %.1f/s (cap 1200/min = 20/s for the shard); starts per instance a=%d b=%d",
		steadyRate(starts, 20), len(on["a"]), len(on["b"]))
	if resplits() != before {
		t.Fatalf("an instance lost sight of its sibling during the run (its status older than 4 s): the split was not in force throughout")
	}
	for _, s := range []*Service{a, b} {
		s.mu.Lock()
		share := s.tenantRate()
		s.mu.Unlock()
		if share != 600 {
			t.Fatalf("instance %s: per-tenant share %d/min, want 1200/2 = 600", s.cfg.ID.Instance, share)
		}
		atLeastCapped(t, "instance "+s.cfg.ID.Instance, t0, on[s.cfg.ID.Instance], share)
	}
}
