package server

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/rebalancer/sweeper"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// testToken is the admin token of the servers start starts; call sends it.
const testToken = "test-admin-token"

func openStore(t *testing.T, url string) *schema.Store { return kittest.StoreAt(t, url) }

func startShard(t *testing.T, st *schema.Store, shard string) {
	kittest.Shard(t, shardkit.Config{Store: st, ID: schema.InstanceID{Kind: "aggregate", Shard: shard}})
}

// running is a started Server with its HTTP test server and a subscription to its events.
type running struct {
	s      *Server
	ts     *httptest.Server
	events chan Event
	stop   context.CancelFunc
}

func start(t *testing.T, st *schema.Store, holder string, sc sweeper.Config) *running {
	t.Helper()
	s, err := New(Config{Store: st, Holder: holder, LeaseTTL: 900 * time.Millisecond, Sweep: sc, AdminToken: testToken,
		Health: rebalancer.Health{Thresholds: schema.Thresholds{OfflineAfter: 2 * time.Minute}}})
	if err != nil {
		t.Fatal(err)
	}
	events, unsub := s.hub.subscribe()
	ctx, cancel := context.WithCancel(context.Background())
	if err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(s.Handler())
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			cancel()
			s.Wait()
			unsub()
			ts.Close()
		}
	}
	t.Cleanup(stop)
	return &running{s: s, ts: ts, events: events, stop: stop}
}

// await reads the server's events until match accepts one.
func (r *running) await(t *testing.T, what string, match func(Event) bool) Event {
	t.Helper()
	deadline := time.After(20 * time.Second)
	for {
		select {
		case ev := <-r.events:
			if match(ev) {
				return ev
			}
		case <-deadline:
			t.Fatalf("no %s event", what)
		}
	}
}

func leading(ev Event) bool {
	return ev.Type == "leader" && strings.Contains(string(ev.Data), `"leading":true`)
}

// call sends a request with the admin token testToken and decodes the answer into out.
func call(t *testing.T, method, url string, body any, out any) (int, http.Header) {
	t.Helper()
	return tmtest.CallJSON(t, testToken, method, url, body, out)
}

// sse opens the event stream and returns its events by name.
func sse(t *testing.T, url string) <-chan Event {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url+"/api/events", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("event stream content type %q", ct)
	}
	out := make(chan Event, 1024)
	go func() {
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		var ev Event
		for sc.Scan() {
			line := sc.Text()
			switch {
			case strings.HasPrefix(line, "event: "):
				ev.Type = strings.TrimPrefix(line, "event: ")
			case strings.HasPrefix(line, "data: "):
				ev.Data = json.RawMessage(strings.TrimPrefix(line, "data: "))
			case line == "" && ev.Type != "":
				out <- ev
				ev = Event{}
			}
		}
	}()
	t.Cleanup(cancel)
	return out
}

