// Package autopilot is the rebalancer deciding for itself: detectors that watch the fleet and
// make ordinary plans, applied by the same engine as an operator's, under guardrails.
//
// # Overview
//
// The leader of `rebalance serve` runs an [Autopilot]. Its detectors:
//
//   - failover: a shard that owns tenants has no live instance (rebalancer.Presence: its
//     instances' connections closed, or they have been silent for DeadAfter). Its tenants are
//     taken over by the live shards (planner.Failover; every move a takeover, see
//     rebalancer/takeover.go). It runs every Tick, in a lane of its own, and no guardrail but
//     the mode stops it;
//   - retake: a tenant held in a takeover whose move ended without committing (its target had
//     no live instance) while its source is live again (a partition healed): nothing else
//     would move it, so it is taken over again to a live shard (planner.Retake), every
//     Every, in the failover lane and under the same rules (see retake.go);
//   - evacuate: an operator marked a shard for maintenance; it is emptied;
//   - fill: a live shard owns no tenant while others do, for Sustain;
//   - balance: a kind's max/mean utilisation has been above 1+Trigger for Sustain, or above
//     1+Tolerance for Settle (a slow drift the trigger would never catch); the plan brings it
//     to 1+Tolerance (the gap between what starts a plan and where it ends is the hysteresis
//     that keeps it from flapping).
//
// Every plan says what triggered it (rebalancer.Trigger: the detector, the figure it measured
// and the threshold it crossed) and each of its moves the goal it serves (planner.Move.Goal).
// The guardrails, for all but failover: the mode (off, dry-run: plans are stored as proposals
// and never applied, on); a change freeze in force; maintenance windows (when set, balance and
// fill wait for one); a budget of moves and bytes per Window (failover counts, never blocks);
// a per-tenant cool-down (no tenant is moved by the autopilot twice within it, failover
// excepted); one autopilot plan at a time; an operator's plan always first (the autopilot
// waits for it, and pauses its own plan when one starts); and the engine's pause budget.
// Each decision, and each block, is logged, audited (autopilot.plan, autopilot.blocked),
// counted (tm_autopilot_*) and listed in Status.
package autopilot

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Mode is what the autopilot does with what its detectors find.
type Mode string

const (
	// Off: the autopilot decides nothing, failover included.
	Off Mode = "off"
	// DryRun: it makes and stores its plans as proposals (rebalancer.PlanRecord.Proposed),
	// which an operator may apply; it applies none. A new deployment starts here.
	DryRun Mode = "dry-run"
	// On: it applies its plans.
	On Mode = "on"
)

// ParseMode parses off, dry-run or on.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(s); m {
	case Off, DryRun, On:
		return m, nil
	}
	return "", fmt.Errorf("autopilot: mode %q is not one of off, dry-run, on", s)
}

// Config configures an Autopilot. Zero fields take the defaults beside them.
type Config struct {
	// Mode: default dry-run.
	Mode Mode `json:"mode"`
	// MaxMoves and MaxBytes bound the autopilot's moves per Window (failover counts towards
	// them but is never stopped by them). Defaults 60 moves, 10 GiB, 1h.
	MaxMoves int           `json:"max_moves"`
	MaxBytes uint64        `json:"max_bytes"`
	Window   time.Duration `json:"window"`
	// Cooldown: no tenant is moved by the autopilot twice within it (failover excepted).
	// Default 30m.
	Cooldown time.Duration `json:"cooldown"`
	// Tolerance is what a balance plan aims for (max/mean utilisation at most 1+Tolerance);
	// Trigger what starts one (above 1+Trigger for Sustain). Defaults 0.1 and 0.25; Trigger
	// is at least Tolerance (the gap is the hysteresis).
	Tolerance float64 `json:"tolerance"`
	Trigger   float64 `json:"trigger"`
	// Sustain is how long imbalance, or an empty shard, must hold before a plan. Default 5m.
	Sustain time.Duration `json:"sustain"`
	// Settle is how long a kind may stay above 1+Tolerance (but under the trigger) before a
	// balance plan brings it back within. Default 4 x Sustain.
	Settle time.Duration `json:"settle"`
	// MaxPlanMoves bounds one balance or fill plan. Default 20.
	MaxPlanMoves int `json:"max_plan_moves"`
	// Concurrency of balance, fill and evacuate plans (default 4) and of failover plans
	// (default 64: takeovers mostly wait out a lease, all at once).
	Concurrency         int `json:"concurrency"`
	FailoverConcurrency int `json:"failover_concurrency"`
	// Windows, if any, are when balance and fill may run (maintenance windows).
	Windows []Window `json:"-"`
	// Tick is how often failover looks (default 250ms); Every how often the other detectors
	// do (default 5s).
	Tick  time.Duration `json:"tick"`
	Every time.Duration `json:"every"`
	// Startup is how long a new leader waits before deciding anything, so instances starting
	// beside it can register. Default 10s.
	Startup time.Duration `json:"startup"`
	// Actor names the autopilot in plans and the audit journal. Default "autopilot".
	Actor      string                `json:"-"`
	Logger     *slog.Logger          `json:"-"`
	Registerer prometheus.Registerer `json:"-"`
}

