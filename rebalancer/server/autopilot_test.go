package server

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/autopilot"
	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// startAuto starts a server with the autopilot in mode, deciding fast: presence declares an
// instance dead after 1s of silence, the detectors look every 200ms, a condition must hold
// 300ms, and the leader waits 500ms after it starts.
func startAuto(t *testing.T, st *schema.Store, mode autopilot.Mode, tune func(*autopilot.Config)) *running {
	t.Helper()
	ac := autopilot.Config{Mode: mode, Startup: 500 * time.Millisecond, Tick: 100 * time.Millisecond, Every: 200 * time.Millisecond,
		Sustain: 300 * time.Millisecond}
	if tune != nil {
		tune(&ac)
	}
	s, err := New(Config{Store: st, Holder: "auto", LeaseTTL: 900 * time.Millisecond, AdminToken: testToken,
		Presence:  rebalancer.PresenceConfig{SuspectAfter: 300 * time.Millisecond, DeadAfter: time.Second},
		Autopilot: ac})
	if err != nil {
		t.Fatal(err)
	}
	events, unsub := s.hub.subscribe()
	ctx, cancel := context.WithCancel(context.Background())
	if err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(s.Handler())
	r := &running{s: s, ts: ts, events: events}
	r.stop = func() { cancel(); s.Wait(); unsub(); ts.Close() }
	t.Cleanup(r.stop)
	r.await(t, "leadership", leading)
	return r
}

// crashable runs an aggregate instance of shard on a NATS connection of its own; kill closes
// that connection, as a process dying does (nothing is unregistered).
func crashable(t *testing.T, url, shard string) (kill func()) {
	t.Helper()
	st := kittest.StoreAt(t, url)
	kittest.Shard(t, shardkit.Config{Store: st, ID: schema.InstanceID{Kind: "aggregate", Shard: shard, Instance: "a"}})
	return func() { st.JS().Conn().Close() }
}

// placeOn places n tenants named prefix0.. on shard.
func placeOn(t *testing.T, st *schema.Store, prefix, shard string, n int) []string {
	t.Helper()
	var out []string
	for i := range n {
		tenant := fmt.Sprintf("%s%d", prefix, i)
		if _, err := st.Placements("aggregate").Create(context.Background(), schema.Placement{Tenant: tenant, Shard: shard}); err != nil {
			t.Fatal(err)
		}
		out = append(out, tenant)
	}
	return out
}

// autopilotStatus reads GET /api/autopilot.
func autopilotStatus(t *testing.T, r *running) autopilot.Status {
	t.Helper()
	var s autopilot.Status
	if code, _ := call(t, "GET", r.ts.URL+"/api/autopilot", nil, &s); code != http.StatusOK {
		t.Fatalf("GET /api/autopilot: %d", code)
	}
	return s
}

// decided waits until the autopilot made a decision of detector with outcome and returns it.
func decided(t *testing.T, r *running, detector, outcome string) autopilot.Decision {
	t.Helper()
	var d autopilot.Decision
	tmtest.WaitFor(t, 20*time.Second, func() error {
		for _, x := range autopilotStatus(t, r).Decisions {
			if x.Detector == detector && x.Outcome == outcome {
				d = x
				return nil
			}
		}
		return fmt.Errorf("no %s %s decision yet", detector, outcome)
	})
	return d
}

// The autopilot fails over the tenants of a shard whose only instance died, by itself: they
// end on the live shard at the next epoch, by a plan that says what triggered it, with
// takeovers that say their goal, audited and counted.
func TestAutopilotFailsOverADeadShard(t *testing.T) {
	st, url := kittest.Store(t)
	startShard(t, st, "aggregate-2")
	kill := crashable(t, url, "aggregate-1")
	tenants := placeOn(t, st, "t", "aggregate-1", 5)
	r := startAuto(t, st, autopilot.On, nil)
	kill()
	killed := time.Now()
	for _, tenant := range tenants {
		tmtest.WaitFor(t, 20*time.Second, tmtest.Until(tenant+" taken over by aggregate-2", func() bool {
			p, err := st.Placements("aggregate").Latest(context.Background(), tenant)
			return err == nil && p.Shard == "aggregate-2" && p.Epoch == 2 && p.Phase == schema.PhaseActive
		}))
	}
	t.Logf("5 tenants served by aggregate-2 %s after their shard's instance died", time.Since(killed).Round(time.Millisecond))
	d := decided(t, r, "failover", "done")
	if d.Subject != "aggregate/aggregate-1" || d.Plan == "" || !strings.Contains(d.Detail, "served again") {
		t.Fatalf("decision %+v", d)
	}
	rec, moves, err := r.s.eng.Plan(context.Background(), d.Plan)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Origin != "autopilot" || rec.Trigger == nil || rec.Trigger.Detector != "failover" || !strings.Contains(rec.Trigger.Figure, "no live instance") || rec.Plan.Strategy != planner.StrategyFailover {
		t.Fatalf("plan %+v trigger %+v", rec, rec.Trigger)
	}
	for _, m := range moves {
		if !m.Takeover || m.State != rebalancer.MoveDone || !strings.Contains(m.Goal, "no live instance") || m.Fenced == "" {
			t.Fatalf("move %+v", m)
		}
	}
	evs, err := st.Audit().Read(context.Background(), schema.AuditQuery{Limit: 1000})
	if err != nil {
		t.Fatal(err)
	}
	planned := false
	for _, ev := range evs {
		planned = planned || ev.Action == "autopilot.plan" && ev.Plan == d.Plan
	}
	if !planned {
		t.Fatal("no autopilot.plan in the audit journal")
	}
	// The gauge is the leader's last look (every 250 ms), which may predate the last takeover.
	var m string
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("the metrics to show the failover and no tenant left without a live shard", func() bool {
		m = get(t, r.ts.URL+"/metrics")
		return strings.Contains(m, `tm_autopilot_failovers_total{kind="aggregate"} 1`) &&
			strings.Contains(m, `tm_autopilot_tenants_without_live_shard{kind="aggregate"} 0`)
	}))
}

