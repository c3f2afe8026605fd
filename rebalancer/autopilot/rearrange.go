package autopilot

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// candidate is a plan a detector wants, before the guardrails.
type candidate struct {
	detector, subject string
	trigger           rebalancer.Trigger
	plan              func(planner.Options) (*planner.Plan, error)
	// windowed plans wait for a maintenance window (balance, fill; not an operator's evacuate).
	windowed bool
}

// rearrange runs the evacuate, fill and balance detectors, in that order, and applies the
// first plan one of them wants that the guardrails allow: one autopilot plan at a time, and
// none while an operator's plan applies (a plan the autopilot paused for one resumes after it).
func (a *Autopilot) rearrange(ctx context.Context) {
	if a.cfg.Mode == Off {
		return
	}
	op := ""
	if a.d.OperatorBusy != nil {
		op = a.d.OperatorBusy()
	}
	a.mu.Lock()
	running, yielded := a.running, a.yielded
	a.mu.Unlock()
	if yielded != "" && op == "" {
		a.resume(ctx, yielded)
		return
	}
	if running != "" || yielded != "" {
		return
	}
	st, err := ReadState(ctx, a.d.Store)
	if err != nil {
		return
	}
	now := time.Now()
	moves, bytes := st.usage(now, a.cfg.Window)
	a.m.used(moves, bytes)
	kcs, err := a.d.Store.Kinds().List(ctx)
	if err != nil {
		return
	}
	for _, kc := range kcs {
		if kc.Policy != schema.PolicyManaged {
			continue
		}
		w, err := rebalancer.BuildWorld(ctx, a.d.Store, kc.Kind, rebalancer.WorldOptions{Telemetry: a.telemetry(), Dead: a.d.Presence.Dead})
		if err != nil {
			continue
		}
		for i := range w.Shards {
			if st.InMaintenance(kc.Kind, w.Shards[i].Name) {
				w.Shards[i].Draining = true
			}
		}
		c := a.evacuate(w, st)
		if c == nil {
			c = a.fill(w)
		}
		if c == nil {
			c = a.balance(w)
		}
		if c == nil {
			continue
		}
		if g, why := a.guarded(c, st, now, op, moves, bytes); g != "" {
			a.block(ctx, c, g, why)
			continue
		}
		cooling := st.cooling(kc.Kind, now, a.cfg.Cooldown)
		for i := range w.Tenants {
			if _, ok := cooling[w.Tenants[i].ID]; ok {
				w.Tenants[i].Cooling = true // moved by the autopilot within its cool-down
			}
		}
		p, err := c.plan(planner.Options{Tolerance: a.cfg.Tolerance, Concurrency: a.cfg.Concurrency,
			Budget: min(a.cfg.MaxPlanMoves, a.cfg.MaxMoves-moves), MaxBytes: a.cfg.MaxBytes - bytes})
		if err == nil && (len(p.Moves) == 0 || c.detector == "balance" && !improves(p, w.Kind, a.cfg.Tolerance)) {
			// Nothing worth moving (few tenants, the heavy ones cooling down): start the clock
			// again rather than ask every look.
			a.forget(c)
			a.cfg.Logger.Debug("autopilot: nothing worth moving", "detector", c.detector, "subject", c.subject, "cooling", len(cooling), "notes", p.Notes)
			continue
		}
		if err != nil {
			a.block(ctx, c, "no plan", err.Error())
			continue
		}
		a.forget(c) // hysteresis: the condition must hold again for its time
		a.apply(ctx, c.detector, c.subject, c.trigger, p, false)
		return
	}
}

// forget starts c's condition clocks again (a balance's settle clock with its own).
func (a *Autopilot) forget(c *candidate) {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.since, c.detector+"/"+c.subject)
	if c.detector == "balance" {
		delete(a.since, "settle/"+c.subject)
	}
}

// resume applies again the autopilot's plan it paused for an operator's.
func (a *Autopilot) resume(ctx context.Context, id string) {
	rec, err := a.d.Engine.SetControl(ctx, id, "", a.cfg.Actor)
	a.mu.Lock()
	a.yielded = ""
	if err == nil {
		a.running = id
	}
	a.mu.Unlock()
	if err != nil {
		a.cfg.Logger.Warn("resuming the autopilot's plan after an operator's", "plan", id, "err", err)
		return
	}
	detector, subject := "balance", ""
	if rec.Trigger != nil {
		detector, subject = rec.Trigger.Detector, rec.Trigger.Subject
	}
	a.decide(ctx, Decision{Detector: detector, Subject: subject, Outcome: "resumed", Detail: "the operator's plan is done", Plan: id})
	a.work.Go(func() { a.run(ctx, detector, subject, rec, false) })
}

