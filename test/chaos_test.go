package test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/test/history"
)

// histAccounts are the accounts of the chaos test's history (the load's own is "load").
var histAccounts = []string{"hx", "hy"}

// chaosLong reports whether TM_CHAOS_LONG=1 asks for the long version (more moves, longer
// load phases).
func chaosLong() bool { return os.Getenv("TM_CHAOS_LONG") == "1" }

// devState is what devstack --state-file holds (and its control API's GET /state answers).
type devState struct {
	Control string `json:"control"`
	NATS    []struct {
		Name, URL       string
		Running, Leader bool
	} `json:"nats"`
	Children map[string]struct {
		PID      int    `json:"pid"`
		URL      string `json:"url"`
		Running  bool   `json:"running"`
		Restarts int    `json:"restarts"`
	} `json:"children"`
}

func readState(t *testing.T, control string) devState {
	t.Helper()
	resp, err := adminClient.Get(control + "/state")
	if err != nil {
		t.Fatalf("control API: %v", err)
	}
	defer resp.Body.Close()
	var st devState
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatalf("control API state: %v", err)
	}
	return st
}

// chaosLoad is load.run's traffic spread over several gateways, by a client that retries
// only what docs/design.md allows: a 503 with Retry-After (the same request again, with the same
// idempotency key) and a connection error to a gateway (the same request on another gateway).
type chaosLoad struct {
	gws      []string
	hc       *http.Client
	receiver string

	mu        sync.Mutex
	failures  []string
	deposits  map[string]int64  // tenant -> acknowledged deposit total
	jobs      map[string]string // job id -> tenant
	requests  atomic.Int64
	allowed   atomic.Int64 // 503s with Retry-After, retried
	failovers atomic.Int64 // connection errors to a gateway, retried on another
	inDoubt   atomic.Int64 // 502s naming an instance the test killed, retried (keyed requests: a failure)
	killed    []string     // instance keys (kind.shard.instance) the test killed
}

// killedUpstream reports whether a 502 body names an instance the test killed: the request
// reached it and it died, so the gateway could not replay it (docs/design.md, the request path);
// the command may or may not have been applied, and the client retries it with the same
// idempotency key.
func (l *chaosLoad) killedUpstream(body []byte) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, k := range l.killed {
		if bytes.Contains(body, []byte("("+k+")")) {
			return true
		}
	}
	return false
}

// do sends one request, retrying as allowed for up to 45 s; it returns the final status
// (0: never answered) and body, and records a failure for anything but a 2xx.
func (l *chaosLoad) do(gw *int, tenant, method, path string, body any) (int, []byte) {
	var raw []byte
	var key string // commands and jobs carry their key in the header too: the gateway may replay them
	if body != nil {
		raw, _ = json.Marshal(body)
		if m, ok := body.(map[string]any); ok {
			key, _ = m["idempotency_key"].(string)
		}
	}
	l.requests.Add(1)
	deadline := time.Now().Add(45 * time.Second)
	var last string
	for attempt := 0; time.Now().Before(deadline) && attempt < 500; attempt++ {
		req, _ := http.NewRequest(method, l.gws[*gw%len(l.gws)]+path, bytes.NewReader(raw))
		req.Header.Set("x-tenant-id", tenant)
		req.Header.Set("content-type", "application/json")
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := l.hc.Do(req)
		if err != nil {
			l.failovers.Add(1)
			last = err.Error()
			*gw++
			time.Sleep(50 * time.Millisecond) // back off before the other gateway
			continue
		}
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
		if resp.StatusCode == http.StatusServiceUnavailable && resp.Header.Get("Retry-After") != "" {
			l.allowed.Add(1)
			last = fmt.Sprintf("503 %s", bytes.TrimSpace(b))
			wait, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
			time.Sleep(min(time.Duration(wait)*time.Second, time.Second)) // the server asked for it
			continue
		}
		if resp.StatusCode == http.StatusBadGateway && l.killedUpstream(b) {
			if key != "" && method == http.MethodPost { // aggregate commands and runner jobs are Idempotent kinds
				l.fail(fmt.Sprintf("%s %s %s: a keyed request answered 502 in doubt; the gateway replays those: %s", tenant, method, path, bytes.TrimSpace(b)))
			}
			l.inDoubt.Add(1)
			last = fmt.Sprintf("502 %s", bytes.TrimSpace(b))
			continue
		}
		if resp.StatusCode >= 300 {
			l.fail(fmt.Sprintf("%s %s %s: %d %s", tenant, method, path, resp.StatusCode, bytes.TrimSpace(b)))
		}
		return resp.StatusCode, b
	}
	l.fail(fmt.Sprintf("%s %s %s: no answer within the retry budget: %s", tenant, method, path, last))
	return 0, nil
}