// A takeover whose target has no live instance fails its move and leaves its tenants held in
// takeover. Their source is live, so no failover comes for them: the retake detector takes
// them over again, to a live shard, and the source's live instance drains for it.
func TestAutopilotRetakesAHeldTakeover(t *testing.T) {
	st, _ := kittest.Store(t)
	startShard(t, st, "aggregate-1")
	startShard(t, st, "aggregate-2")
	tenants := placeOn(t, st, "h", "aggregate-1", 3)
	r := startAuto(t, st, autopilot.On, func(c *autopilot.Config) { c.Sustain = time.Hour }) // no fill or balance
	ctx := context.Background()

	// An operator's takeover to aggregate-3, which has no instance at all.
	var moves []planner.Move
	for _, tenant := range tenants {
		moves = append(moves, planner.Move{Kind: "aggregate", Tenant: tenant, From: "aggregate-1", To: "aggregate-3", Takeover: true, Wave: 1})
	}
	rec, _, err := r.s.eng.StorePlan(ctx, rebalancer.PlanRecord{Actor: "ops", Origin: "operator",
		Plan: planner.Plan{Strategy: planner.StrategyFailover, Concurrency: len(moves), Waves: 1, Moves: moves}})
	if err != nil {
		t.Fatal(err)
	}
	if code, _ := call(t, "POST", r.ts.URL+"/api/plans/"+rec.ID+"/apply", nil, nil); code != http.StatusAccepted {
		t.Fatalf("apply: %d", code)
	}
	tmtest.WaitFor(t, 30*time.Second, tmtest.Until("the takeovers to aggregate-3 to fail", func() bool {
		_, ms, err := r.s.eng.Plan(ctx, rec.ID)
		if err != nil {
			return false
		}
		for _, m := range ms {
			if m.State != rebalancer.MoveFailed || !strings.Contains(m.Reason, "no live instance") {
				return false
			}
		}
		return true
	}))

	for _, tenant := range tenants {
		tmtest.WaitFor(t, 20*time.Second, tmtest.Until(tenant+" taken over again by aggregate-2", func() bool {
			p, err := st.Placements("aggregate").Latest(ctx, tenant)
			return err == nil && p.Shard == "aggregate-2" && p.Epoch == 2 && p.Phase == schema.PhaseActive
		}))
	}
	// The three moves fail one by one, so a look may find only some of them held: a retake
	// plan each time, and together they take over all three.
	var retaken map[string]bool
	tmtest.WaitFor(t, 20*time.Second, tmtest.Until("retake plans, done, for all three tenants", func() bool {
		retaken = map[string]bool{}
		for _, d := range autopilotStatus(t, r).Decisions {
			if d.Detector != "retake" || d.Outcome != "done" {
				continue
			}
			if d.Subject != "aggregate" || !strings.Contains(d.Detail, "served again") {
				t.Fatalf("decision %+v", d)
			}
			got, ms, err := r.s.eng.Plan(ctx, d.Plan)
			if err != nil {
				t.Fatal(err)
			}
			held := fmt.Sprintf("%d tenants held", len(ms))
			if got.Trigger == nil || got.Trigger.Detector != "retake" || !strings.Contains(got.Trigger.Figure, held) || !strings.Contains(got.Trigger.Figure, rec.ID) {
				t.Fatalf("trigger %+v", got.Trigger)
			}
			for _, m := range ms {
				if !m.Takeover || m.State != rebalancer.MoveDone || m.To != "aggregate-2" || !strings.Contains(m.Goal, "again") || !strings.Contains(m.Fenced, "drained") {
					t.Fatalf("move %+v", m)
				}
				if retaken[m.Tenant] {
					t.Fatalf("%s retaken twice", m.Tenant)
				}
				retaken[m.Tenant] = true
			}
		}
		return len(retaken) == len(tenants)
	}))
	var m string
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("the gauge to show no tenant held", func() bool {
		m = get(t, r.ts.URL+"/metrics")
		return strings.Contains(m, `tm_autopilot_tenants_held_in_takeover{kind="aggregate"} 0`)
	}))
}

