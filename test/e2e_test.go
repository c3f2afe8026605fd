package test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/test/history"
)

// e2eMoves is how many tenant moves (each across all three kinds) TestMovesUnderLoad applies:
// a few in CI, TM_E2E_MOVES=1000 for `make e2e`.
func e2eMoves() int {
	if n, err := strconv.Atoi(os.Getenv("TM_E2E_MOVES")); err == nil && n > 0 {
		return n
	}
	return 6
}

// load drives one tenant's traffic through the gateway and records what was acknowledged.
type load struct {
	gw       string
	hc       *http.Client
	receiver string

	mu        sync.Mutex
	failures  []string
	deposits  map[string]int64  // tenant -> acknowledged deposit total
	jobs      map[string]string // job id -> tenant
	requests  atomic.Int64
	commandsN atomic.Int64
	samples   []sample // every request's latency, for latencyAround
}

// sample is one request's start and latency.
type sample struct {
	tenant, what string // what: method and path
	at           time.Time
	took         time.Duration
}

// window is the time a move of tenant was in flight (plan applied to plan done).
type window struct {
	tenant     string
	start, end time.Time
}

// moveWindow runs fn (moves of tenant) and returns its window.
func moveWindow(tenant string, fn func()) window {
	w := window{tenant: tenant, start: time.Now()}
	fn()
	w.end = time.Now()
	return w
}

