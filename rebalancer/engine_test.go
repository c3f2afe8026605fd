package rebalancer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/natsperm"

	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

func openStore(t *testing.T) *schema.Store {
	st, _ := kittest.Store(t)
	return st
}

// startShard runs one stateless shardkit instance of kind aggregate until the test ends.
func startShard(t *testing.T, st *schema.Store, shard string) {
	kittest.Shard(t, shardkit.Config{Store: st, ID: schema.InstanceID{Kind: "aggregate", Shard: shard}})
}

func place(t *testing.T, st *schema.Store, tenant, shard string) schema.Placement {
	t.Helper()
	p, err := st.Placements("aggregate").Create(context.Background(), schema.Placement{Tenant: tenant, Shard: shard})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func planOf(ps ...schema.Placement) *planner.Plan {
	p := &planner.Plan{Strategy: "manual", Concurrency: 4, Waves: 1}
	for _, pl := range ps {
		to := "s-2"
		if pl.Shard == "s-2" {
			to = "s-1"
		}
		p.Moves = append(p.Moves, planner.Move{Kind: "aggregate", Tenant: pl.Tenant, From: pl.Shard, To: to, Revision: pl.Revision, Wave: 1})
	}
	return p
}

func newEngine(t *testing.T, st *schema.Store, cfg Config) *Engine {
	t.Helper()
	cfg.Store = st
	if cfg.Holder == "" {
		cfg.Holder = "r1"
	}
	e, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// history records every placement change of kind aggregate and checks that ownership changes
// only by commit: the owner changes exactly when the epoch grows by one.
type history struct {
	mu      sync.Mutex
	changes []placement.Change
}

func watchHistory(t *testing.T, st *schema.Store) *history {
	h := &history{}
	w, err := placement.New(placement.Config{Store: st, Kinds: []string{"aggregate"}, OnChange: func(c placement.Change) {
		h.mu.Lock()
		h.changes = append(h.changes, c)
		h.mu.Unlock()
	}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	if err := w.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	return h
}

// check requires that every owner change the watcher saw came with the next epoch, into
// draining (a commit) or past it. A placement bucket keeps one revision per key, so a watcher
// can miss a revision overwritten before it read it: with a fast handoff it may see warming ->
// draining. The audit journal has every transition's before and after, and is checked
// exactly: the owner changes only at move.commit, handoff -> draining at the next epoch.
func (h *history) check(t *testing.T, st *schema.Store) {
	t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, c := range h.changes {
		if !c.OldOK || !c.NewOK {
			continue
		}
		if (c.Old.Shard != c.New.Shard) != (c.New.Epoch == c.Old.Epoch+1) {
			t.Errorf("%s: %s@%d (%s) -> %s@%d (%s): owner and epoch changed apart", c.Tenant,
				c.Old.Shard, c.Old.Epoch, c.Old.Phase, c.New.Shard, c.New.Epoch, c.New.Phase)
		}
		if c.Old.Shard != c.New.Shard && c.New.Phase != schema.PhaseDraining && c.New.Phase != schema.PhaseActive {
			t.Errorf("%s: owner changed into %s, not at a commit: %s -> %s", c.Tenant, c.New.Phase, c.Old.Phase, c.New.Phase)
		}
	}
	evs, err := st.Audit().Read(context.Background(), schema.AuditQuery{Limit: 10000})
	if err != nil {
		t.Fatal(err)
	}
	commits := 0
	for _, ev := range evs {
		var before, after schema.Placement
		if !decodeAs(ev.Before, &before) || !decodeAs(ev.After, &after) {
			continue
		}
		commit := before.Phase == schema.PhaseHandoff && after.Phase == schema.PhaseDraining && after.Epoch == before.Epoch+1 ||
			before.Phase == schema.PhaseTakeover && after.Phase == schema.PhaseActive && after.Shard == before.Target && after.Epoch == before.Epoch+1
		if commit && ev.Action == "move.commit" {
			commits++
		}
		if before.Shard != after.Shard && (ev.Action != "move.commit" || !commit) {
			t.Errorf("%s: %s moved the owner %s@%d (%s) -> %s@%d (%s)", ev.Tenant, ev.Action,
				before.Shard, before.Epoch, before.Phase, after.Shard, after.Epoch, after.Phase)
		}
	}
	if commits == 0 {
		t.Error("no move.commit in the audit journal: nothing was checked")
	}
}

// decodeAs re-decodes an audit event's before or after (read back as generic JSON) into v.
func decodeAs(x any, v *schema.Placement) bool {
	b, err := json.Marshal(x)
	return x != nil && err == nil && json.Unmarshal(b, v) == nil && v.Shard != ""
}

func TestApplyMovesTenantsAndAudits(t *testing.T) {
	st := openStore(t)
	startShard(t, st, "s-1")
	startShard(t, st, "s-2")
	h := watchHistory(t, st)
	var ps []schema.Placement
	for i := range 6 {
		ps = append(ps, place(t, st, fmt.Sprintf("t%d", i), "s-1"))
	}
	e := newEngine(t, st, Config{})
	ctx := context.Background()
	rec, err := e.CreatePlan(ctx, planOf(ps...), "test")
	if err != nil {
		t.Fatal(err)
	}
	rec, err = e.Apply(ctx, rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Status != PlanDone {
		t.Fatalf("plan status %s", rec.Status)
	}
	_, moves, _ := e.Plan(ctx, rec.ID)
	for _, m := range moves {
		p, _ := st.Placements("aggregate").Get(ctx, m.Tenant)
		if m.State != MoveDone || p.Shard != "s-2" || p.Epoch != 2 || p.Phase != schema.PhaseActive || p.Move != "" {
			t.Errorf("%s: move %s, placement %+v", m.Tenant, m.State, p)
		}
		if m.Pause() <= 0 {
			t.Errorf("%s: no handoff pause recorded", m.Tenant)
		}
	}
	evs, err := st.Audit().Read(ctx, schema.AuditQuery{Tenant: "t0"})
	if err != nil {
		t.Fatal(err)
	}
	var actions []string
	for _, ev := range evs {
		actions = append(actions, ev.Action)
	}
	if fmt.Sprint(actions) != "[move.warming move.handoff move.commit move.done]" {
		t.Fatalf("audit of t0: %v", actions)
	}
	if evs[2].Actor != "shard/aggregate.s-2.i1" {
		t.Errorf("move.commit by %s, want the target (shard/aggregate.s-2.i1)", evs[2].Actor)
	}
	h.check(t, st)
}

// A target that cannot commit (here: credentials without placement writes; in life, a target
// that died after reporting ready) is committed for by the rebalancer after its grace.
func TestRebalancerCommitsWhenTheTargetCannot(t *testing.T) {
	st, url := kittest.Store(t)
	startShard(t, st, "s-1")
	role := natsperm.Shard("aggregate", "s-2", natsperm.Assets{})
	role.Pub = slices.DeleteFunc(role.Pub, func(s string) bool {
		return strings.HasPrefix(s, jsx.KVSubject(schema.PlacementBucket("aggregate"), ""))
	})
	ctx := context.Background()
	limited, err := schema.Open(ctx, natstest.ConnectAs(t, url, role), schema.Options{Attach: true})
	if err != nil {
		t.Fatal(err)
	}
	kittest.Shard(t, shardkit.Config{Store: limited, ID: schema.InstanceID{Kind: "aggregate", Shard: "s-2"}})
	h := watchHistory(t, st)
	e := newEngine(t, st, Config{})
	rec, err := e.CreatePlan(ctx, planOf(place(t, st, "acme", "s-1")), "test")
	if err != nil {
		t.Fatal(err)
	}
	if rec, err = e.Apply(ctx, rec.ID); err != nil || rec.Status != PlanDone {
		t.Fatalf("apply: %v (%+v)", err, rec)
	}
	evs, err := st.Audit().Read(ctx, schema.AuditQuery{Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	var commits []string
	for _, ev := range evs {
		if ev.Action == "move.commit" {
			commits = append(commits, ev.Actor)
		}
	}
	if fmt.Sprint(commits) != "[rebalancer/r1]" {
		t.Fatalf("move.commit by %v, want [rebalancer/r1]", commits)
	}
	h.check(t, st)
}

var errCrash = errors.New("injected crash")

// TestCrashAtEveryStep stops the engine right after each durable step, then starts a new one
// (a restarted process with the same holder): every move ends done, with one owner at a time.
func TestCrashAtEveryStep(t *testing.T) {
	st := openStore(t)
	startShard(t, st, "s-1")
	startShard(t, st, "s-2")
	h := watchHistory(t, st)
	ctx := context.Background()
	steps := []string{"move.warming", "record.warming", "move.handoff", "record.handoff", "record.committed", "move.done", "record.done"}
	for i, step := range steps {
		t.Run(step, func(t *testing.T) {
			p := place(t, st, fmt.Sprintf("crash%d", i), "s-1")
			crashing := newEngine(t, st, Config{afterStep: func(s string) error {
				if s == step {
					return errCrash
				}
				return nil
			}})
			rec, err := crashing.CreatePlan(ctx, planOf(p), "test")
			if err != nil {
				t.Fatal(err)
			}
			if _, err := crashing.Apply(ctx, rec.ID); !errors.Is(err, errCrash) {
				_, ms, _ := crashing.Plan(ctx, rec.ID)
				t.Fatalf("apply with a crash at %s: %v (move %+v)", step, err, ms)
			}
			restarted := newEngine(t, st, Config{})
			if _, err := restarted.Apply(ctx, rec.ID); err != nil {
				t.Fatalf("resume after a crash at %s: %v", step, err)
			}
			_, moves, _ := restarted.Plan(ctx, rec.ID)
			got, _ := st.Placements("aggregate").Get(ctx, p.Tenant)
			if moves[0].State != MoveDone || got.Shard != "s-2" || got.Epoch != 2 || got.Phase != schema.PhaseActive {
				t.Fatalf("after resume: move %s (%s), placement %s@%d %s", moves[0].State, moves[0].Reason, got.Shard, got.Epoch, got.Phase)
			}
		})
	}
	h.check(t, st)
}

func TestSecondRebalancerRefuses(t *testing.T) {
	st := openStore(t)
	ctx := context.Background()
	p := place(t, st, "acme", "s-1")
	a := newEngine(t, st, Config{Holder: "r1"})
	lctx, stop, err := a.lead(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	_ = lctx
	b := newEngine(t, st, Config{Holder: "r2"})
	rec, err := b.CreatePlan(ctx, planOf(p), "test")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Apply(ctx, rec.ID); !errors.Is(err, schema.ErrLeaseHeld) {
		t.Fatalf("second rebalancer: %v, want ErrLeaseHeld", err)
	}
	if _, err := b.Rollback(ctx, rec.ID); !errors.Is(err, schema.ErrLeaseHeld) {
		t.Fatalf("second rebalancer rollback: %v, want ErrLeaseHeld", err)
	}
	if got, _ := st.Placements("aggregate").Get(ctx, "acme"); got.Phase != schema.PhaseActive || got.Shard != "s-1" {
		t.Fatalf("placement touched: %+v", got)
	}
}

func TestRollbackRestoresPlacement(t *testing.T) {
	st := openStore(t)
	startShard(t, st, "s-1")
	startShard(t, st, "s-2")
	ctx := context.Background()
	ps := []schema.Placement{place(t, st, "a", "s-1"), place(t, st, "b", "s-1"), place(t, st, "c", "s-2")}
	e := newEngine(t, st, Config{})
	rec, _ := e.CreatePlan(ctx, planOf(ps...), "test")
	if done, err := e.Apply(ctx, rec.ID); err != nil || done.Status != PlanDone {
		_, ms, _ := e.Plan(ctx, rec.ID)
		t.Fatalf("apply: %v %+v: moves %+v", err, done, ms)
	}
	rb, err := e.Rollback(ctx, rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	if rb.RollbackOf != rec.ID || rb.Status != PlanDone {
		_, ms, _ := e.Plan(ctx, rb.ID)
		t.Fatalf("rollback plan %+v: moves %+v", rb, ms)
	}
	for _, p := range ps {
		got, _ := st.Placements("aggregate").Get(ctx, p.Tenant)
		if got.Shard != p.Shard || got.Phase != schema.PhaseActive || got.Epoch != 3 {
			t.Errorf("%s after rollback: %s@%d %s, want %s@3 active", p.Tenant, got.Shard, got.Epoch, got.Phase, p.Shard)
		}
	}
	orig, _, _ := e.Plan(ctx, rec.ID)
	if orig.Status != PlanRolledBack || orig.RolledBackBy != rb.ID {
		t.Fatalf("original plan after rollback: %+v", orig)
	}
}

func TestMoveSkippedWhenTenantChanged(t *testing.T) {
	st := openStore(t)
	ctx := context.Background()
	p := place(t, st, "acme", "s-1")
	e := newEngine(t, st, Config{})
	rec, _ := e.CreatePlan(ctx, planOf(p), "test")
	// An operator pins the tenant after the plan was made: the move must not happen.
	np := p
	np.Pinned = true
	if _, err := st.Placements(np.Kind).Update(ctx, p, np); err != nil {
		t.Fatal(err)
	}
	rec, err := e.Apply(ctx, rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	_, moves, _ := e.Plan(ctx, rec.ID)
	if rec.Status != PlanPartial || moves[0].State != MoveSkipped || moves[0].Reason == "" {
		t.Fatalf("plan %s, move %s (%s)", rec.Status, moves[0].State, moves[0].Reason)
	}
}

func TestWarmTimeoutAborts(t *testing.T) {
	st := openStore(t)
	startShard(t, st, "s-1") // no instance of s-2: it can never be ready
	ctx := context.Background()
	p := place(t, st, "acme", "s-1")
	e := newEngine(t, st, Config{WarmTimeout: 300 * time.Millisecond})
	rec, _ := e.CreatePlan(ctx, planOf(p), "test")
	if _, err := e.Apply(ctx, rec.ID); err != nil {
		t.Fatal(err)
	}
	_, moves, _ := e.Plan(ctx, rec.ID)
	got, _ := st.Placements("aggregate").Get(ctx, "acme")
	if moves[0].State != MoveAborted || got.Shard != "s-1" || got.Phase != schema.PhaseActive || got.Epoch != 1 {
		t.Fatalf("move %s (%s), placement %+v", moves[0].State, moves[0].Reason, got)
	}
}

// TestMoveOffDeadShard moves a tenant whose shard has no instance at all. Without Presence the
// engine cannot tell that nothing serves the tenant there, and the source never drains: the
// move aborts at the handoff timeout (it used to commit with fence 0, on the guess that nothing
// was in flight, which a frozen source breaks). With Presence the move becomes a takeover and
// commits as soon as the target is ready: no instance of the source is registered, so none can
// serve.
func TestMoveOffDeadShard(t *testing.T) {
	st := openStore(t)
	startShard(t, st, "s-2") // s-1 has no instance at all
	ctx := context.Background()
	p := place(t, st, "orphan", "s-1")
	e := newEngine(t, st, Config{HandoffTimeout: 2 * time.Second})
	rec, _ := e.CreatePlan(ctx, planOf(p), "test")
	if _, err := e.Apply(ctx, rec.ID); err != nil {
		t.Fatal(err)
	}
	_, moves, _ := e.Plan(ctx, rec.ID)
	got, _ := st.Placements("aggregate").Latest(ctx, "orphan")
	if moves[0].State != MoveAborted || got.Shard != "s-1" || got.Phase != schema.PhaseActive || got.Epoch != 1 {
		t.Fatalf("without presence: move %s (%s), placement %s@%d %s", moves[0].State, moves[0].Reason, got.Shard, got.Epoch, got.Phase)
	}

	e = newEngine(t, st, Config{HandoffTimeout: 5 * time.Second, Presence: runPresence(t, st)})
	rec, _ = e.CreatePlan(ctx, planOf(got), "test")
	if _, err := e.Apply(ctx, rec.ID); err != nil {
		t.Fatal(err)
	}
	_, moves, _ = e.Plan(ctx, rec.ID)
	got, _ = st.Placements("aggregate").Latest(ctx, "orphan")
	if m := moves[0]; m.State != MoveDone || !m.Takeover || !strings.Contains(m.Fenced, "gone") || got.Shard != "s-2" || got.Epoch != 2 || got.Phase != schema.PhaseActive {
		t.Fatalf("with presence: move %s takeover=%v fenced %q (%s), placement %s@%d %s", m.State, m.Takeover, m.Fenced, m.Reason, got.Shard, got.Epoch, got.Phase)
	}
}

// runPresence runs a Presence until the test ends, once it has read the memberships.
func runPresence(t *testing.T, st *schema.Store) *Presence {
	t.Helper()
	pr := NewPresence(st, PresenceConfig{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = pr.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	deadline := time.Now().Add(10 * time.Second)
	for !pr.Ready() {
		select {
		case <-pr.Changed():
		case <-time.After(time.Until(deadline)):
			t.Fatal("presence did not read the memberships within 10s")
		}
	}
	return pr
}

// scripted is a move's two shards played by the test, one live instance each (src on s-1, dst
// on s-2), with no shardkit behind them: the target reports ready when the move starts warming,
// and onHandoff runs when the placement reaches handoff.
type scripted struct {
	t        *testing.T
	st       *schema.Store
	ctx      context.Context
	src, dst schema.InstanceID
}

func scriptShards(t *testing.T, st *schema.Store, ctx context.Context, onHandoff func(*scripted, schema.Placement)) *scripted {
	t.Helper()
	sc := &scripted{t: t, st: st, ctx: ctx, src: schema.InstanceID{Kind: "aggregate", Shard: "s-1", Instance: "a"},
		dst: schema.InstanceID{Kind: "aggregate", Shard: "s-2", Instance: "b"}}
	for _, id := range []schema.InstanceID{sc.src, sc.dst} {
		now := time.Now().UTC()
		if _, err := st.Directory().Register(ctx, schema.Instance{InstanceID: id, URL: "http://127.0.0.1:1", Capacity: 1,
			Started: now, Heartbeat: now, Reported: schema.StatusOnline}); err != nil {
			t.Fatal(err)
		}
	}
	changes := make(chan placement.Change, 16)
	w, err := placement.New(placement.Config{Store: st, Kinds: []string{"aggregate"}, OnChange: func(c placement.Change) { changes <- c }})
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	wg.Go(func() { _ = w.Run(wctx) })
	if err := w.WaitReady(wctx); err != nil {
		t.Fatal(err)
	}
	wg.Go(func() {
		for {
			var c placement.Change
			select {
			case <-wctx.Done():
				return
			case c = <-changes:
			}
			if !c.NewOK || c.Tenant != "acme" {
				continue
			}
			switch c.New.Phase {
			case schema.PhaseWarming:
				sc.signal(sc.dst, schema.SignalReady, c.New.Epoch)
			case schema.PhaseHandoff:
				cur, err := st.Placements("aggregate").Latest(wctx, "acme")
				if err != nil {
					t.Error(err)
					return
				}
				onHandoff(sc, cur)
			}
		}
	})
	return sc
}

func (sc *scripted) signal(id schema.InstanceID, phase schema.SignalPhase, epoch uint64) {
	if _, err := sc.st.Signals().Put(sc.ctx, schema.TenantSignal{Kind: id.Kind, Tenant: "acme", Shard: id.Shard, Instance: id.Instance,
		Phase: phase, Epoch: epoch}); err != nil {
		sc.t.Error(err)
	}
}

// TestHandoffSeesACommitThatOutranTheFence: a target may commit, and the source report drained
// at the commit's epoch, before the rebalancer saw the source's drained at the handoff's epoch
// (a signal is one key per instance: the later write replaces the earlier). Scripted shards
// here never write the earlier one at all. The engine must take the commit as the handoff's
// end, not wait out its HandoffTimeout (the scale harness saw moves finish 10 s late so).
func TestHandoffSeesACommitThatOutranTheFence(t *testing.T) {
	st := openStore(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	scriptShards(t, st, ctx, func(sc *scripted, cur schema.Placement) {
		next := schema.Placement{Kind: cur.Kind, Tenant: cur.Tenant, Shard: cur.Target, Epoch: cur.Epoch + 1,
			Phase: schema.PhaseDraining, Source: cur.Shard, Move: cur.Move, UpdatedBy: "shard/" + sc.dst.Key()}
		if _, err := st.Placements(next.Kind).Update(ctx, cur, next); err != nil {
			t.Error(err)
			return
		}
		sc.signal(sc.src, schema.SignalDrained, next.Epoch) // drained at the handoff's epoch never shows
	})
	e := newEngine(t, st, Config{HandoffTimeout: time.Minute, WarmTimeout: time.Minute})
	rec, err := e.CreatePlan(ctx, planOf(place(t, st, "acme", "s-1")), "test")
	if err != nil {
		t.Fatal(err)
	}
	if rec, err = e.Apply(ctx, rec.ID); err != nil || rec.Status != PlanDone {
		t.Fatalf("apply: %v (%s); the engine should have taken the commit as the handoff's end", err, rec.Status)
	}
	_, moves, err := e.Plan(ctx, rec.ID)
	if err != nil || moves[0].State != MoveDone || moves[0].Reason != "" {
		t.Fatalf("move: %+v, %v", moves, err)
	}
}

// TestStaleReleasedSignalDoesNotCommit: a source's "drained at the next epoch" left over from
// an earlier life of the tenant is not taken for a commit. Here the source never drains at the
// handoff's epoch, so the move must abort at HandoffTimeout with the tenant on its source; had
// the engine trusted the stale signal, it would have committed after its commit grace.
func TestStaleReleasedSignalDoesNotCommit(t *testing.T) {
	st := openStore(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p := place(t, st, "acme", "s-1")
	sc := scriptShards(t, st, ctx, func(*scripted, schema.Placement) {}) // the source never drains
	sc.signal(sc.src, schema.SignalDrained, p.Epoch+1)
	e := newEngine(t, st, Config{HandoffTimeout: 3 * time.Second, WarmTimeout: time.Minute})
	rec, err := e.CreatePlan(ctx, planOf(p), "test")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Apply(ctx, rec.ID); err != nil {
		t.Fatal(err)
	}
	_, moves, err := e.Plan(ctx, rec.ID)
	if err != nil || moves[0].State != MoveAborted {
		t.Fatalf("move: %+v, %v; want aborted at the handoff timeout", moves, err)
	}
	got, err := st.Placements("aggregate").Latest(ctx, "acme")
	if err != nil || got.Shard != "s-1" || got.Epoch != p.Epoch {
		t.Fatalf("placement %+v, %v; want s-1 at epoch %d", got, err, p.Epoch)
	}
}

// takeoverPlan is a failover plan of one move per placement, off s-1 onto s-2.
func takeoverPlan(ps ...schema.Placement) *planner.Plan {
	p := planOf(ps...)
	p.Strategy = planner.StrategyFailover
	for i := range p.Moves {
		p.Moves[i].Takeover = true
	}
	return p
}

// crashedShard runs an aggregate instance of shard on a NATS connection of its own and
// returns a function that kills it as a process death does: the connection closes, nothing
// is unregistered.
func crashedShard(t *testing.T, url, shard string) (kill func()) {
	t.Helper()
	st := kittest.StoreAt(t, url)
	kittest.Shard(t, shardkit.Config{Store: st, ID: schema.InstanceID{Kind: "aggregate", Shard: shard, Instance: "dead"}})
	return func() { st.JS().Conn().Close() }
}

// TestTakeoverCrashAtEveryStep fails over tenants of a shard whose only instance died (its
// connection closed): the engine stops right after each durable step of the takeover and a
// restarted one finishes it. Every move ends done on s-2 at the next epoch, the owner changes
// only at the commit, and the commit never comes before the target is ready.
func TestTakeoverCrashAtEveryStep(t *testing.T) {
	st, url := kittest.Store(t)
	startShard(t, st, "s-2")
	kill := crashedShard(t, url, "s-1")
	h := watchHistory(t, st)
	ctx := context.Background()
	var ps []schema.Placement
	steps := []string{"move.takeover", "record.takeover", "move.commit", "record.done"}
	for i := range steps {
		ps = append(ps, place(t, st, fmt.Sprintf("orphan%d", i), "s-1"))
	}
	kill()
	pr := runPresence(t, st)
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("s-1 gone", func() bool { return pr.Shard("aggregate", "s-1").Down() }))
	for i, step := range steps {
		t.Run(step, func(t *testing.T) {
			crashing := newEngine(t, st, Config{Presence: pr, afterStep: func(s string) error {
				if s == step {
					return errCrash
				}
				return nil
			}})
			rec, err := crashing.CreatePlan(ctx, takeoverPlan(ps[i]), "test")
			if err != nil {
				t.Fatal(err)
			}
			if _, err := crashing.Apply(ctx, rec.ID); !errors.Is(err, errCrash) {
				_, ms, _ := crashing.Plan(ctx, rec.ID)
				t.Fatalf("apply with a crash at %s: %v (move %+v)", step, err, ms)
			}
			restarted := newEngine(t, st, Config{Presence: pr})
			if _, err := restarted.Apply(ctx, rec.ID); err != nil {
				t.Fatalf("resume after a crash at %s: %v", step, err)
			}
			_, moves, _ := restarted.Plan(ctx, rec.ID)
			got, _ := st.Placements("aggregate").Latest(ctx, ps[i].Tenant)
			if m := moves[0]; m.State != MoveDone || !m.Takeover || got.Shard != "s-2" || got.Epoch != 2 || got.Phase != schema.PhaseActive {
				t.Fatalf("after resume: move %s takeover=%v (%s), placement %s@%d %s", m.State, m.Takeover, m.Reason, got.Shard, got.Epoch, got.Phase)
			}
		})
	}
	h.check(t, st)
}

// TestTakeoverWaitsOutTheLease fails over a tenant whose source instance is alive but silent
// (its connection open, as a frozen process's): without a drained signal and without the
// instance gone, the commit waits until the source's lease ran out since the takeover began.
// Presence is left out, as in the CLI's apply, so the lease is the only way out.
func TestTakeoverWaitsOutTheLease(t *testing.T) {
	st, _ := kittest.Store(t)
	kc := schema.DefaultKindConfig("aggregate")
	kc.Lease = schema.Duration(time.Second)
	if _, err := st.Kinds().Put(context.Background(), kc); err != nil {
		t.Fatal(err)
	}
	startShard(t, st, "s-2")
	ctx := context.Background()
	p := place(t, st, "frozen", "s-1")
	// s-1's instance: registered with a lease of 3s, never answers (no shardkit behind it: it
	// reports no signal, as a frozen process reports none).
	if _, err := st.Directory().Register(ctx, schema.Instance{InstanceID: schema.InstanceID{Kind: "aggregate", Shard: "s-1", Instance: "frozen"},
		URL: "http://127.0.0.1:1", Capacity: 10, Started: time.Now().UTC(), Heartbeat: time.Now().UTC(), Reported: schema.StatusOnline, LeaseMS: 3000}); err != nil {
		t.Fatal(err)
	}
	e := newEngine(t, st, Config{})
	rec, _ := e.CreatePlan(ctx, takeoverPlan(p), "test")
	start := time.Now()
	if _, err := e.Apply(ctx, rec.ID); err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	_, moves, _ := e.Plan(ctx, rec.ID)
	got, _ := st.Placements("aggregate").Latest(ctx, p.Tenant)
	if m := moves[0]; m.State != MoveDone || !strings.Contains(m.Fenced, "lease (3s) ran out") || got.Shard != "s-2" || got.Epoch != 2 {
		t.Fatalf("move %s fenced %q (%s), placement %s@%d", m.State, m.Fenced, m.Reason, got.Shard, got.Epoch)
	}
	// The instance registered a lease of 3s, longer than the kind's 1s: the longer one counts.
	if took < 3*time.Second {
		t.Fatalf("committed %s after the takeover began: before the source's 3s lease ran out", took)
	}
}