// In dry-run the autopilot proposes: the failover plan is stored, marked proposed, and nothing
// moves until an operator applies it.
func TestAutopilotDryRunProposes(t *testing.T) {
	st, url := kittest.Store(t)
	startShard(t, st, "aggregate-2")
	kill := crashable(t, url, "aggregate-1")
	tenants := placeOn(t, st, "t", "aggregate-1", 2)
	r := startAuto(t, st, autopilot.DryRun, nil)
	kill()
	d := decided(t, r, "failover", "proposed")
	rec, _, err := r.s.eng.Plan(context.Background(), d.Plan)
	if err != nil || !rec.Proposed || rec.Status != rebalancer.PlanPlanned {
		t.Fatalf("proposed plan %+v: %v", rec, err)
	}
	if !strings.Contains(get(t, r.ts.URL+"/metrics"), `tm_autopilot_tenants_without_live_shard{kind="aggregate"} 2`) {
		t.Fatal("the tenants without a live shard are not counted")
	}
	for _, tenant := range tenants {
		if p, _ := st.Placements("aggregate").Latest(context.Background(), tenant); p.Shard != "aggregate-1" {
			t.Fatalf("%s moved in dry-run: %+v", tenant, p)
		}
	}
	if code, _ := call(t, "POST", r.ts.URL+"/api/plans/"+d.Plan+"/apply", nil, nil); code != http.StatusAccepted {
		t.Fatalf("an operator applying the proposal: %d", code)
	}
	for _, tenant := range tenants {
		tmtest.WaitFor(t, 20*time.Second, tmtest.Until(tenant+" on aggregate-2", func() bool {
			p, err := st.Placements("aggregate").Latest(context.Background(), tenant)
			return err == nil && p.Shard == "aggregate-2" && p.Phase == schema.PhaseActive
		}))
	}
}

// The autopilot fills a new empty shard, but not during a change freeze, not beyond its move
// budget, and says which guardrail stopped it.
func TestAutopilotFillUnderGuardrails(t *testing.T) {
	st, _ := kittest.Store(t)
	startShard(t, st, "aggregate-1")
	startShard(t, st, "aggregate-2")
	placeOn(t, st, "t", "aggregate-1", 6)
	ctx := context.Background()
	if _, err := autopilot.FreezeUntil(ctx, st, time.Now().Add(time.Hour), "release train", "test"); err != nil {
		t.Fatal(err)
	}
	r := startAuto(t, st, autopilot.On, func(c *autopilot.Config) { c.MaxMoves = 2 })
	d := decided(t, r, "fill", "blocked")
	if d.Guardrail != "freeze" || !strings.Contains(d.Detail, "release train") {
		t.Fatalf("blocked by %q: %s", d.Guardrail, d.Detail)
	}
	if n := countOn(t, st, "aggregate-2"); n != 0 {
		t.Fatalf("%d tenants moved during the freeze", n)
	}
	if code, _ := call(t, "DELETE", r.ts.URL+"/api/autopilot/freeze", nil, nil); code != http.StatusOK {
		t.Fatalf("unfreeze: %d", code)
	}
	done := decided(t, r, "fill", "done")
	if n := countOn(t, st, "aggregate-2"); n != 2 {
		t.Fatalf("%d tenants on the new shard after plan %s: the budget is 2 moves", n, done.Plan)
	}
	if d := decided(t, r, "fill", "blocked"); d.Guardrail != "move budget" && d.Guardrail != "freeze" {
		t.Fatalf("after the budget was spent: blocked by %q: %s", d.Guardrail, d.Detail)
	}
	tmtest.WaitFor(t, 10*time.Second, func() error {
		for _, x := range autopilotStatus(t, r).Decisions {
			if x.Guardrail == "move budget" {
				return nil
			}
		}
		return fmt.Errorf("no decision blocked by the move budget")
	})
	if s := autopilotStatus(t, r); s.Used.Moves != 2 || s.Guardrails.MaxMoves != 2 {
		t.Fatalf("used %+v of %d", s.Used, s.Guardrails.MaxMoves)
	}
}

func countOn(t *testing.T, st *schema.Store, shard string) int {
	t.Helper()
	pls, _, err := st.Placements("aggregate").List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, p := range pls {
		if p.Shard == shard && p.Phase == schema.PhaseActive {
			n++
		}
	}
	return n
}