// latencyAround splits the moved tenants' request latencies into those that started while one
// of the tenant's moves was in flight and the rest: what a client feels from a move.
func (l *load) latencyAround(ws []window) (in, out []time.Duration) {
	byTenant := map[string][]window{}
	for _, w := range ws {
		byTenant[w.tenant] = append(byTenant[w.tenant], w)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, s := range l.samples {
		tw, moved := byTenant[s.tenant]
		if !moved {
			continue
		}
		during := slices.ContainsFunc(tw, func(w window) bool { return !s.at.Before(w.start) && s.at.Before(w.end) })
		if during {
			in = append(in, s.took)
		} else {
			out = append(out, s.took)
		}
	}
	return in, out
}

// byRequest is the requests' latency by method and path (p50, p99, max, count), the paths in
// order: which requests a client waits on.
func (l *load) byRequest() string {
	l.mu.Lock()
	by := map[string][]time.Duration{}
	for _, s := range l.samples {
		by[s.what] = append(by[s.what], s.took)
	}
	l.mu.Unlock()
	var b strings.Builder
	for _, what := range slices.Sorted(maps.Keys(by)) {
		d := by[what]
		fmt.Fprintf(&b, "\n    | %s | %s | %s | %s | %d |", what, pct(d, 0.5), pct(d, 0.99), pct(d, 1), len(d))
	}
	return "\n    | request | p50 | p99 | max | count |\n    |---|---:|---:|---:|---:|" + b.String()
}

// pathShape is path with its ids (segments of 16 or more hex digits) as {id}, and without its
// query: one row of byRequest per kind of request.
func pathShape(path string) string {
	path, _, _ = strings.Cut(path, "?")
	segs := strings.Split(path, "/")
	for i, seg := range segs {
		if len(seg) >= 16 && strings.Trim(seg, "0123456789abcdef") == "" {
			segs[i] = "{id}"
		}
	}
	return strings.Join(segs, "/")
}

func (l *load) do(tenant, method, path string, body any) (int, []byte) {
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, _ := http.NewRequest(method, l.gw+path, rd)
	req.Header.Set("x-tenant-id", tenant)
	req.Header.Set("content-type", "application/json")
	l.requests.Add(1)
	start := time.Now()
	resp, err := l.hc.Do(req)
	defer func() {
		l.mu.Lock()
		l.samples = append(l.samples, sample{tenant: tenant, what: method + " " + pathShape(path), at: start, took: time.Since(start)})
		l.mu.Unlock()
	}()
	if err != nil {
		l.fail(fmt.Sprintf("%s %s %s: %v", tenant, method, path, err))
		return 0, nil
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode >= 300 {
		l.fail(fmt.Sprintf("%s %s %s: %d %s", tenant, method, path, resp.StatusCode, bytes.TrimSpace(b)))
	}
	return resp.StatusCode, b
}

// call is l.do as a history.Caller: the gateway routes by path, so the kind is not needed.
func (l *load) call(tenant, _, method, path string, body any) (int, []byte) {
	return l.do(tenant, method, path, body)
}

func (l *load) fail(s string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.failures = append(l.failures, s)
}

// thinkTime is the clients' think time between iterations: 0 (one after another, the
// machine's cores busy throughout), or TM_E2E_THINK (a duration), for the pause at a lighter
// load (docs/benchmarks.md).
func thinkTime() time.Duration {
	d, _ := time.ParseDuration(os.Getenv("TM_E2E_THINK"))
	return d
}

// think waits d (if any) unless stop closes first; it reports whether to go on.
func think(d time.Duration, stop <-chan struct{}) bool {
	if d <= 0 {
		return true
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-stop:
		return false
	case <-t.C:
		return true
	}
}

// run sends commands, queries and jobs for tenant until stop is closed, with thinkTime between
// iterations.
func (l *load) run(tenant string, stop <-chan struct{}) {
	pause := thinkTime()
	l.do(tenant, "POST", "/commands", map[string]any{"aggregate_type": "account", "aggregate_id": "load",
		"command": "open", "idempotency_key": "load-open"})
	for i := 0; ; i++ {
		select {
		case <-stop:
			return
		default:
		}
		if i > 0 && !think(pause, stop) { // the first at once: it places the tenant in every kind
			return
		}
		amount := int64(i%7 + 1)
		code, _ := l.do(tenant, "POST", "/commands", map[string]any{"aggregate_type": "account", "aggregate_id": "load",
			"command": "deposit", "payload": map[string]int64{"amount": amount}, "idempotency_key": fmt.Sprintf("dep-%d", i)})
		if code == http.StatusCreated || code == http.StatusOK {
			l.commandsN.Add(1)
			l.mu.Lock()
			l.deposits[tenant] += amount
			l.mu.Unlock()
		}
		if i%4 == 0 {
			l.do(tenant, "POST", "/query/accounts", map[string]any{"limit": 5})
		}
		if i%5 == 0 {
			code, b := l.do(tenant, "POST", "/jobs", map[string]any{"type": "webhook", "idempotency_key": fmt.Sprintf("job-%d", i),
				"payload": map[string]any{"url": l.receiver, "body": map[string]any{"tenant": tenant, "n": i}}})
			var run struct{ ID string }
			if code < 300 && json.Unmarshal(b, &run) == nil && run.ID != "" {
				l.mu.Lock()
				l.jobs[run.ID] = tenant
				l.mu.Unlock()
			}
		}
	}
}

// loadTenants are the tenants underLoad drives.
var loadTenants = []string{"acme", "globex", "initech", "umbrella", "hooli", "stark"}

// underLoad opens a store on the stack's NATS and starts load.run for every tenant of
// loadTenants through its gateway, with rcv as the jobs' webhook receiver; stop ends the load
// and waits for it. Everything else it started ends with the test.
func underLoad(t testing.TB, s *stack) (st *schema.Store, l *load, rcv *history.Receiver, stop func()) {
	t.Helper()
	rcv = history.NewReceiver()
	hook := httptest.NewServer(rcv)
	t.Cleanup(hook.Close)
	nc, err := nats.Connect(s.natsURL, nats.UserCredentials(s.natsCreds))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	if st, err = schema.Open(context.Background(), nc, schema.Options{}); err != nil {
		t.Fatal(err)
	}
	l = &load{gw: s.gateway, hc: &http.Client{Timeout: 15 * time.Second}, receiver: hook.URL,
		deposits: map[string]int64{}, jobs: map[string]string{}}
	done := make(chan struct{})
	var wg sync.WaitGroup
	for _, tenant := range loadTenants {
		wg.Go(func() { l.run(tenant, done) })
	}
	var once sync.Once
	stop = func() { once.Do(func() { close(done); wg.Wait() }) }
	t.Cleanup(stop)
	return st, l, rcv, stop
}

// TestMovesUnderLoad moves tenants across shards of all three kinds, through the rebalancer
// service, while clients send commands, queries and jobs through the gateway: no request may
// fail, no acknowledged command may be lost or applied twice, every job's effect must be
// delivered exactly once, the views must converge to the ledger, and every move's target state
// at the fence must equal its source's (move verification, on for every kind).
func TestMovesUnderLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("the whole platform under load")
	}
	s := startStack(t)
	enableVerify(t, s.rebalancer)
	st, l, rcv, stopLoad := underLoad(t, s)
	// One gRPC client beside the HTTP ones: acme's deposits as SubmitCommand calls and a Watch
	// stream of its views, which must resume at the new owner after each of acme's moves.
	gl, err := newGRPCLoad("acme", []string{s.gateway}, false, func(tenant string, amount int64) {
		l.mu.Lock()
		l.deposits[tenant] += amount
		l.mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	defer gl.close()
	grpcStop := make(chan struct{})
	grpcDone := make(chan struct{})
	go func() { defer close(grpcDone); gl.run(grpcStop) }()
	stopLoad = func(stop func()) func() {
		var once sync.Once
		return func() { once.Do(func() { close(grpcStop); <-grpcDone; stop() }) }
	}(stopLoad)

	// Moves: each tenant in turn goes to the other shard of every kind, through the API, with
	// a KV round trip measured beside them.
	probeStop := make(chan struct{})
	probe := startKVProbe(t, st, 50*time.Millisecond, probeStop)
	moves, pauses, timed := e2eMoves(), []time.Duration{}, []movePause{}
	var windows []window
	start := time.Now()
	for i := range moves {
		tenant := loadTenants[i%len(loadTenants)]
		windows = append(windows, moveWindow(tenant, func() {
			for _, m := range moveAcrossKinds(t, st, s.rebalancer, tenant) {
				pauses, timed = append(pauses, m.pause), append(timed, m)
			}
		}))
	}
	elapsed := time.Since(start)
	close(probeStop)
	rtts := probe.wait()
	stopLoad()
	in, out := l.latencyAround(windows)

	if len(l.failures) > 0 {
		t.Errorf("%d of %d requests failed during %d moves:\n%s", len(l.failures), l.requests.Load(), moves, strings.Join(first(l.failures, 20), "\n"))
	}
	if f := gl.failed(); len(f) > 0 {
		t.Errorf("%d of %d gRPC calls failed during %d moves:\n%s", len(f), gl.calls.Load(), moves, strings.Join(first(f, 20), "\n"))
	}
	if gl.resumed.Load() == 0 || gl.messages.Load() == 0 {
		t.Errorf("acme's Watch stream got %d messages and was resumed %d times over its moves", gl.messages.Load(), gl.resumed.Load())
	}
	t.Logf("gRPC: %d unary calls, a Watch stream with %d messages, resumed %d times", gl.calls.Load(), gl.messages.Load(), gl.resumed.Load())
	// The ledger: every acknowledged deposit once (the demo tenants had 1000 before).
	for _, tenant := range loadTenants {
		var tot struct{ Deposits, Withdrawals, Balances int64 }
		_, b := l.do(tenant, "GET", "/ledger/totals", nil)
		if err := json.Unmarshal(b, &tot); err != nil {
			t.Fatalf("totals of %s: %v %s", tenant, err, b)
		}
		want := l.deposits[tenant]
		if tenant == "acme" || tenant == "globex" || tenant == "initech" {
			want += 1000
		}
		if tot.Deposits != want || tot.Deposits-tot.Withdrawals != tot.Balances {
			t.Errorf("%s: ledger %+v, acknowledged deposits %d", tenant, tot, want)
		}
		// The projection converges to the ledger.
		history.AwaitView(t, l.call, tenant, tot.Balances)
	}
	// Every job ran, and each effect reached the receiver exactly once.
	history.AwaitJobs(t, l.call, l.jobs)
	rcv.CheckOnce(t, len(l.jobs))
	t.Logf("%d moves (x3 kinds) in %s under load: %d requests, %d commands, %d jobs, %d failed; handoff pause p50 %s p99 %s max %s; "+
		"moved tenants' requests during a move p50 %s p99 %s (%d), outside p50 %s p99 %s (%d)",
		moves, elapsed.Round(time.Millisecond), l.requests.Load(), l.commandsN.Load(), len(l.jobs), len(l.failures),
		pct(pauses, 0.5), pct(pauses, 0.99), pct(pauses, 1),
		pct(in, 0.5), pct(in, 0.99), len(in), pct(out, 0.5), pct(out, 0.99), len(out))
	t.Logf("requests by kind (the ledger and view checks after the run included):%s", l.byRequest())
	t.Logf("handoff pause by quarter of the run (does it grow as the run goes on?):%s", probe.byQuarter(timed))
	t.Logf("where the pause goes (each step from the one before, by the shards' stamps):%s", pauseReport(t, timed, rtts, s.gateway+"/metrics"))
	t.Logf("state digests at the fence (move verification): %s", digestSummary())
	s.stop(t)
}

func first(s []string, n int) []string { return s[:min(n, len(s))] }

// moveAcross moves tenant to the other shard of every kind through the rebalancer API at base
// and returns the handoff pauses of its kind moves.
func moveAcross(t testing.TB, st *schema.Store, base, tenant string) []time.Duration {
	t.Helper()
	var out []time.Duration
	for _, m := range moveAcrossKinds(t, st, base, tenant) {
		out = append(out, m.pause)
	}
	return out
}

// moveAcrossKinds is moveAcross with each pause's kind.
func moveAcrossKinds(t testing.TB, st *schema.Store, base, tenant string) []movePause {
	t.Helper()
	targets := map[string]string{}
	for _, kind := range []string{"aggregate", "projection", "runner"} {
		p, err := st.Placements(kind).Get(context.Background(), tenant)
		if err != nil {
			t.Fatalf("placement of %s/%s: %v", kind, tenant, err)
		}
		targets[kind] = kind + "-1"
		if p.Shard == kind+"-1" {
			targets[kind] = kind + "-2"
		}
	}
	id := createPlan(t, postOK, base, map[string]any{"strategy": "move-tenant", "tenant": tenant, "targets": targets})
	postOK(t, base+"/api/plans/"+id+"/apply", nil)
	pauses := awaitPlanMoves(t, base, id)
	requireVerified(t, base, id)
	return pauses
}

// movePause is one finished move's pause: from its handoff to its commit, and the steps its
// shards stamped between them.
type movePause struct {
	kind            string
	pause           time.Duration
	handoff, commit time.Time
	steps           *schema.HandoffSteps
}

// createPlan creates a plan through the rebalancer API with post (postOK, or postRetry under
// chaos) and returns its id.
func createPlan(t testing.TB, post func(testing.TB, string, any) []byte, base string, req map[string]any) string {
	t.Helper()
	var out struct {
		Plan struct{ ID string } `json:"plan"`
	}
	if err := json.Unmarshal(post(t, base+"/api/plans", req), &out); err != nil || out.Plan.ID == "" {
		t.Fatalf("create plan: %v", err)
	}
	return out.Plan.ID
}

// stackAdminToken is the dev stack's admin token (startStack passes it as --admin-token).
const stackAdminToken = "dev-admin-token"

// postAdmin POSTs body as JSON to the rebalancer API at url with the stack's admin token.
// adminClient bounds every call the tests make to the stack's control, rebalancer and metrics
// APIs.
var adminClient = &http.Client{Timeout: 30 * time.Second}

func postAdmin(url string, body any) (*http.Response, error) {
	b, _ := json.Marshal(body)
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(b))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+stackAdminToken)
	return adminClient.Do(req)
}