// TestAPIPlanApplyAndFollower exercises the API of a leader and a follower against real
// shards: plans are made, read and applied on the leader (progress on the event stream), the
// follower answers apply with 409 naming the leader, and takes over when the leader stops.
func TestAPIPlanApplyAndFollower(t *testing.T) {
	srv := natstest.Server(t)
	st1, st2 := openStore(t, srv.URL()), openStore(t, srv.URL())
	ctx := context.Background()
	startShard(t, st1, "s-1")
	startShard(t, st1, "s-2")
	for i := range 4 {
		if _, err := st1.Placements("aggregate").Create(ctx, schema.Placement{Tenant: fmt.Sprintf("t%d", i), Shard: "s-1"}); err != nil {
			t.Fatal(err)
		}
	}
	a := start(t, st1, "r1", sweeper.Config{})
	a.await(t, "leader", leading)
	b := start(t, st2, "r2", sweeper.Config{})
	base := a.ts.URL

	var dry struct{ Plan json.RawMessage }
	if code, _ := call(t, "POST", base+"/api/plans", map[string]any{"strategy": "balance", "kind": "aggregate", "dry_run": true}, &dry); code != 200 || len(dry.Plan) == 0 {
		t.Fatalf("dry run: %d", code)
	}
	var pr PlanResponse
	code, h := call(t, "POST", base+"/api/plans", map[string]any{"strategy": "balance", "kind": "aggregate", "concurrency": 2}, &pr)
	if code != http.StatusCreated || len(pr.Moves) != 2 || h.Get("Location") != "/api/plans/"+pr.Plan.ID {
		t.Fatalf("create plan: %d %+v", code, pr)
	}
	id := pr.Plan.ID
	var prob tmhttp.Problem
	if code, h := call(t, "POST", base+"/api/plans", map[string]any{"strategy": "balance", "kind": "nokind"}, &prob); code != 404 || h.Get("Content-Type") != tmhttp.ContentTypeProblem {
		t.Fatalf("unknown kind: %d %+v", code, prob)
	}
	if code, _ := call(t, "POST", base+"/api/plans", map[string]any{"strategy": "balance", "colour": "blue"}, &prob); code != 400 {
		t.Fatalf("unknown field: %d %+v", code, prob)
	}
	if code, _ := call(t, "POST", base+"/api/plans", map[string]any{"strategy": "evacuate", "kind": "aggregate", "shard": "s-9"}, &prob); code != 422 {
		t.Fatalf("infeasible plan: %d %+v", code, prob)
	}
	if code, _ := call(t, "GET", base+"/api/plans/p-nope", nil, &prob); code != 404 || prob.Type != tmhttp.TypeBase+"plan-not-found" {
		t.Fatalf("missing plan: %d %+v", code, prob)
	}

	code, _ = call(t, "POST", b.ts.URL+"/api/plans/"+id+"/apply", nil, &prob)
	if code != http.StatusConflict || !strings.Contains(prob.Detail, "held by r1") {
		t.Fatalf("apply on the follower: %d %+v", code, prob)
	}

	events := sse(t, base)
	code, _ = call(t, "POST", base+"/api/plans/"+id+"/apply", nil, nil)
	if code != http.StatusAccepted {
		t.Fatalf("apply: %d", code)
	}
	if code, _ := call(t, "POST", base+"/api/plans/"+id+"/apply", nil, &prob); code != http.StatusConflict {
		t.Fatalf("second apply: %d %+v", code, prob)
	}
	seen := map[string]bool{}
	deadline := time.After(30 * time.Second)
	for done := false; !done; {
		select {
		case ev := <-events:
			seen[ev.Type] = true
			if ev.Type == "plan" {
				var rec rebalancer.PlanRecord
				_ = json.Unmarshal(ev.Data, &rec)
				done = rec.ID == id && rec.Status == rebalancer.PlanDone
			}
		case <-deadline:
			t.Fatalf("plan never reported done on the event stream; saw %v", seen)
		}
	}
	if !seen["move"] || !seen["audit"] {
		t.Fatalf("event types seen: %v", seen)
	}

	var list []rebalancer.PlanSummary
	if code, _ := call(t, "GET", b.ts.URL+"/api/plans", nil, &list); code != 200 || len(list) != 1 || list[0].Count(rebalancer.MoveDone) != 2 {
		t.Fatalf("plans on the follower: %d %+v", code, list)
	}
	var insts []rebalancer.InstanceView
	if code, _ := call(t, "GET", b.ts.URL+"/api/instances?kind=aggregate", nil, &insts); code != 200 || len(insts) != 2 || insts[0].Status != schema.StatusOnline {
		t.Fatalf("instances: %d %+v", code, insts)
	}
	var evs []schema.AuditEvent
	if code, _ := call(t, "GET", base+"/api/audit?tenant="+pr.Moves[0].Tenant+"&since=1h", nil, &evs); code != 200 || len(evs) != 4 {
		t.Fatalf("audit: %d %+v", code, evs)
	}
	var kc schema.KindConfig
	if code, _ := call(t, "PUT", b.ts.URL+"/api/kinds/aggregate", map[string]any{"unplaced": "reject"}, &kc); code != 200 || kc.Unplaced != schema.UnplacedReject || kc.Policy != schema.PolicyManaged {
		t.Fatalf("put kind: %d %+v", code, kc)
	}
	if code, _ := call(t, "PUT", b.ts.URL+"/api/kinds/aggregate", map[string]any{"policy": "sometimes"}, &prob); code != 400 {
		t.Fatalf("put a bad kind: %d %+v", code, prob)
	}
	var ready map[string]any
	if code, _ := call(t, "GET", b.ts.URL+"/readyz", nil, &ready); code != 200 || ready["leader"] != false {
		t.Fatalf("follower readyz: %d %v", code, ready)
	}
	resp, err := tmtest.HTTP.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(metrics), "tm_rebalancer_leader 1") {
		t.Fatalf("metrics lack the leader gauge")
	}

	// The leader stops (and releases its lease): the follower takes over.
	a.stop()
	b.await(t, "leader", leading)
	var rb map[string]string
	if code, _ := call(t, "POST", b.ts.URL+"/api/plans/"+id+"/rollback", nil, &rb); code != http.StatusAccepted {
		t.Fatalf("rollback on the new leader: %d %v", code, rb)
	}
}