// guarded names the guardrail that stops c now, and why ("" if none).
func (a *Autopilot) guarded(c *candidate, st State, now time.Time, op string, moves int, bytes uint64) (string, string) {
	switch {
	case op != "":
		return "operator first", "the operator's plan " + op + " is being applied"
	}
	if f, ok := st.Frozen(now); ok {
		return "freeze", fmt.Sprintf("frozen until %s by %s: %s", f.Until.Format(time.RFC3339), f.By, f.Reason)
	}
	if c.windowed && len(a.cfg.Windows) > 0 && !slices.ContainsFunc(a.cfg.Windows, func(w Window) bool { return w.Open(now) }) {
		return "maintenance window", fmt.Sprintf("outside the maintenance windows %v", a.cfg.Windows)
	}
	if moves >= a.cfg.MaxMoves {
		return "move budget", fmt.Sprintf("%d moves in the last %s (at most %d)", moves, a.cfg.Window, a.cfg.MaxMoves)
	}
	if bytes >= a.cfg.MaxBytes {
		return "byte budget", fmt.Sprintf("%s moved in the last %s (at most %s)", planner.HumanBytes(bytes), a.cfg.Window, planner.HumanBytes(a.cfg.MaxBytes))
	}
	return "", ""
}

// blockRepeat is how often the same block of the same detector is logged and audited again.
const blockRepeat = time.Minute

// block records that guardrail g stopped c (once per blockRepeat for the same one).
func (a *Autopilot) block(ctx context.Context, c *candidate, g, why string) {
	key := "block/" + c.detector + "/" + c.subject + "/" + g
	a.mu.Lock()
	last, seen := a.since[key]
	if !seen || time.Since(last) >= blockRepeat {
		a.since[key] = time.Now()
	}
	a.mu.Unlock()
	if seen && time.Since(last) < blockRepeat {
		return
	}
	a.decide(ctx, Decision{Detector: c.detector, Subject: c.subject, Outcome: "blocked", Guardrail: g,
		Detail: fmt.Sprintf("%s (%s); %s", c.trigger.Figure, c.trigger.Threshold, why)})
}

// held reports whether condition key has held for Sustain (starting its clock if it was not
// holding), and since when.
func (a *Autopilot) held(key string, holds bool) (bool, time.Time) {
	return a.heldFor(key, holds, a.cfg.Sustain)
}

// heldFor is held for a duration of its own.
func (a *Autopilot) heldFor(key string, holds bool, d time.Duration) (bool, time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	since, ok := a.since[key]
	if !holds {
		delete(a.since, key)
		return false, time.Time{}
	}
	if !ok {
		since = a.now()
		a.since[key] = since
	}
	return a.now().Sub(since) >= d, since
}

// evacuate wants a plan for the first shard marked for maintenance that still owns tenants.
func (a *Autopilot) evacuate(w planner.World, st State) *candidate {
	for _, m := range st.Maintenance {
		if m.Kind != w.Kind {
			continue
		}
		n := 0
		for _, t := range w.Tenants {
			if t.Shard == m.Shard {
				n++
			}
		}
		if n == 0 {
			continue
		}
		shard := m.Shard
		return &candidate{detector: "evacuate", subject: w.Kind + "/" + shard,
			trigger: rebalancer.Trigger{Detector: "evacuate", Subject: w.Kind + "/" + shard, Since: m.At,
				Figure:    fmt.Sprintf("%d tenants on a shard marked for maintenance by %s (%s)", n, m.By, m.Reason),
				Threshold: "a shard marked for maintenance owns no tenant"},
			plan: func(o planner.Options) (*planner.Plan, error) {
				o.Budget = 0 // all or nothing, checked against the budget below
				p, err := planner.Evacuate(w, shard, o)
				if err == nil && len(p.Moves) > a.cfg.MaxMoves {
					err = fmt.Errorf("evacuating %s/%s takes %d moves, more than the budget of %d per %s", w.Kind, shard, len(p.Moves), a.cfg.MaxMoves, a.cfg.Window)
				}
				return p, err
			}}
	}
	return nil
}