func (l *chaosLoad) fail(s string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.failures = append(l.failures, time.Now().Format("15:04:05.000 ")+s)
}

// run sends commands, queries and jobs for tenant until stop is closed, starting on gateway gw.
func (l *chaosLoad) run(tenant string, gw int, stop <-chan struct{}) {
	l.do(&gw, tenant, "POST", "/commands", map[string]any{"aggregate_type": "account", "aggregate_id": "load",
		"command": "open", "idempotency_key": "load-open"})
	for i := 0; i < 1_000_000; i++ {
		select {
		case <-stop:
			return
		default:
		}
		amount := int64(i%7 + 1)
		code, _ := l.do(&gw, tenant, "POST", "/commands", map[string]any{"aggregate_type": "account", "aggregate_id": "load",
			"command": "deposit", "payload": map[string]int64{"amount": amount}, "idempotency_key": fmt.Sprintf("dep-%d", i)})
		if code == http.StatusCreated || code == http.StatusOK {
			l.mu.Lock()
			l.deposits[tenant] += amount
			l.mu.Unlock()
		}
		if i%4 == 0 {
			l.do(&gw, tenant, "POST", "/query/accounts", map[string]any{"limit": 5})
		}
		if i%5 == 0 {
			code, b := l.do(&gw, tenant, "POST", "/jobs", map[string]any{"type": "webhook", "idempotency_key": fmt.Sprintf("job-%d", i),
				"payload": map[string]any{"url": l.receiver, "body": map[string]any{"tenant": tenant, "n": i}}})
			var run struct{ ID string }
			if code < 300 && json.Unmarshal(b, &run) == nil && run.ID != "" {
				l.mu.Lock()
				l.jobs[run.ID] = tenant
				l.mu.Unlock()
			}
		}
		time.Sleep(5 * time.Millisecond) // pace the load so the 2-core CI machine keeps up
	}
}

// awaitOK polls url until it answers 200, and returns how long that took from since.
func awaitOK(t *testing.T, url string, since time.Time, within time.Duration) time.Duration {
	t.Helper()
	hc := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(within)
	for {
		resp, err := hc.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return time.Since(since)
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not ready within %s", url, within)
		}
		time.Sleep(50 * time.Millisecond) // polling another process's readiness
	}
}

// awaitRestart waits until the supervisor restarted child (restarts above before) and the new
// process is ready, and returns the time since the kill.
func awaitRestart(t *testing.T, control, child string, before int, killed time.Time) time.Duration {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		c := readState(t, control).Children[child]
		if c.Restarts > before && c.Running {
			return awaitOK(t, c.URL, killed, time.Until(deadline))
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not restarted within 60s", child)
		}
		time.Sleep(50 * time.Millisecond) // polling the supervisor's state
	}
}

func kill9(t *testing.T, control, child string) (restarts int, at time.Time) {
	t.Helper()
	c := readState(t, control).Children[child]
	if c.PID <= 0 || !c.Running {
		t.Fatalf("%s is not running: %+v", child, c)
	}
	if err := syscall.Kill(c.PID, syscall.SIGKILL); err != nil {
		t.Fatalf("kill -9 %s (%d): %v", child, c.PID, err)
	}
	t.Logf("%s: kill -9 %s (pid %d)", time.Now().Format("15:04:05.000"), child, c.PID)
	return c.Restarts, time.Now()
}

// planMove is one move of a plan as the rebalancer's API reports it.
type planMove struct {
	Kind, State, Reason                string
	Started, Handoff, Commit, Finished time.Time
}