// A plan can be paused (the move under way finishes, the rest wait), resumed (it finishes),
// and cancelled (a move warming is aborted at once, the rest skipped).
func TestPlanPauseResumeCancel(t *testing.T) {
	st, _ := kittest.Store(t)
	startShard(t, st, "aggregate-1")
	gate := make(chan struct{})
	kittest.Shard(t, shardkit.Config{Store: st, ID: schema.InstanceID{Kind: "aggregate", Shard: "aggregate-2"},
		Hooks: shardkit.Hooks{Warm: func(ctx context.Context, _ string, _ uint64) error {
			select {
			case <-gate:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}}})
	tenants := placeOn(t, st, "p", "aggregate-1", 6)
	r := startAuto(t, st, autopilot.Off, nil)
	plan := func(ts ...string) string {
		var moves []planner.ManualMove
		for _, tenant := range ts {
			moves = append(moves, planner.ManualMove{Tenant: tenant, To: "aggregate-2"})
		}
		var out PlanResponse
		if code, _ := call(t, "POST", r.ts.URL+"/api/plans", map[string]any{"strategy": "manual", "kind": "aggregate", "moves": moves, "concurrency": 1}, &out); code != http.StatusCreated {
			t.Fatalf("create plan: %d", code)
		}
		return out.Plan.ID
	}
	status := func(id string) (rebalancer.PlanRecord, []rebalancer.MoveRecord) {
		rec, moves, err := r.s.eng.Plan(context.Background(), id)
		if err != nil {
			t.Fatal(err)
		}
		return rec, moves
	}
	warming := func(id string) {
		tmtest.WaitFor(t, 10*time.Second, tmtest.Until("a move of "+id+" warming", func() bool {
			_, moves := status(id)
			return moves[0].State == rebalancer.MoveWarming
		}))
	}

	id := plan(tenants[:3]...)
	if code, _ := call(t, "POST", r.ts.URL+"/api/plans/"+id+"/apply", nil, nil); code != http.StatusAccepted {
		t.Fatalf("apply: %d", code)
	}
	warming(id)
	if code, _ := call(t, "POST", r.ts.URL+"/api/plans/"+id+"/pause", map[string]string{"actor": "ops"}, nil); code != http.StatusAccepted {
		t.Fatalf("pause: %d", code)
	}
	gate <- struct{}{} // the move under way finishes warming
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until(id+" paused", func() bool { rec, _ := status(id); return rec.Status == rebalancer.PlanPaused }))
	rec, moves := status(id)
	if rec.ControlBy != "ops" || moves[0].State != rebalancer.MoveDone || moves[1].State != rebalancer.MovePending || moves[2].State != rebalancer.MovePending {
		t.Fatalf("paused plan %+v, moves %s %s %s", rec, moves[0].State, moves[1].State, moves[2].State)
	}
	close(gate) // warm-ups no longer wait
	if code, _ := call(t, "POST", r.ts.URL+"/api/plans/"+id+"/resume", nil, nil); code != http.StatusAccepted {
		t.Fatalf("resume: %d", code)
	}
	tmtest.WaitFor(t, 20*time.Second, tmtest.Until(id+" done", func() bool { rec, _ := status(id); return rec.Status == rebalancer.PlanDone }))
	if code, _ := call(t, "POST", r.ts.URL+"/api/plans/"+id+"/pause", nil, nil); code != http.StatusConflict {
		t.Fatalf("pausing a finished plan: %d, want 409", code)
	}

	// Cancel: a fresh gate blocks the next plan's first warm-up; the cancel aborts it.
	gate = make(chan struct{})
	id = plan(tenants[3:]...)
	if code, _ := call(t, "POST", r.ts.URL+"/api/plans/"+id+"/apply", nil, nil); code != http.StatusAccepted {
		t.Fatalf("apply: %d", code)
	}
	warming(id)
	if code, _ := call(t, "POST", r.ts.URL+"/api/plans/"+id+"/cancel", nil, nil); code != http.StatusAccepted {
		t.Fatalf("cancel: %d", code)
	}
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until(id+" cancelled", func() bool { rec, _ := status(id); return rec.Status == rebalancer.PlanCancelled }))
	_, moves = status(id)
	if moves[0].State != rebalancer.MoveAborted || moves[1].State != rebalancer.MoveSkipped || moves[2].State != rebalancer.MoveSkipped {
		t.Fatalf("cancelled plan's moves: %s %s %s", moves[0].State, moves[1].State, moves[2].State)
	}
	for _, tenant := range tenants[3:] {
		if p, _ := st.Placements("aggregate").Latest(context.Background(), tenant); p.Shard != "aggregate-1" || p.Phase != schema.PhaseActive {
			t.Fatalf("%s after the cancel: %+v", tenant, p)
		}
	}
}