// fill wants a plan for a live shard that has owned no tenant for Sustain while others own
// some.
func (a *Autopilot) fill(w planner.World) *candidate {
	count := map[string]int{}
	for _, t := range w.Tenants {
		count[t.Shard]++
	}
	for _, sh := range w.Shards {
		key := "fill/" + w.Kind + "/" + sh.Name
		empty := !sh.Draining && count[sh.Name] == 0 && len(w.Tenants) >= 2
		ok, since := a.held(key, empty)
		if !ok {
			continue
		}
		shard := sh.Name
		return &candidate{detector: "fill", subject: w.Kind + "/" + shard, windowed: true,
			trigger: rebalancer.Trigger{Detector: "fill", Subject: w.Kind + "/" + shard, Since: since,
				Figure:    fmt.Sprintf("a live shard with no tenant while the kind has %d", len(w.Tenants)),
				Threshold: fmt.Sprintf("empty for %s", a.cfg.Sustain)},
			plan: func(o planner.Options) (*planner.Plan, error) { return planner.Fill(w, shard, o) }}
	}
	return nil
}

// balance wants a plan when the kind's max/mean utilisation has been above 1+Trigger for
// Sustain.
func (a *Autopilot) balance(w planner.World) *candidate {
	ratio, hottest := imbalance(w)
	a.m.imbalance.WithLabelValues(w.Kind).Set(ratio)
	threshold := fmt.Sprintf("max/mean > %.2f for %s", 1+a.cfg.Trigger, a.cfg.Sustain)
	ok, since := a.held("balance/"+w.Kind, ratio > 1+a.cfg.Trigger)
	// A kind that drifted above its tolerance but stays under the trigger is brought back too,
	// only later: settling, it never flaps (the plan ends within the tolerance).
	if settled, from := a.heldFor("settle/"+w.Kind, ratio > 1+a.cfg.Tolerance, a.cfg.Settle); !ok && settled {
		ok, since = true, from
		threshold = fmt.Sprintf("max/mean > %.2f for %s", 1+a.cfg.Tolerance, a.cfg.Settle)
	}
	if !ok {
		return nil
	}
	return &candidate{detector: "balance", subject: w.Kind, windowed: true,
		trigger: rebalancer.Trigger{Detector: "balance", Subject: w.Kind, Since: since,
			Figure:    fmt.Sprintf("max/mean utilisation %.2f (%s the most utilised)", ratio, hottest),
			Threshold: fmt.Sprintf("%s; the plan aims at %.2f", threshold, 1+a.cfg.Tolerance)},
		plan: func(o planner.Options) (*planner.Plan, error) { return planner.Balance(w, o) }}
}

// improves reports whether balance plan p brings kind within the tolerance or lowers its
// max/mean by at least half the tolerance: a plan that does neither (a handful of tenants that
// cannot split evenly) is not made.
func improves(p *planner.Plan, kind string, tolerance float64) bool {
	sum := p.Summary(kind)
	within := sum.Before.MaxOverMean > 1+tolerance && sum.After.MaxOverMean <= 1+tolerance
	return within || sum.Before.MaxOverMean-sum.After.MaxOverMean >= tolerance/2
}

// imbalance is the kind's max/mean utilisation over the shards that take tenants, and its most
// utilised shard (0 when there is no load).
func imbalance(w planner.World) (float64, string) {
	load := map[string]float64{}
	for _, t := range w.Tenants {
		load[t.Shard] += t.Load
	}
	var l, c, mx float64
	hottest := ""
	for _, sh := range w.Shards {
		if sh.Draining || sh.Capacity <= 0 {
			continue
		}
		l += load[sh.Name]
		c += sh.Capacity
		if u := load[sh.Name] / sh.Capacity; u > mx {
			mx, hottest = u, sh.Name
		}
	}
	if l == 0 || c == 0 {
		return 0, ""
	}
	return mx / (l / c), hottest
}

// Status is what the autopilot shows: its mode and guardrails, what it uses of its budgets, the
// freezes and maintenance marks, the shards without a live instance, its plans under way and
// its latest decisions (newest first).
type Status struct {
	Mode    Mode `json:"mode"`
	Leading bool `json:"leading"`
	// Deciding: leading, and past the leader's startup wait (Config.Startup).
	Deciding   bool        `json:"deciding"`
	Guardrails Config      `json:"guardrails"`
	Windows    []string    `json:"windows,omitempty"`
	Frozen     *Freeze     `json:"frozen,omitempty"`
	State      State       `json:"state"`
	Used       Usage       `json:"used"`
	Down       []DownShard `json:"down"`
	// Held counts, by kind, the tenants held in a takeover that no move drives any more while
	// their source is live (the retake detector's last look): it takes them over again.
	Held      map[string]int    `json:"held,omitempty"`
	Running   string            `json:"running,omitempty"`
	Yielded   string            `json:"yielded,omitempty"`
	Failing   map[string]string `json:"failing,omitempty"`
	Decisions []Decision        `json:"decisions"`
}