func (c Config) withDefaults() Config {
	if c.Mode == "" {
		c.Mode = DryRun
	}
	if c.MaxMoves <= 0 {
		c.MaxMoves = 60
	}
	if c.MaxBytes == 0 {
		c.MaxBytes = 10 << 30
	}
	if c.Window <= 0 {
		c.Window = time.Hour
	}
	if c.Cooldown <= 0 {
		c.Cooldown = 30 * time.Minute
	}
	if c.Tolerance <= 0 {
		c.Tolerance = 0.1
	}
	if c.Trigger <= 0 {
		c.Trigger = 0.25
	}
	c.Trigger = max(c.Trigger, c.Tolerance)
	if c.Sustain <= 0 {
		c.Sustain = 5 * time.Minute
	}
	if c.Settle <= 0 {
		c.Settle = 4 * c.Sustain
	}
	c.Settle = max(c.Settle, c.Sustain)
	if c.MaxPlanMoves <= 0 {
		c.MaxPlanMoves = 20
	}
	if c.Concurrency <= 0 {
		c.Concurrency = 4
	}
	if c.FailoverConcurrency <= 0 {
		c.FailoverConcurrency = 64
	}
	if c.Tick <= 0 {
		c.Tick = 250 * time.Millisecond
	}
	if c.Every <= 0 {
		c.Every = 5 * time.Second
	}
	if c.Startup <= 0 {
		c.Startup = 10 * time.Second
	}
	if c.Actor == "" {
		c.Actor = "autopilot"
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// Deps are what the autopilot works with; the server provides them.
type Deps struct {
	Store     *schema.Store
	Engine    *rebalancer.Engine
	Presence  *rebalancer.Presence
	Telemetry *rebalancer.Telemetry
	// ShardTenants, if set, counts the tenants each shard of kind owns from a placement
	// watcher (the leader's); without it failover lists the kind's placements each tick.
	ShardTenants func(kind string) map[string]int
	// Takeovers, if set, calls fn with each of kind's tenants in a takeover and its source
	// (until fn returns false) from a placement watcher (the leader's), and reports whether it
	// could; without it retake lists the kind's placements.
	Takeovers func(kind string, fn func(tenant, source string) bool) bool
	// OperatorBusy reports the plan an operator is applying ("" if none): the autopilot's
	// plans wait for it.
	OperatorBusy func() string
	// Apply applies a plan and returns how it ended (default Engine.Apply): the server's
	// starts it again while NATS interrupts it.
	Apply func(ctx context.Context, id string) (rebalancer.PlanRecord, error)
}

// Autopilot runs the detectors and applies their plans. Make it with New; the leader calls
// Run while it leads.
type Autopilot struct {
	cfg Config
	d   Deps
	m   *metrics

	mu        sync.Mutex
	decisions []Decision
	failing   map[string]string    // kind/shard -> the failover plan under way
	retryAt   map[string]time.Time // kind/shard -> when failover may plan it again
	proposed  map[string]time.Time // detector/subject -> when dry-run proposed it
	since     map[string]time.Time // detector/subject -> when its condition began
	running   string               // the balance/fill/evacuate plan under way ("": none)
	yielded   string               // that plan, paused for an operator's
	leading   bool
	start     time.Time      // when this leader's autopilot started (it decides from start+Startup)
	down      map[string]int // kind -> tenants on shards without a live instance (last look)
	stuck     map[string]int // kind -> tenants held in a takeover no move drives (last look)
	work      sync.WaitGroup
	now       func() time.Time // the detectors' clock (time.Now; a test's own)
}

// Decision is one thing the autopilot decided, or was stopped from doing.
type Decision struct {
	Time     time.Time `json:"time"`
	Detector string    `json:"detector"`
	Subject  string    `json:"subject"`
	// Outcome is applied, proposed (dry-run), blocked (a guardrail: Guardrail says which),
	// done, partial, failed or yielded.
	Outcome   string `json:"outcome"`
	Guardrail string `json:"guardrail,omitempty"`
	Detail    string `json:"detail"`
	Plan      string `json:"plan,omitempty"`
}

// maxDecisions bounds the decisions Status lists.
const maxDecisions = 200

// New makes an autopilot.
func New(cfg Config, d Deps) (*Autopilot, error) {
	if d.Store == nil || d.Engine == nil || d.Presence == nil {
		return nil, errors.New("autopilot: Store, Engine and Presence are required")
	}
	cfg = cfg.withDefaults()
	if _, err := ParseMode(string(cfg.Mode)); err != nil {
		return nil, err
	}
	if d.Apply == nil {
		d.Apply = d.Engine.Apply
	}
	a := &Autopilot{cfg: cfg, d: d, failing: map[string]string{}, retryAt: map[string]time.Time{}, proposed: map[string]time.Time{},
		since: map[string]time.Time{}, down: map[string]int{}, stuck: map[string]int{}, now: time.Now}
	a.m = newMetrics(cfg.Registerer, a)
	return a, nil
}

// SetTelemetry gives the detectors the load reports (the server subscribes to them once it
// starts).
func (a *Autopilot) SetTelemetry(t *rebalancer.Telemetry) {
	a.mu.Lock()
	a.d.Telemetry = t
	a.mu.Unlock()
}

func (a *Autopilot) telemetry() *rebalancer.Telemetry {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.d.Telemetry
}

// Config is the autopilot's configuration with its defaults: its guardrails, as shown.
func (a *Autopilot) Config() Config { return a.cfg }

// Run decides until ctx ends (the leader's context), then waits for the plans it applies to
// stop (they stop at their next step and resume under the next leader).
func (a *Autopilot) Run(ctx context.Context) error {
	start := time.Now()
	a.mu.Lock()
	a.leading, a.start = true, start
	a.mu.Unlock()
	defer func() {
		a.work.Wait()
		a.mu.Lock()
		a.leading, a.failing, a.running, a.yielded = false, map[string]string{}, "", ""
		a.mu.Unlock()
	}()
	a.cfg.Logger.Info("autopilot leading", "mode", a.cfg.Mode, "max_moves", a.cfg.MaxMoves, "window", a.cfg.Window,
		"cooldown", a.cfg.Cooldown, "trigger", a.cfg.Trigger, "tolerance", a.cfg.Tolerance, "sustain", a.cfg.Sustain)
	tick := time.NewTicker(a.cfg.Tick)
	defer tick.Stop()
	var last time.Time
	for {
		select {
		case <-tick.C:
		case <-a.d.Presence.Changed():
		case <-ctx.Done():
			return nil
		}
		warm := time.Since(start) >= a.cfg.Startup
		a.lookForDeadShards(ctx, warm)
		if warm && time.Since(last) >= a.cfg.Every {
			last = time.Now()
			a.lookForHeldTakeovers(ctx)
			a.rearrange(ctx)
		}
	}
}

// decide records d: the decision log, the audit journal, the log and the metrics.
func (a *Autopilot) decide(ctx context.Context, d Decision) {
	d.Time = time.Now().UTC()
	a.mu.Lock()
	a.decisions = append(a.decisions, d)
	if len(a.decisions) > maxDecisions {
		a.decisions = slices.Delete(a.decisions, 0, len(a.decisions)-maxDecisions)
	}
	a.mu.Unlock()
	a.m.decisions.WithLabelValues(d.Detector, d.Outcome).Inc()
	if d.Outcome == "blocked" {
		a.m.blocked.WithLabelValues(d.Detector, d.Guardrail).Inc()
	}
	action := "autopilot." + d.Outcome
	if d.Outcome == "applied" || d.Outcome == "proposed" {
		action = "autopilot.plan"
	}
	kind, _, _ := strings.Cut(d.Subject, "/")
	if err := a.d.Store.Audit().Append(ctx, schema.AuditEvent{Actor: a.cfg.Actor, Action: action, Kind: kind, Plan: d.Plan,
		Detail: fmt.Sprintf("%s %s: %s%s", d.Detector, d.Subject, d.Detail, guard(d.Guardrail))}); err != nil && ctx.Err() == nil {
		a.cfg.Logger.Warn("audit failed", "action", action, "err", err)
	}
	level := slog.LevelInfo
	if d.Outcome == "blocked" || d.Outcome == "failed" {
		level = slog.LevelWarn
	}
	a.cfg.Logger.Log(ctx, level, "autopilot "+d.Outcome, "detector", d.Detector, "subject", d.Subject, "detail", d.Detail,
		"guardrail", d.Guardrail, "plan", d.Plan)
}

func guard(g string) string {
	if g == "" {
		return ""
	}
	return " (guardrail: " + g + ")"
}

// lookForDeadShards is the failover detector: for every kind whose failover is auto, the shards
// that own tenants and have no live instance get a failover plan, once at a time.
func (a *Autopilot) lookForDeadShards(ctx context.Context, warm bool) {
	if !a.d.Presence.Ready() {
		return
	}
	kcs, err := a.d.Store.Kinds().List(ctx)
	if err != nil {
		return
	}
	down := map[string]int{}
	for _, kc := range kcs {
		if kc.Policy != schema.PolicyManaged {
			continue // affinity and load kinds: the gateway reassigns their tenants itself
		}
		counts := a.shardTenants(ctx, kc.Kind)
		for _, shard := range slices.Sorted(maps.Keys(counts)) {
			n := counts[shard]
			sp := a.d.Presence.Shard(kc.Kind, shard)
			if n == 0 || !sp.Down() {
				continue
			}
			down[kc.Kind] += n
			if warm && kc.Failover == schema.FailoverAuto {
				a.failover(ctx, kc.Kind, shard, n, sp)
			}
		}
	}
	a.mu.Lock()
	for k := range a.down {
		if _, ok := down[k]; !ok {
			a.down[k] = 0
		}
	}
	maps.Copy(a.down, down)
	a.mu.Unlock()
}

// shardTenants counts kind's tenants per shard.
func (a *Autopilot) shardTenants(ctx context.Context, kind string) map[string]int {
	if a.d.ShardTenants != nil {
		if c := a.d.ShardTenants(kind); c != nil {
			return c
		}
	}
	pls, _, err := a.d.Store.Placements(kind).List(ctx)
	if err != nil {
		return nil
	}
	out := map[string]int{}
	for _, p := range pls {
		out[p.Shard]++
	}
	return out
}

// failover plans and applies (or proposes) taking over kind's dead shard's n tenants.
func (a *Autopilot) failover(ctx context.Context, kind, shard string, n int, sp rebalancer.ShardPresence) {
	subject := kind + "/" + shard
	a.mu.Lock()
	_, busy := a.failing[subject]
	_, retaking := a.failing[kind] // a retake of the kind: its plan may hold this shard's tenants
	busy = busy || retaking
	proposedAt, proposed := a.proposed["failover/"+subject]
	wait := time.Now().Before(a.retryAt[subject])
	a.mu.Unlock()
	if busy || wait || a.cfg.Mode == Off {
		return
	}
	if proposed && time.Since(proposedAt) < 10*time.Minute {
		return
	}
	trig := rebalancer.Trigger{Detector: "failover", Subject: subject, Since: sp.Since,
		Figure:    fmt.Sprintf("no live instance: %d registered, %d gone (connection closed), %d silent; %d tenants", sp.Registered, sp.Gone, sp.Silent, n),
		Threshold: fmt.Sprintf("every instance gone, or silent for %s and not answering probes", a.d.Presence.Config().DeadAfter)}
	w, err := rebalancer.BuildWorld(ctx, a.d.Store, kind, rebalancer.WorldOptions{Telemetry: a.telemetry(), Dead: a.d.Presence.Dead})
	if err != nil {
		a.retry(subject, 2*time.Second)
		a.decide(ctx, Decision{Detector: "failover", Subject: subject, Outcome: "failed", Detail: "reading the kind: " + err.Error()})
		return
	}
	p, err := planner.Failover(w, []string{shard}, planner.Options{Concurrency: a.cfg.FailoverConcurrency})
	if err == nil && len(p.Moves) == 0 {
		err = fmt.Errorf("no tenant can be taken over: %s", strings.Join(p.Notes, "; "))
	}
	if err != nil {
		a.retry(subject, 10*time.Second)
		a.decide(ctx, Decision{Detector: "failover", Subject: subject, Outcome: "blocked", Guardrail: "no room", Detail: err.Error()})
		return
	}
	a.apply(ctx, "failover", subject, trig, p, true)
}

// retry holds failover of subject back for d.
func (a *Autopilot) retry(subject string, d time.Duration) {
	a.mu.Lock()
	a.retryAt[subject] = time.Now().Add(d)
	a.mu.Unlock()
}

// apply stores p as the autopilot's plan for trig and applies it in the background (failover:
// in its own lane), or only stores it as a proposal in dry-run mode.
func (a *Autopilot) apply(ctx context.Context, detector, subject string, trig rebalancer.Trigger, p *planner.Plan, failover bool) {
	dry := a.cfg.Mode == DryRun
	rec, _, err := a.d.Engine.StorePlan(ctx, rebalancer.PlanRecord{Actor: a.cfg.Actor, Origin: "autopilot", Trigger: &trig, Proposed: dry, Plan: *p})
	if err != nil {
		a.decide(ctx, Decision{Detector: detector, Subject: subject, Outcome: "failed", Detail: "storing the plan: " + err.Error()})
		return
	}
	detail := fmt.Sprintf("%s; %d moves (%s)", trig.Figure, len(p.Moves), trig.Threshold)
	if dry {
		a.mu.Lock()
		a.proposed[detector+"/"+subject] = time.Now()
		a.mu.Unlock()
		a.decide(ctx, Decision{Detector: detector, Subject: subject, Outcome: "proposed", Detail: detail + "; dry-run: apply it with `rebalance apply " + rec.ID + "`", Plan: rec.ID})
		return
	}
	a.mu.Lock()
	if failover {
		a.failing[subject] = rec.ID
	} else {
		a.running = rec.ID
	}
	a.mu.Unlock()
	a.decide(ctx, Decision{Detector: detector, Subject: subject, Outcome: "applied", Detail: detail, Plan: rec.ID})
	a.work.Go(func() { a.run(ctx, detector, subject, rec, failover) })
}

// run applies rec and records how it ended.
func (a *Autopilot) run(ctx context.Context, detector, subject string, rec rebalancer.PlanRecord, failover bool) {
	start := time.Now()
	got, err := a.d.Apply(ctx, rec.ID)
	_, moves, rerr := a.d.Engine.Plan(context.WithoutCancel(ctx), rec.ID)
	if rerr == nil {
		a.ledger(context.WithoutCancel(ctx), rec, moves, failover)
	}
	a.mu.Lock()
	if failover {
		delete(a.failing, subject)
		if got.Status != rebalancer.PlanDone {
			a.retryAt[subject] = time.Now().Add(2 * time.Second)
		}
	} else if a.running == rec.ID && got.Status != rebalancer.PlanPaused {
		a.running = ""
	}
	a.mu.Unlock()
	if ctx.Err() != nil {
		return // the leader stepped down: the next one resumes the plan
	}
	outcome, detail := string(got.Status), fmt.Sprintf("%d moves in %s", len(moves), time.Since(start).Round(time.Millisecond))
	if err != nil {
		outcome, detail = "failed", err.Error()
	}
	if outcome == string(rebalancer.PlanPaused) {
		outcome = "yielded"
	}
	if failover && got.Status == rebalancer.PlanDone && rec.Trigger != nil && !rec.Trigger.Since.IsZero() {
		recovery := lastCommit(moves).Sub(rec.Trigger.Since)
		a.m.recovery.WithLabelValues(detector).Observe(recovery.Seconds())
		since := "the shard's last instance died"
		if detector == retakeDetector {
			since = "the first held takeover's move ended"
		}
		detail += fmt.Sprintf("; tenants served again %s after %s", recovery.Round(time.Millisecond), since)
	}
	if detector == "failover" {
		kind, _, _ := strings.Cut(subject, "/")
		a.m.failovers.WithLabelValues(kind).Inc()
	}
	a.decide(ctx, Decision{Detector: detector, Subject: subject, Outcome: outcome, Detail: detail, Plan: rec.ID})
}

func lastCommit(moves []rebalancer.MoveRecord) time.Time {
	var t time.Time
	for _, m := range moves {
		if m.State == rebalancer.MoveDone && m.Commit.After(t) {
			t = m.Commit
		}
	}
	return t
}

// ledger adds rec's finished moves to the state's recent moves.
func (a *Autopilot) ledger(ctx context.Context, rec rebalancer.PlanRecord, moves []rebalancer.MoveRecord, failover bool) {
	keep := max(a.cfg.Window, a.cfg.Cooldown)
	_, err := UpdateState(ctx, a.d.Store, func(s *State) error {
		s.prune(time.Now(), keep)
		for _, m := range moves {
			if m.State != rebalancer.MoveDone || slices.ContainsFunc(s.Moves, func(x Moved) bool { return x.Plan == rec.ID && x.Tenant == m.Tenant && x.Kind == m.Kind }) {
				continue
			}
			s.Moves = append(s.Moves, Moved{At: m.Finished, Kind: m.Kind, Tenant: m.Tenant, Bytes: m.Bytes, Plan: rec.ID, Failover: failover})
		}
		return nil
	})
	if err != nil {
		a.cfg.Logger.Warn("recording the autopilot's moves", "plan", rec.ID, "err", err)
	}
}

// Adopt takes over an autopilot plan a previous leader left applying (or one this leader's
// start found so): a failover in its lane, another as the autopilot's plan under way.
func (a *Autopilot) Adopt(ctx context.Context, rec rebalancer.PlanRecord) {
	detector, subject := "balance", ""
	if rec.Trigger != nil {
		detector, subject = rec.Trigger.Detector, rec.Trigger.Subject
	}
	failover := detector == "failover" || detector == retakeDetector
	a.mu.Lock()
	if failover {
		a.failing[subject] = rec.ID
	} else {
		a.running = rec.ID
	}
	a.mu.Unlock()
	a.decide(ctx, Decision{Detector: detector, Subject: subject, Outcome: "resumed", Detail: "left applying by the previous leader", Plan: rec.ID})
	a.work.Go(func() { a.run(ctx, detector, subject, rec, failover) })
}

// Yield pauses the autopilot's balance, fill or evacuate plan under way, if any, so an
// operator's plan goes first; the autopilot resumes it once the operator's is done.
func (a *Autopilot) Yield(ctx context.Context, operatorPlan string) {
	a.mu.Lock()
	id := a.running
	a.mu.Unlock()
	if id == "" {
		return
	}
	if _, err := a.d.Engine.SetControl(ctx, id, rebalancer.ControlPause, a.cfg.Actor+" (yields to "+operatorPlan+")"); err != nil {
		a.cfg.Logger.Warn("pausing the autopilot's plan for an operator's", "plan", id, "err", err)
		return
	}
	a.mu.Lock()
	a.yielded = id
	a.mu.Unlock()
}