// TestWriteRoutesNeedToken: every route that changes state needs the admin token (401 without
// it or with a wrong one, 403 for all of them when the server has none); reads stay open.
func TestWriteRoutesNeedToken(t *testing.T) {
	srv := natstest.Server(t)
	st := openStore(t, srv.URL())
	writes := []struct{ method, path string }{
		{"POST", "/api/plans"}, {"POST", "/api/plans/p-1/apply"}, {"POST", "/api/plans/p-1/rollback"},
		{"PUT", "/api/kinds/aggregate"}, {"DELETE", "/api/plans/p-1"},
	}
	body := map[string]any{"unplaced": "reject"}

	s, err := New(Config{Store: st, Holder: "no-token"})
	if err != nil {
		t.Fatal(err)
	}
	open := httptest.NewServer(s.Handler())
	defer open.Close()
	for _, w := range writes {
		var prob tmhttp.Problem
		code, h := tmtest.CallJSON(t, testToken, w.method, open.URL+w.path, body, &prob)
		if code != http.StatusForbidden || h.Get("Content-Type") != tmhttp.ContentTypeProblem ||
			!strings.Contains(prob.Detail, "--admin-token") || !strings.Contains(prob.Detail, "TM_ADMIN_TOKEN") {
			t.Fatalf("%s %s without a configured token: %d %+v", w.method, w.path, code, prob)
		}
	}

	r := start(t, st, "r1", sweeper.Config{})
	base := r.ts.URL
	for _, w := range writes {
		for _, tok := range []string{"", "wrong", testToken + "x"} {
			var prob tmhttp.Problem
			code, h := tmtest.CallJSON(t, tok, w.method, base+w.path, body, &prob)
			if code != http.StatusUnauthorized || h.Get("WWW-Authenticate") == "" || prob.Status != http.StatusUnauthorized {
				t.Fatalf("%s %s with token %q: %d %+v", w.method, w.path, tok, code, prob)
			}
		}
	}
	var kc schema.KindConfig
	if code, _ := call(t, "PUT", base+"/api/kinds/aggregate", body, &kc); code != http.StatusOK || kc.Unplaced != schema.UnplacedReject {
		t.Fatalf("put kind with the token: %d %+v", code, kc)
	}
	var prob tmhttp.Problem
	if code, _ := call(t, "POST", base+"/api/plans/p-nope/apply", nil, &prob); code == http.StatusUnauthorized || code == http.StatusForbidden {
		t.Fatalf("apply with the token: %d %+v", code, prob)
	}
	for _, path := range []string{"/api/plans", "/api/instances", "/api/audit", "/api/kinds", "/api/leader", "/healthz", "/readyz", "/metrics", "/"} {
		if code, _ := tmtest.CallJSON(t, "", "GET", base+path, nil, nil); code != http.StatusOK {
			t.Fatalf("GET %s without a token: %d", path, code)
		}
	}
	sse(t, base) // fails unless the event stream opens without a token
}