// Usage is what the autopilot moved within its budget window.
type Usage struct {
	Moves  int           `json:"moves"`
	Bytes  uint64        `json:"bytes"`
	Window time.Duration `json:"window"`
}

// DownShard is a shard that owns tenants and has no live instance.
type DownShard struct {
	Kind    string `json:"kind"`
	Shard   string `json:"shard"`
	Tenants int    `json:"tenants"`
	rebalancer.ShardPresence
}

// Status reports the autopilot's state now (it reads the stored state and the placements).
func (a *Autopilot) Status(ctx context.Context) (Status, error) {
	st, err := ReadState(ctx, a.d.Store)
	if err != nil {
		return Status{}, err
	}
	now := time.Now()
	s := Status{Mode: a.cfg.Mode, Guardrails: a.cfg, State: st, Decisions: []Decision{}, Down: []DownShard{}}
	for _, w := range a.cfg.Windows {
		s.Windows = append(s.Windows, w.String())
	}
	if f, ok := st.Frozen(now); ok {
		s.Frozen = &f
	}
	s.Used.Moves, s.Used.Bytes = st.usage(now, a.cfg.Window)
	s.Used.Window = a.cfg.Window
	a.mu.Lock()
	s.Leading, s.Running, s.Yielded = a.leading, a.running, a.yielded
	s.Deciding = a.leading && now.Sub(a.start) >= a.cfg.Startup
	for kind, n := range a.stuck {
		if n > 0 {
			if s.Held == nil {
				s.Held = map[string]int{}
			}
			s.Held[kind] = n
		}
	}
	if len(a.failing) > 0 {
		s.Failing = map[string]string{}
		for k, v := range a.failing {
			s.Failing[k] = v
		}
	}
	for i := len(a.decisions) - 1; i >= 0 && len(s.Decisions) < 50; i-- {
		s.Decisions = append(s.Decisions, a.decisions[i])
	}
	a.mu.Unlock()
	if kcs, err := a.d.Store.Kinds().List(ctx); err == nil {
		for _, kc := range kcs {
			counts := a.shardTenants(ctx, kc.Kind)
			for _, shard := range slices.Sorted(maps.Keys(counts)) {
				if sp := a.d.Presence.Shard(kc.Kind, shard); counts[shard] > 0 && sp.Down() {
					s.Down = append(s.Down, DownShard{Kind: kc.Kind, Shard: shard, Tenants: counts[shard], ShardPresence: sp})
				}
			}
		}
	}
	return s, nil
}

// FreezeUntil records a change freeze until until, by actor, for reason.
func FreezeUntil(ctx context.Context, st *schema.Store, until time.Time, reason, actor string) (State, error) {
	now := time.Now().UTC()
	if !until.After(now) {
		return State{}, fmt.Errorf("%w: a freeze must end in the future (until %s)", schema.ErrInvalid, until.Format(time.RFC3339))
	}
	return UpdateState(ctx, st, func(s *State) error {
		s.prune(now, 365*24*time.Hour)
		s.Freezes = append(s.Freezes, Freeze{From: now, Until: until.UTC(), Reason: reason, By: actor})
		return nil
	})
}

// Unfreeze ends every freeze in force now.
func Unfreeze(ctx context.Context, st *schema.Store) (State, error) {
	now := time.Now().UTC()
	return UpdateState(ctx, st, func(s *State) error {
		s.Freezes = slices.DeleteFunc(s.Freezes, func(f Freeze) bool { return f.Until.After(now) })
		return nil
	})
}

// SetMaintenance marks (on) or clears kind's shard for maintenance.
func SetMaintenance(ctx context.Context, st *schema.Store, kind, shard string, on bool, reason, actor string) (State, error) {
	if err := schema.CheckName("kind", kind); err != nil {
		return State{}, err
	}
	if err := schema.CheckName("shard", shard); err != nil {
		return State{}, err
	}
	return UpdateState(ctx, st, func(s *State) error {
		s.Maintenance = slices.DeleteFunc(s.Maintenance, func(m Maintenance) bool { return m.Kind == kind && m.Shard == shard })
		if on {
			s.Maintenance = append(s.Maintenance, Maintenance{Kind: kind, Shard: shard, Reason: reason, By: actor, At: time.Now().UTC()})
		}
		return nil
	})
}