// readPlan reads a plan's status and its moves.
func readPlan(base, id string) (string, []planMove, error) {
	resp, err := adminClient.Get(base + "/api/plans/" + id)
	if err != nil {
		return "", nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return "", nil, fmt.Errorf("GET plan %s: %s: %s", id, resp.Status, b)
	}
	var p struct {
		Plan  struct{ Status string } `json:"plan"`
		Moves []planMove              `json:"moves"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&p); err != nil {
		return "", nil, err
	}
	return p.Plan.Status, p.Moves, nil
}

// planStatus reads a plan's status and its moves' states.
func planStatus(base, id string) (string, []string, error) {
	status, moves, err := readPlan(base, id)
	var states []string
	for _, m := range moves {
		states = append(states, m.State)
	}
	return status, states, err
}

// firstFinished is when the first of moves finished, after since (0 if none did).
func firstFinished(moves []planMove, since time.Time) time.Duration {
	var first time.Duration
	for _, m := range moves {
		if d := m.Finished.Sub(since); !m.Finished.IsZero() && (first == 0 || d < first) {
			first = d
		}
	}
	return first
}

// planTimeline describes each move: kind, state, reason, and when it started, reached handoff,
// committed and finished, relative to since.
func planTimeline(moves []planMove, since time.Time) string {
	at := func(ts time.Time) string {
		if ts.IsZero() {
			return "-"
		}
		return ts.Sub(since).Round(time.Millisecond).String()
	}
	var out []string
	for _, m := range moves {
		out = append(out, fmt.Sprintf("%s %s (started %s, handoff %s, commit %s, finished %s) %s",
			m.Kind, m.State, at(m.Started), at(m.Handoff), at(m.Commit), at(m.Finished), m.Reason))
	}
	return strings.Join(out, "; ")
}

// postRetry posts body to url, retrying what a client may retry a few times: a 503 with
// Retry-After (NATS electing a leader), a 502 or 504, or a connection error (the rebalancer
// restarting). A 500, or a 404 for a plan just created, fails: the API reads plans from the
// stream leader and maps NATS's transient failures to 503.
func postRetry(t testing.TB, url string, body any) []byte {
	t.Helper()
	var last string
	for range 20 {
		resp, err := postAdmin(url, body)
		if err == nil {
			out, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode < 300 {
				return out
			}
			retryable := resp.StatusCode == http.StatusBadGateway || resp.StatusCode == http.StatusGatewayTimeout ||
				resp.StatusCode == http.StatusServiceUnavailable && resp.Header.Get("Retry-After") != ""
			if !retryable {
				t.Fatalf("POST %s: %d %s", url, resp.StatusCode, out)
			}
			last = fmt.Sprintf("%d %s", resp.StatusCode, out)
		} else {
			last = err.Error()
		}
		t.Logf("POST %s: %s; retrying", url, last)
		time.Sleep(250 * time.Millisecond) // an operator's retry
	}
	t.Fatalf("POST %s: %s", url, last)
	return nil
}

// awaitSettled waits until a plan finishes and requires it consistent: done, or partial with
// every move done or aborted (an abort puts the tenant back on its source: docs/design.md, moving
// a tenant). It returns how many moves were aborted.
func awaitSettled(t *testing.T, base, id string) int {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		status, states, err := planStatus(base, id)
		if err == nil && (status == "done" || status == "partial") {
			aborted := 0
			for _, st := range states {
				switch st {
				case "done":
				case "aborted":
					aborted++
				default:
					t.Fatalf("plan %s ended %s with a move %s: %v", id, status, st, states)
				}
			}
			requireNoMismatch(t, base, id)
			return aborted
		}
		if err == nil && status == "rolled_back" {
			t.Fatalf("plan %s rolled back: %v", id, states)
		}
		if time.Now().After(deadline) {
			t.Fatalf("plan %s not finished within 2 minutes (%s %v %v)", id, status, states, err)
		}
		time.Sleep(50 * time.Millisecond) // polling the service's plan state
	}
}

// TestChaosUnderLoad runs the load of TestMovesUnderLoad over two gateways of a stack with two
// instances per shard and a 3-node NATS cluster, and meanwhile, with moves running, kills -9 a
// shard instance, a gateway, the rebalancer during an apply, and stops the NATS meta leader.
// The client retries only what docs/design.md allows (503 with Retry-After; another gateway when
// one is unreachable); every other error fails. Afterwards the ledger equals the acknowledged
// deposits, the history of a ledger workload beside it is linearizable (test/history), every
// job's effect arrived exactly once, the views converge, and every placement has one owner.
func TestChaosUnderLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("the whole platform under load, with failures")
	}
	rcv := history.NewReceiver()
	hook := httptest.NewServer(rcv)
	defer hook.Close()
	stateFile := filepath.Join(t.TempDir(), "state.json")
	s := startStack(t, "--instances", "2", "--gateways", "2", "--nats-cluster", "--keep-going",
		"--restart-delay", "500ms", "--lease-ttl", "3s", "--state-file", stateFile, "--control-addr", "127.0.0.1:0")
	var st0 devState
	if b, err := os.ReadFile(stateFile); err != nil || json.Unmarshal(b, &st0) != nil || st0.Control == "" {
		t.Fatalf("state file %s: %v %s", stateFile, err, b)
	}
	control := st0.Control
	var natsURLs []string
	for _, n := range st0.NATS {
		natsURLs = append(natsURLs, n.URL)
	}
	if len(natsURLs) != 3 {
		t.Fatalf("want 3 NATS nodes, state has %+v", st0.NATS)
	}
	gws := []string{s.gateway, strings.TrimSuffix(st0.Children["gateway-2"].URL, "/readyz")}

	nc, err := nats.Connect(strings.Join(natsURLs, ","), nats.UserCredentials(s.natsCreds), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	ctx := context.Background()
	octx, cancel := context.WithTimeout(ctx, 30*time.Second)
	store, err := schema.OpenRetry(octx, nc, schema.Options{Replicas: 3})
	cancel()
	if err != nil {
		t.Fatal(err)
	}

	l := &chaosLoad{gws: gws, hc: &http.Client{Timeout: 20 * time.Second}, receiver: hook.URL,
		deposits: map[string]int64{}, jobs: map[string]string{}}
	tenants := []string{"acme", "globex", "initech", "umbrella", "hooli", "stark"}
	// The ledger before the load (the demo tenants were seeded by devstack, if that worked).
	baseline := map[string]int64{}
	for _, tenant := range tenants {
		gw := 0
		var tot struct{ Deposits int64 }
		if code, b := l.do(&gw, tenant, "GET", "/ledger/totals", nil); code == http.StatusOK {
			if err := json.Unmarshal(b, &tot); err != nil {
				t.Fatalf("totals of %s: %v %s", tenant, err, b)
			}
		}
		baseline[tenant] = tot.Deposits
	}
	l.failures = nil // an unplaced tenant's ledger may answer 404 before its first command
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for i, tenant := range tenants {
		wg.Go(func() { l.run(tenant, i, stop) })
	}
	// The project's history checker beside it (test/history): deposits, withdrawals and reads
	// on two accounts of two tenants, checked for linearizability at the end.
	hist := &history.Client{Gateways: gws, HTTP: &http.Client{Timeout: 20 * time.Second}, Rec: history.NewRecorder()}
	for i, tenant := range tenants[:2] {
		for _, acct := range histAccounts {
			if !hist.Open(i, tenant, acct) {
				t.Fatalf("opening %s/%s: %v", tenant, acct, hist.Failures())
			}
		}
		wg.Go(func() {
			hist.Ledger(i, tenant, histAccounts, 10*time.Millisecond, stop, func(amount int64) {
				l.mu.Lock()
				l.deposits[tenant] += amount
				l.mu.Unlock()
			})
		})
	}
	// One gRPC client beside the HTTP ones (grpcload_test.go): acme's deposits as SubmitCommand
	// calls and a Watch stream, with the same zero-failure rule (UNAVAILABLE retried as a 503
	// with Retry-After is).
	gl, err := newGRPCLoad("acme", gws, true, func(tenant string, amount int64) {
		l.mu.Lock()
		l.deposits[tenant] += amount
		l.mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	defer gl.close()
	wg.Go(func() { gl.run(stop) })
	phase := time.Second
	if chaosLong() {
		phase = 10 * time.Second
	}
	moveN := 0
	// startMove plans and applies a move of the next tenant to the other shard of every kind.
	startMove := func() string {
		tenant := tenants[moveN%len(tenants)]
		moveN++
		targets := map[string]string{}
		for _, kind := range []string{"aggregate", "projection", "runner"} {
			p, err := store.Placements(kind).Get(ctx, tenant)
			if err != nil {
				t.Fatalf("placement of %s/%s: %v", kind, tenant, err)
			}
			targets[kind] = kind + "-1"
			if p.Shard == kind+"-1" {
				targets[kind] = kind + "-2"
			}
		}
		id := createPlan(t, postRetry, s.rebalancer, map[string]any{"strategy": "move-tenant", "tenant": tenant, "targets": targets})
		postRetry(t, s.rebalancer+"/api/plans/"+id+"/apply", nil)
		return id
	}
	aborted := 0
	time.Sleep(phase) // steady load before the first failure

	// 1. kill -9 a shard instance while a move runs; the supervisor restarts it.
	id := startMove()
	l.mu.Lock()
	l.killed = append(l.killed, "aggregate.aggregate-1.a")
	l.mu.Unlock()
	before, killed := kill9(t, control, "aggregate-1.a")
	instRec := awaitRestart(t, control, "aggregate-1.a", before, killed)
	aborted += awaitSettled(t, s.rebalancer, id)
	t.Logf("shard instance aggregate-1.a killed: restarted and ready after %s", instRec.Round(time.Millisecond))
	time.Sleep(phase)

	// 2. kill -9 a gateway while a move runs; clients fail over to the other one.
	id = startMove()
	before, killed = kill9(t, control, "gateway")
	gwRec := awaitRestart(t, control, "gateway", before, killed)
	aborted += awaitSettled(t, s.rebalancer, id)
	t.Logf("gateway killed: restarted and ready after %s (%d client failovers so far)", gwRec.Round(time.Millisecond), l.failovers.Load())
	time.Sleep(phase)

	// 3. kill -9 the rebalancer during an apply; the restarted leader resumes the plan by itself
	// and it ends done, never with two owners.
	id = startMove()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		status, states, err := planStatus(s.rebalancer, id)
		if err == nil && (status == "applying" && len(states) > 0 || status == "done") {
			break
		}
		time.Sleep(10 * time.Millisecond) // polling the plan until the apply is under way
	}
	before, killed = kill9(t, control, "rebalancer")
	rbReady := awaitRestart(t, control, "rebalancer", before, killed)
	status, states, _ := planStatus(s.rebalancer, id)
	t.Logf("rebalancer killed with plan %s %s %v", id, status, states)
	// Nobody applies it again: the restarted leader resumes plans left applying by itself.
	aborted += awaitSettled(t, s.rebalancer, id)
	rbRec := time.Since(killed)
	t.Logf("rebalancer killed during an apply: restarted and ready after %s, plan done after %s", rbReady.Round(time.Millisecond), rbRec.Round(time.Millisecond))
	if rbRec > 5*time.Second { // usually 1-2 s: say where the time went
		_, moves, err := readPlan(s.rebalancer, id)
		if err != nil {
			t.Logf("reading plan %s for its timeline: %v", id, err)
		}
		t.Logf("the plan's moves, times from the kill: %s", planTimeline(moves, killed))
	}
	time.Sleep(phase)

	// 4. stop the NATS JetStream meta leader, then start it again.
	leader := 0
	for i, n := range readState(t, control).NATS {
		if n.Leader {
			leader = i + 1
		}
	}
	if leader == 0 {
		t.Fatal("no NATS meta leader in the control API's state")
	}
	stopped := time.Now()
	postOK(t, fmt.Sprintf("%s/nats/%d/stop", control, leader), nil)
	t.Logf("%s: stopped NATS node %d (meta leader)", stopped.Format("15:04:05.000"), leader)
	var newLeader time.Duration
	for deadline := time.Now().Add(30 * time.Second); newLeader == 0; {
		for _, n := range readState(t, control).NATS {
			if n.Leader {
				newLeader = time.Since(stopped)
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("no new NATS meta leader within 30s")
		}
		time.Sleep(50 * time.Millisecond) // polling the embedded servers' state
	}
	probeGW := 0
	l.do(&probeGW, "acme", "POST", "/commands", map[string]any{"aggregate_type": "account", "aggregate_id": "probe",
		"command": "open", "idempotency_key": "probe-open"})
	cmdRec := time.Since(stopped)
	id = startMove()
	aborted += awaitSettled(t, s.rebalancer, id)
	planRec := time.Since(stopped)
	_, steps, err := readPlan(s.rebalancer, id) // a figure, not a check: a failed read is logged
	if err != nil {
		t.Logf("reading plan %s for its moves' times: %v", id, err)
	}
	postOK(t, fmt.Sprintf("%s/nats/%d/start", control, leader), nil)
	// The plan moves one tenant in each kind, one kind after the other: the first of its moves
	// is "the next move" of the goal (within 2 s of the stop), the plan the tenant's three.
	t.Logf("NATS meta leader (node %d) stopped: new leader after %s, a command succeeded after %s, a move completed after %s, the tenant's three (one per kind, in turn) after %s",
		leader, newLeader.Round(time.Millisecond), cmdRec.Round(time.Millisecond), firstFinished(steps, stopped).Round(time.Millisecond), planRec.Round(time.Millisecond))
	if planRec > 2*time.Second { // say where the time went
		t.Logf("the move's steps, times from the stop: %s", planTimeline(steps, stopped))
	}
	time.Sleep(phase)

	moves := 4
	if chaosLong() {
		for range 6 {
			aborted += awaitSettled(t, s.rebalancer, startMove())
			moves++
		}
	}
	close(stop)
	wg.Wait()

	if len(l.failures) > 0 {
		t.Errorf("%d of %d requests failed:\n%s", len(l.failures), l.requests.Load(), strings.Join(first(l.failures, 20), "\n"))
	}
	if f := hist.Failures(); len(f) > 0 {
		t.Errorf("%d of the history's operations failed:\n%s", len(f), strings.Join(first(f, 20), "\n"))
	}
	hist.Rec.RequireLinearizable(t, "TM_STACK_LOGS", "chaos")
	if f := gl.failed(); len(f) > 0 {
		t.Errorf("%d of %d gRPC calls failed:\n%s", len(f), gl.calls.Load(), strings.Join(first(f, 20), "\n"))
	}
	t.Logf("gRPC: %d unary calls (%d UNAVAILABLE retried), a Watch stream with %d messages, resumed %d times",
		gl.calls.Load(), gl.retried.Load(), gl.messages.Load(), gl.resumed.Load())
	// Invariants, checked through the same client (a 503 with Retry-After is still allowed).
	l.failures = nil
	gw := 1
	call := func(tenant, _, method, path string, body any) (int, []byte) {
		return l.do(&gw, tenant, method, path, body)
	}
	for _, tenant := range tenants {
		var tot struct{ Deposits, Withdrawals, Balances int64 }
		_, b := l.do(&gw, tenant, "GET", "/ledger/totals", nil)
		if err := json.Unmarshal(b, &tot); err != nil {
			t.Fatalf("totals of %s: %v %s", tenant, err, b)
		}
		want := baseline[tenant] + l.deposits[tenant]
		if tot.Deposits != want || tot.Deposits-tot.Withdrawals != tot.Balances {
			t.Errorf("%s: ledger %+v, acknowledged deposits %d (before the load %d)", tenant, tot, want, baseline[tenant])
		}
		// The projection converges to the ledger.
		history.AwaitView(t, call, tenant, tot.Balances)
		// One owner per placement: active, no move target or source left over.
		for _, kind := range []string{"aggregate", "projection", "runner"} {
			p, err := store.Placements(kind).Get(ctx, tenant)
			if err != nil {
				t.Fatalf("placement of %s/%s: %v", kind, tenant, err)
			}
			if p.Phase != schema.PhaseActive || p.Target != "" || p.Source != "" || p.Shard == "" || p.Epoch == 0 {
				t.Errorf("placement %s/%s not settled with one owner: %+v", kind, tenant, p)
			}
		}
	}
	// Every job accepted (2xx) ran: within 20 s each one succeeded, none failed and none is
	// still pending (with two instances per runner shard, about one in a thousand used to stay
	// pending with no attempt: a claim took a stale direct get's miss of its run for a job
	// without a run and dropped its queue entry), and every effect arrived exactly once.
	jobsDeadline := time.Now().Add(20 * time.Second)
	var pending []string
	for id, tenant := range l.jobs {
		for {
			_, b := l.do(&gw, tenant, "GET", "/jobs/"+id, nil)
			var run struct{ Status string }
			_ = json.Unmarshal(b, &run)
			if run.Status == "succeeded" {
				break
			}
			if run.Status == "failed" {
				t.Errorf("job %s of %s: %s", id, tenant, b)
				break
			}
			if time.Now().After(jobsDeadline) {
				pending = append(pending, fmt.Sprintf("%s of %s: %s", id, tenant, bytes.TrimSpace(b)))
				delete(l.jobs, id)
				break
			}
			time.Sleep(50 * time.Millisecond) // jobs run asynchronously
		}
	}
	if len(pending) > 0 {
		t.Errorf("%d of %d accepted jobs not finished 20 s after the load:\n%s", len(pending), len(l.jobs)+len(pending), strings.Join(first(pending, 20), "\n"))
	}
	rcv.CheckOnce(t, len(l.jobs))
	if len(l.failures) > 0 {
		t.Errorf("checks failed: %s", strings.Join(first(l.failures, 10), "\n"))
	}
	t.Logf("chaos under load: %d moves (x3 kinds), %d requests, %d jobs (%d more not finished), %d failed; %d allowed 503s (Retry-After) retried, %d gateway failovers, %d in-doubt 502s from the killed instance retried; %d of the moves' kind steps aborted (tenant kept on its source)",
		moves, l.requests.Load(), len(l.jobs), len(pending), len(l.failures), l.allowed.Load(), l.failovers.Load(), l.inDoubt.Load(), aborted)
	s.stop(t)
}
