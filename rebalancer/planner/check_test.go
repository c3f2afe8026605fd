package planner

import (
	"encoding/json"
	"math"
	"reflect"
	"testing"
)

// checkPlan replays p's moves on w and checks every invariant a plan promises: moves start where
// the tenant is, never touch a pinned tenant, land on a shard that is not draining and carries
// the labels, copy the placement revision; the predicted figures equal the replay; no receiving
// shard ends above its load capacity or tenant limit; the budget and the waves hold.
func checkPlan(t *testing.T, o Options, p *Plan, worlds ...World) {
	t.Helper()
	o, _ = o.withDefaults()
	type shardKey struct{ kind, shard string }
	type loc struct {
		w *World
		i int
	}
	shards := map[shardKey]*Shard{}
	load := map[shardKey]float64{}
	count := map[shardKey]int{}
	in := map[shardKey]int{}
	out := map[shardKey]int{}
	tenants := map[shardKey]loc{} // (kind, tenant id)
	where := map[shardKey]string{}
	for wi := range worlds {
		w := &worlds[wi]
		for i := range w.Shards {
			shards[shardKey{w.Kind, w.Shards[i].Name}] = &w.Shards[i]
		}
		for i, ten := range w.Tenants {
			tenants[shardKey{w.Kind, ten.ID}] = loc{w, i}
			where[shardKey{w.Kind, ten.ID}] = ten.Shard
			load[shardKey{w.Kind, ten.Shard}] += ten.Load
			count[shardKey{w.Kind, ten.Shard}]++
		}
	}
	if o.Budget > 0 && len(p.Moves) > o.Budget {
		t.Fatalf("%d moves exceed the budget of %d", len(p.Moves), o.Budget)
	}
	if p.Concurrency != o.Concurrency {
		t.Errorf("plan concurrency %d, want %d", p.Concurrency, o.Concurrency)
	}
	wave, inWave, lastWave := 0, 0, map[string]int{}
	for i, m := range p.Moves {
		if m.Wave < wave || m.Wave > wave+1 {
			t.Fatalf("move %d: wave %d after wave %d", i, m.Wave, wave)
		}
		if m.Wave != wave {
			wave, inWave = m.Wave, 0
		}
		inWave++
		if inWave > o.Concurrency {
			t.Fatalf("wave %d holds more than %d moves", wave, o.Concurrency)
		}
		if lastWave[m.Tenant] == m.Wave {
			t.Fatalf("move %d: tenant %s moves twice in wave %d", i, m.Tenant, m.Wave)
		}
		lastWave[m.Tenant] = m.Wave
		l, ok := tenants[shardKey{m.Kind, m.Tenant}]
		if !ok {
			t.Fatalf("move %d: unknown tenant %s/%s", i, m.Kind, m.Tenant)
		}
		ten := l.w.Tenants[l.i]
		tk := shardKey{m.Kind, m.Tenant}
		switch {
		case ten.Pinned:
			t.Fatalf("move %d: pinned tenant %s moved", i, m.Tenant)
		case ten.Moving && p.Strategy != StrategyFailover:
			t.Fatalf("move %d: tenant %s moved while in a move", i, m.Tenant)
		case m.Takeover != (p.Strategy == StrategyFailover):
			t.Fatalf("move %d: takeover %v in a %s plan", i, m.Takeover, p.Strategy)
		case where[tk] != m.From:
			t.Fatalf("move %d: %s is on %s, the move starts from %s", i, m.Tenant, where[tk], m.From)
		case m.Revision != ten.Revision:
			t.Fatalf("move %d: revision %d, the placement has %d", i, m.Revision, ten.Revision)
		case m.Load != ten.Load:
			t.Fatalf("move %d: load %v, the tenant has %v", i, m.Load, ten.Load)
		case m.From == m.To:
			t.Fatalf("move %d: from and to are both %s", i, m.To)
		}
		to := shards[shardKey{m.Kind, m.To}]
		if to == nil || to.Draining {
			t.Fatalf("move %d: target %s is unknown or draining", i, m.To)
		}
		if !matches(to.Labels, ten.Requires) || !matches(to.Labels, o.Require) {
			t.Fatalf("move %d: %s lacks labels %v / %v for %s", i, m.To, ten.Requires, o.Require, m.Tenant)
		}
		where[tk] = m.To
		load[shardKey{m.Kind, m.From}] -= ten.Load
		load[shardKey{m.Kind, m.To}] += ten.Load
		count[shardKey{m.Kind, m.From}]--
		count[shardKey{m.Kind, m.To}]++
		out[shardKey{m.Kind, m.From}]++
		in[shardKey{m.Kind, m.To}]++
	}
	if wave != p.Waves {
		t.Errorf("plan says %d waves, moves use %d", p.Waves, wave)
	}
	if len(p.Shards) != len(shards) {
		t.Fatalf("plan lists %d shards, the worlds have %d", len(p.Shards), len(shards))
	}
	for _, d := range p.Shards {
		k := shardKey{d.Kind, d.Shard}
		sh := shards[k]
		if sh == nil {
			t.Fatalf("plan lists unknown shard %s/%s", d.Kind, d.Shard)
		}
		if !near(d.LoadAfter, load[k]) || d.TenantsAfter != count[k] || d.In != in[k] || d.Out != out[k] {
			t.Fatalf("%s/%s: plan predicts load %v, %d tenants, in %d, out %d; replay gives %v, %d, %d, %d",
				d.Kind, d.Shard, d.LoadAfter, d.TenantsAfter, d.In, d.Out, load[k], count[k], in[k], out[k])
		}
		if !near(d.LoadBefore+sumIn(p, k.kind, k.shard)-sumOut(p, k.kind, k.shard), d.LoadAfter) {
			t.Fatalf("%s/%s: before %v and moves do not add up to after %v", d.Kind, d.Shard, d.LoadBefore, d.LoadAfter)
		}
		if in[k] > 0 {
			if !leq(load[k], sh.Capacity) && p.Strategy != StrategyFailover { // a failover prefers over capacity to down
				t.Fatalf("%s/%s: receives tenants and ends at %v load over capacity %v", d.Kind, d.Shard, load[k], sh.Capacity)
			}
			if sh.MaxTenants > 0 && count[k] > sh.MaxTenants {
				t.Fatalf("%s/%s: receives tenants and ends with %d over its limit %d", d.Kind, d.Shard, count[k], sh.MaxTenants)
			}
		}
	}
	// The plan survives JSON unchanged.
	b, err := json.Marshal(p)
	if err != nil {
		t.Fatal(err)
	}
	var back Plan
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(&back, p) {
		t.Fatalf("plan changes through JSON:\n%s", b)
	}
}

func sumIn(p *Plan, kind, shard string) (s float64) {
	for _, m := range p.Moves {
		if m.Kind == kind && m.To == shard {
			s += m.Load
		}
	}
	return s
}

func sumOut(p *Plan, kind, shard string) (s float64) {
	for _, m := range p.Moves {
		if m.Kind == kind && m.From == shard {
			s += m.Load
		}
	}
	return s
}

func near(a, b float64) bool { return math.Abs(a-b) <= 1e-6*math.Max(1, math.Abs(b)) }