func postOK(t testing.TB, url string, body any) []byte {
	t.Helper()
	resp, err := postAdmin(url, body)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	if resp.StatusCode >= 300 {
		t.Fatalf("POST %s: %d %s", url, resp.StatusCode, out)
	}
	return out
}

// awaitPlanMoves waits until the plan finishes, requires every move done, and returns their pauses.
func awaitPlanMoves(t testing.TB, base, id string) []movePause {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		resp, err := adminClient.Get(base + "/api/plans/" + id)
		if err == nil {
			var p struct {
				Plan  struct{ Status string } `json:"plan"`
				Moves []struct {
					ID, Kind, State, Reason string
					Handoff, Commit         time.Time
					Steps                   *schema.HandoffSteps
				} `json:"moves"`
			}
			_ = json.NewDecoder(resp.Body).Decode(&p)
			resp.Body.Close()
			switch p.Plan.Status {
			case "done":
				var out []movePause
				for _, m := range p.Moves {
					out = append(out, movePause{m.Kind, m.Commit.Sub(m.Handoff), m.Handoff, m.Commit, m.Steps})
				}
				return out
			case "partial", "rolled_back":
				t.Fatalf("plan %s ended %s: %+v", id, p.Plan.Status, p.Moves)
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("plan %s not finished within 2 minutes", id)
		}
		time.Sleep(50 * time.Millisecond) // polling the service's plan state
	}
}

func pct(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[int(float64(len(s)-1)*p)]
}