// TestLeaderSweeps: the leader cleans stale routes when it starts, then marks a silent
// instance offline, alerts the webhook and removes it from routes (the sweeper's own tests
// check that it alerts once).
func TestLeaderSweeps(t *testing.T) {
	srv := natstest.Server(t)
	st := openStore(t, srv.URL())
	ctx := context.Background()
	dead := schema.InstanceID{Kind: "runner", Shard: "runner-1", Instance: "dead"}
	i := schema.Instance{InstanceID: dead, URL: "http://127.0.0.1:9", Heartbeat: time.Now().Add(-10 * time.Minute), Reported: schema.StatusOnline}
	raw, _ := json.Marshal(i)
	if _, err := st.KV(schema.BucketInstances).Put(ctx, dead.Key(), raw); err != nil {
		t.Fatal(err)
	}
	ghost := schema.InstanceID{Kind: "runner", Shard: "runner-1", Instance: "ghost"}
	for _, id := range []schema.InstanceID{dead, ghost} {
		if _, err := st.Routes().AddInstance(ctx, schema.Route{Method: "*", Prefix: "/jobs", Kind: "runner"}, id); err != nil {
			t.Fatal(err)
		}
	}
	alerts := make(chan sweeper.Alert, 4)
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var a sweeper.Alert
		_ = json.NewDecoder(r.Body).Decode(&a)
		alerts <- a
	}))
	defer hook.Close()
	r := start(t, st, "r1", sweeper.Config{Interval: 100 * time.Millisecond, Webhook: hook.URL})
	r.await(t, "offline audit", func(ev Event) bool {
		return ev.Type == "audit" && strings.Contains(string(ev.Data), "instance.offline")
	})
	select {
	case a := <-alerts:
		if a.Type != sweeper.AlertAgentOffline || a.Instance != dead.Key() {
			t.Fatalf("alert %+v", a)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no alert")
	}
	if _, err := st.Routes().Get(ctx, "runner", "*", "/jobs"); err == nil {
		t.Fatal("the route of dead instances survived the sweep")
	}
}

// TestLeaderCompacts: the leader runs a compacting placement watcher for every kind, so
// placement snapshots appear in tm_snapshots.
func TestLeaderCompacts(t *testing.T) {
	srv := natstest.Server(t)
	st := openStore(t, srv.URL())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	obs, err := st.Snapshots(ctx)
	if err != nil {
		t.Fatal(err)
	}
	w, err := obs.Watch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	s, err := New(Config{Store: st, Holder: "r1", LeaseTTL: time.Second, CompactEvery: 1, CompactInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	if err := s.Start(rctx); err != nil {
		t.Fatal(err)
	}
	defer func() { stop(); s.Wait() }()
	for i := range 3 {
		if _, err := st.Placements("projection").Create(ctx, schema.Placement{Tenant: fmt.Sprintf("t%d", i), Shard: "projection-1"}); err != nil {
			t.Fatal(err)
		}
	}
	for {
		select {
		case info := <-w.Updates():
			if info != nil && info.Name == schema.SnapshotObject("projection") && !info.Deleted {
				return
			}
		case <-ctx.Done():
			t.Fatal("no placement snapshot written")
		}
	}
}

// TestLeaderResumesApplyingPlans: a plan left "applying" by a leader that died is finished by
// the next leader without anyone applying it again.
func TestLeaderResumesApplyingPlans(t *testing.T) {
	st, _ := kittest.Store(t)
	startShard(t, st, "s-1")
	startShard(t, st, "s-2")
	ctx := context.Background()
	p, err := st.Placements("aggregate").Create(ctx, schema.Placement{Tenant: "acme", Shard: "s-1"})
	if err != nil {
		t.Fatal(err)
	}
	eng, err := rebalancer.New(rebalancer.Config{Store: st, Holder: "dead-leader"})
	if err != nil {
		t.Fatal(err)
	}
	rec, err := eng.CreatePlan(ctx, &planner.Plan{Strategy: "manual", Concurrency: 1, Waves: 1,
		Moves: []planner.Move{{Kind: "aggregate", Tenant: "acme", From: "s-1", To: "s-2", Revision: p.Revision, Wave: 1}}}, "test")
	if err != nil {
		t.Fatal(err)
	}
	// The dead leader had marked it applying before it died.
	rec.Status = rebalancer.PlanApplying
	if _, err := st.Rebalance().Update(ctx, schema.PlanKey(rec.ID), rec.Revision, rec); err != nil {
		t.Fatal(err)
	}
	r := start(t, st, "new-leader", sweeper.Config{})
	r.await(t, "plan done", func(ev Event) bool {
		var got rebalancer.PlanRecord
		return ev.Type == "plan" && json.Unmarshal(ev.Data, &got) == nil && got.ID == rec.ID && got.Status == rebalancer.PlanDone
	})
	if got, _ := st.Placements("aggregate").Get(ctx, "acme"); got.Shard != "s-2" {
		t.Fatalf("acme on %s after the resumed plan", got.Shard)
	}
}

// TestMoveStalledGauge: tm_rebalancer_move_stalled_seconds (the "move stuck" alert's input)
// counts moves in progress from tm_rebalance, those stored before the process started included,
// and drops them once they finish or are deleted.
func TestMoveStalledGauge(t *testing.T) {
	srv := natstest.Server(t)
	st := openStore(t, srv.URL())
	ctx := context.Background()
	put := func(id string, state rebalancer.MoveState, updated time.Time) {
		t.Helper()
		m := rebalancer.MoveRecord{Plan: "p1", ID: id, State: state, Updated: updated}
		key := schema.MoveKey(m.Plan, m.ID)
		raw, _ := json.Marshal(m)
		if _, err := st.KV(schema.BucketRebalance).Put(ctx, key, raw); err != nil {
			t.Fatal(err)
		}
	}
	put("m00001", rebalancer.MoveWarming, time.Now().Add(-time.Hour))
	put("m00002", rebalancer.MovePending, time.Now().Add(-2*time.Hour)) // not started: not stalled
	r := start(t, st, "r1", sweeper.Config{})
	stalled := func() float64 { return r.s.moves.stalled(time.Now()).Seconds() }
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("the stored warming move to count", func() bool { return stalled() >= 3600 }))
	if s := stalled(); s > 3700 {
		t.Fatalf("stalled %.0fs: the pending move counted", s)
	}
	put("m00001", rebalancer.MoveDone, time.Now())
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("the finished move to be dropped", func() bool { return stalled() == 0 }))
	put("m00003", rebalancer.MoveHandoff, time.Now().Add(-10*time.Minute))
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("a handoff to count", func() bool { return stalled() >= 600 }))
	if err := st.KV(schema.BucketRebalance).Delete(ctx, schema.MoveKey("p1", "m00003")); err != nil {
		t.Fatal(err)
	}
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("the deleted move to be dropped", func() bool { return stalled() == 0 }))
	body := get(t, r.ts.URL+"/metrics")
	if !strings.Contains(body, "tm_rebalancer_move_stalled_seconds 0") {
		t.Fatalf("/metrics lacks tm_rebalancer_move_stalled_seconds 0:\n%s", body)
	}
}

func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := tmtest.HTTP.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return string(b)
}
