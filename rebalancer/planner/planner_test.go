package planner

import (
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
)

// world builds a kind's world: shards "name:capacity[:maxTenants]" and tenants
// "id@shard=load" (a trailing "!" pins it).
func world(kind string, shards []string, tenants ...string) World {
	w := World{Kind: kind}
	for _, s := range shards {
		var sh Shard
		parts := strings.Split(s, ":")
		sh.Name = parts[0]
		fmt.Sscan(parts[1], &sh.Capacity)
		if len(parts) > 2 {
			fmt.Sscan(parts[2], &sh.MaxTenants)
		}
		w.Shards = append(w.Shards, sh)
	}
	for i, s := range tenants {
		var ten Tenant
		ten.Pinned = strings.HasSuffix(s, "!")
		s = strings.TrimSuffix(s, "!")
		id, rest, _ := strings.Cut(s, "@")
		shard, load, _ := strings.Cut(rest, "=")
		ten.ID, ten.Shard, ten.Revision = id, shard, uint64(100+i)
		fmt.Sscan(load, &ten.Load)
		w.Tenants = append(w.Tenants, ten)
	}
	return w
}

func label(w World, shard string, kv ...string) World {
	w.Shards = slices.Clone(w.Shards)
	for i := range w.Shards {
		if w.Shards[i].Name == shard {
			w.Shards[i].Labels = map[string]string{}
			for j := 0; j < len(kv); j += 2 {
				w.Shards[i].Labels[kv[j]] = kv[j+1]
			}
		}
	}
	return w
}

func require(w World, tenant string, kv ...string) World {
	w.Tenants = slices.Clone(w.Tenants)
	for i := range w.Tenants {
		if w.Tenants[i].ID == tenant {
			w.Tenants[i].Requires = map[string]string{}
			for j := 0; j < len(kv); j += 2 {
				w.Tenants[i].Requires[kv[j]] = kv[j+1]
			}
		}
	}
	return w
}

func drain(w World, shard string) World {
	w.Shards = slices.Clone(w.Shards)
	for i := range w.Shards {
		if w.Shards[i].Name == shard {
			w.Shards[i].Draining = true
		}
	}
	return w
}

var three = []string{"a-1:100", "a-2:100", "a-3:100"}

func TestBalance(t *testing.T) {
	tests := []struct {
		name     string
		given    World
		opts     Options
		complete bool
		moves    int      // -1: don't check
		notMoved []string // tenants that must stay
		withErr  error
	}{
		{
			name:     "skewed three shards",
			given:    world("aggregate", three, "t1@a-1=30", "t2@a-1=20", "t3@a-1=10", "t4@a-1=10", "t5@a-2=20"),
			complete: true, moves: 2,
		},
		{
			name:     "already balanced",
			given:    world("aggregate", three, "t1@a-1=30", "t2@a-2=31", "t3@a-3=32"),
			complete: true, moves: 0,
		},
		{
			name:     "no load",
			given:    world("aggregate", three, "t1@a-1=0", "t2@a-1=0"),
			complete: true, moves: 0,
		},
		{
			name:     "pinned heavy tenant stays",
			given:    world("aggregate", three, "big@a-1=60!", "t2@a-1=20", "t3@a-2=10"),
			complete: false, moves: 1, notMoved: []string{"big"},
		},
		{
			name:     "budget stops early",
			given:    world("aggregate", three, "t1@a-1=20", "t2@a-1=20", "t3@a-1=20", "t4@a-1=20", "t5@a-1=10"),
			opts:     Options{Budget: 1},
			complete: false, moves: 1,
		},
		{
			name:     "tenant limit on receivers",
			given:    world("aggregate", []string{"a-1:100", "a-2:100:1", "a-3:100:1"}, "t1@a-1=10", "t2@a-1=10", "t3@a-1=10", "t4@a-1=10", "t5@a-2=1", "t6@a-3=1"),
			complete: false, moves: 0,
		},
		{
			name:     "unequal capacities",
			given:    world("aggregate", []string{"a-1:100", "a-2:300"}, "t1@a-1=50", "t2@a-1=30", "t3@a-1=10", "t4@a-1=10", "t5@a-1=5", "t6@a-1=5"),
			complete: true, moves: -1,
		},
		{
			name:    "over capacity",
			given:   world("aggregate", []string{"a-1:10", "a-2:10"}, "t1@a-1=15", "t2@a-2=15"),
			withErr: ErrNoCapacity,
		},
		{
			name:    "unknown shard",
			given:   world("aggregate", three, "t1@a-9=1"),
			withErr: ErrInvalid,
		},
		{
			name:    "bad tolerance",
			given:   world("aggregate", three),
			opts:    Options{Tolerance: -1},
			withErr: ErrInvalid,
		},
		{
			name:     "draining shard neither gives nor takes",
			given:    drain(world("aggregate", three, "t1@a-1=40", "t2@a-1=30", "t3@a-3=10"), "a-2"),
			complete: true, moves: 1, notMoved: []string{"t3"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, err := Balance(tc.given, tc.opts)
			if tc.withErr != nil {
				if !errors.Is(err, tc.withErr) {
					t.Fatalf("err = %v, want %v", err, tc.withErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			checkPlan(t, tc.opts, p, tc.given)
			if p.Complete != tc.complete {
				t.Errorf("complete = %v, want %v\n%s", p.Complete, tc.complete, p)
			}
			o, _ := tc.opts.withDefaults()
			if s := p.Summary("aggregate"); p.Complete && s.After.MaxOverMean > 1+o.Tolerance+1e-9 {
				t.Errorf("complete but max/mean %v > %v", s.After.MaxOverMean, 1+o.Tolerance)
			}
			if tc.moves >= 0 && len(p.Moves) != tc.moves {
				t.Errorf("%d moves, want %d\n%s", len(p.Moves), tc.moves, p)
			}
			if p.Complete && len(p.Moves) < p.MinMoves {
				t.Errorf("%d moves beat the lower bound %d", len(p.Moves), p.MinMoves)
			}
			for _, m := range p.Moves {
				for _, n := range tc.notMoved {
					if m.Tenant == n {
						t.Errorf("%s moved", n)
					}
				}
			}
			if !p.Complete && len(p.Notes) == 0 {
				t.Error("an incomplete plan must say why")
			}
			again, _ := Balance(tc.given, tc.opts)
			if !reflect.DeepEqual(p, again) {
				t.Error("two plans of the same world differ")
			}
		})
	}
}

func TestBalanceLabels(t *testing.T) {
	w := world("aggregate", []string{"a-1:100", "a-2:100", "a-3:100"},
		"eu1@a-1=30", "eu2@a-1=30", "any@a-1=30")
	w = label(w, "a-1", "region", "eu")
	w = label(w, "a-2", "region", "us")
	w = label(w, "a-3", "region", "eu")
	w = require(w, "eu1", "region", "eu")
	w = require(w, "eu2", "region", "eu")
	p, err := Balance(w, Options{})
	if err != nil {
		t.Fatal(err)
	}
	checkPlan(t, Options{}, p, w)
	if !p.Complete || len(p.Moves) != 2 {
		t.Fatalf("want a complete two-move plan:\n%s", p)
	}

	// The request restricts every target to region=eu: only a-3 may receive.
	o := Options{Require: map[string]string{"region": "eu"}}
	p, err = Balance(w, o)
	if err != nil {
		t.Fatal(err)
	}
	checkPlan(t, o, p, w)
	for _, m := range p.Moves {
		if m.To != "a-3" {
			t.Errorf("move to %s, only a-3 carries region=eu", m.To)
		}
	}
}

func TestEvacuate(t *testing.T) {
	base := world("runner", []string{"r-1:100", "r-2:100", "r-3:100:3"},
		"t1@r-1=30", "t2@r-1=20", "t3@r-1=10", "t4@r-2=40", "t5@r-3=10", "t6@r-3=10")
	tests := []struct {
		name    string
		given   World
		shard   string
		opts    Options
		moves   int
		withErr error
		errHas  string
	}{
		{name: "empties the shard", given: base, shard: "r-1", moves: 3},
		{name: "empty shard", given: base, shard: "r-3", moves: 2},
		{name: "skips draining shards", given: drain(base, "r-2"), shard: "r-1", withErr: ErrNoCapacity, errHas: "max tenants"},
		{name: "total room", given: drain(base, "r-3"), shard: "r-1", opts: Options{Require: map[string]string{}}, moves: 3},
		{name: "not enough room", given: world("runner", []string{"r-1:100", "r-2:50", "r-3:50"}, "t1@r-1=60", "t2@r-1=50", "t3@r-2=40"), shard: "r-1", withErr: ErrNoCapacity, errHas: "need 50.0 more"},
		{name: "pinned", given: world("runner", []string{"r-1:100", "r-2:100"}, "keep@r-1=1!", "t2@r-1=1"), shard: "r-1", withErr: ErrPinned, errHas: "keep (pinned)"},
		{name: "cooling down", given: cooling(world("runner", []string{"r-1:100", "r-2:100"}, "hot@r-1=1", "t2@r-1=1"), "hot"), shard: "r-1", withErr: ErrPinned, errHas: "hot (cooling down)"},
		{name: "budget", given: base, shard: "r-1", opts: Options{Budget: 2}, withErr: ErrBudget},
		{name: "no room", given: world("runner", []string{"r-1:100", "r-2:50"}, "t1@r-1=60"), shard: "r-1", withErr: ErrNoCapacity, errHas: "add a shard or raise capacity"},
		{name: "unknown shard", given: base, shard: "r-9", withErr: ErrInvalid},
		{name: "labels", given: require(world("runner", []string{"r-1:100", "r-2:100"}, "eu@r-1=1"), "eu", "region", "eu"), shard: "r-1", withErr: ErrLabels},
		{name: "tenant limit", given: world("runner", []string{"r-1:100", "r-2:100:1"}, "t1@r-1=1", "t2@r-1=1"), shard: "r-1", withErr: ErrNoCapacity, errHas: "max tenants"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, err := Evacuate(tc.given, tc.shard, tc.opts)
			if tc.withErr != nil {
				if !errors.Is(err, tc.withErr) || !strings.Contains(fmt.Sprint(err), tc.errHas) {
					t.Fatalf("err = %v, want %v containing %q", err, tc.withErr, tc.errHas)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			checkPlan(t, tc.opts, p, tc.given)
			if len(p.Moves) != tc.moves || !p.Complete {
				t.Fatalf("%d moves (complete %v), want %d", len(p.Moves), p.Complete, tc.moves)
			}
			for _, d := range p.Shards {
				if d.Shard == tc.shard && d.TenantsAfter != 0 {
					t.Fatalf("%s keeps %d tenants", tc.shard, d.TenantsAfter)
				}
			}
			// Heaviest first, each to the least utilised shard: t1 (30) goes to r-3 (20%).
			if tc.name == "empties the shard" && (p.Moves[0].Tenant != "t1" || p.Moves[0].To != "r-3") {
				t.Errorf("first move %+v, want t1 -> r-3", p.Moves[0])
			}
		})
	}
}

func TestFill(t *testing.T) {
	w := world("projection", []string{"p-1:100", "p-2:100", "p-3:100"},
		"t1@p-1=20", "t2@p-1=20", "t3@p-1=10", "t4@p-1=10", "t5@p-2=20", "t6@p-2=10", "t7@p-2=5", "t8@p-2=5", "t9@p-1=5", "t10@p-1=5")
	p, err := Fill(w, "p-3", Options{})
	if err != nil {
		t.Fatal(err)
	}
	checkPlan(t, Options{}, p, w)
	if !p.Complete {
		t.Fatalf("fill incomplete:\n%s", p)
	}
	var after map[string]ShardDiff = map[string]ShardDiff{}
	for _, d := range p.Shards {
		after[d.Shard] = d
	}
	mean := 110.0 / 3
	if got := after["p-3"].LoadAfter; got < mean*0.95 || got > mean*1.05 {
		t.Errorf("p-3 reaches %v, want within 5%% of %v", got, mean)
	}
	for _, m := range p.Moves {
		if m.To != "p-3" {
			t.Errorf("move %+v does not feed p-3", m)
		}
	}

	// The budget stops it early, and it says so.
	p, err = Fill(w, "p-3", Options{Budget: 1})
	if err != nil {
		t.Fatal(err)
	}
	checkPlan(t, Options{Budget: 1}, p, w)
	if p.Complete || len(p.Moves) != 1 || len(p.Notes) == 0 {
		t.Fatalf("want one move and a note:\n%s", p)
	}

	// The new shard's labels keep tenants that need others out.
	lw := require(label(w, "p-3", "region", "us"), "t1", "region", "eu")
	p, err = Fill(lw, "p-3", Options{})
	if err != nil {
		t.Fatal(err)
	}
	checkPlan(t, Options{}, p, lw)
	for _, m := range p.Moves {
		if m.Tenant == "t1" {
			t.Error("t1 requires region=eu and moved to a us shard")
		}
	}

	for name, tc := range map[string]struct {
		shard string
		w     World
		err   error
	}{
		"unknown":  {"p-9", w, ErrInvalid},
		"draining": {"p-3", drain(w, "p-3"), ErrInvalid},
		"labels":   {"p-3", w, ErrLabels},
	} {
		o := Options{}
		if name == "labels" {
			o.Require = map[string]string{"region": "eu"}
		}
		if _, err := Fill(tc.w, tc.shard, o); !errors.Is(err, tc.err) {
			t.Errorf("%s: err = %v, want %v", name, err, tc.err)
		}
	}
}

func TestManual(t *testing.T) {
	w := world("aggregate", []string{"a-1:100", "a-2:50:2", "a-3:100"},
		"t1@a-1=30", "t2@a-1=30", "pin@a-1=1!", "t4@a-2=10")
	w = label(w, "a-3", "region", "eu")
	w = require(w, "t2", "region", "eu")
	p, err := Manual(w, []ManualMove{{"t1", "a-2"}, {"t2", "a-3"}, {"t4", "a-2"}}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	checkPlan(t, Options{}, p, w)
	if len(p.Moves) != 2 || p.Moves[0].Tenant != "t1" || p.Moves[1].Tenant != "t2" {
		t.Fatalf("want t1 and t2 moved in order (t4 is already on a-2):\n%s", p)
	}
	for _, tc := range []struct {
		name  string
		moves []ManualMove
		opts  Options
		err   error
	}{
		{"pinned", []ManualMove{{"pin", "a-3"}}, Options{}, ErrPinned},
		{"unknown tenant", []ManualMove{{"nobody", "a-3"}}, Options{}, ErrUnknownTenant},
		{"unknown shard", []ManualMove{{"t1", "a-9"}}, Options{}, ErrInvalid},
		{"labels", []ManualMove{{"t2", "a-2"}}, Options{}, ErrLabels},
		{"sequential", []ManualMove{{"t1", "a-2"}, {"t1", "a-3"}, {"t1", "a-1"}}, Options{}, nil},
		{"budget", []ManualMove{{"t1", "a-2"}, {"t2", "a-3"}}, Options{Budget: 1}, ErrBudget},
	} {
		_, err := Manual(w, tc.moves, tc.opts)
		if !errors.Is(err, tc.err) || (tc.err == nil && err != nil) {
			t.Errorf("%s: err = %v, want %v", tc.name, err, tc.err)
		}
	}
	over := world("aggregate", []string{"a-1:100", "a-2:50:1"}, "t1@a-1=30", "t2@a-1=30", "t3@a-2=1")
	if _, err := Manual(over, []ManualMove{{"t1", "a-2"}}, Options{}); !errors.Is(err, ErrNoCapacity) {
		t.Errorf("tenant limit: err = %v", err)
	}
	over = world("aggregate", []string{"a-1:100", "a-2:50"}, "t1@a-1=30", "t2@a-1=30", "t3@a-2=1")
	if _, err := Manual(over, []ManualMove{{"t1", "a-2"}, {"t2", "a-2"}}, Options{}); !errors.Is(err, ErrNoCapacity) || !strings.Contains(err.Error(), "need 11.0 more") {
		t.Errorf("load capacity: err = %v", err)
	}
}

func moveTenantWorlds() []World {
	return []World{
		world("runner", []string{"r-1:100", "r-2:100"}, "x@r-1=5", "y@r-1=5"),
		world("aggregate", []string{"a-1:100", "a-2:100"}, "x@a-1=10", "y@a-2=10"),
		world("projection", []string{"p-1:100", "p-2:100"}, "x@p-2=3", "y@p-1=3"),
	}
}

func TestMoveTenant(t *testing.T) {
	worlds := moveTenantWorlds()
	targets := map[string]string{"runner": "r-2", "projection": "p-1", "aggregate": "a-2"}
	p, err := MoveTenant(worlds, "x", targets, Options{})
	if err != nil {
		t.Fatal(err)
	}
	checkPlan(t, Options{}, p, worlds...)
	var got []string
	for _, m := range p.Moves {
		got = append(got, fmt.Sprintf("%s:%s->%s@%d", m.Kind, m.From, m.To, m.Wave))
	}
	want := []string{"aggregate:a-1->a-2@1", "projection:p-2->p-1@2", "runner:r-1->r-2@3"}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("moves %v, want %v", got, want)
	}
	if k := p.Kinds; len(k) != 3 || k[0].Kind != "aggregate" || k[1].Kind != "projection" || k[2].Kind != "runner" {
		t.Errorf("kinds out of order: %+v", k)
	}

	// Already in place for projection: one move fewer.
	p, err = MoveTenant(worlds, "x", map[string]string{"aggregate": "a-2", "projection": "p-2"}, Options{})
	if err != nil || len(p.Moves) != 1 {
		t.Fatalf("err %v, moves %v", err, p)
	}
	for name, tc := range map[string]struct {
		tenant  string
		targets map[string]string
		opts    Options
		err     error
	}{
		"no targets":     {"x", nil, Options{}, ErrInvalid},
		"unknown kind":   {"x", map[string]string{"cache": "c-1"}, Options{}, ErrInvalid},
		"unknown tenant": {"z", targets, Options{}, ErrUnknownTenant},
		"budget":         {"x", targets, Options{Budget: 2}, ErrBudget},
	} {
		if _, err := MoveTenant(worlds, tc.tenant, tc.targets, tc.opts); !errors.Is(err, tc.err) {
			t.Errorf("%s: err = %v, want %v", name, err, tc.err)
		}
	}
}

func TestMake(t *testing.T) {
	w := world("aggregate", three, "t1@a-1=40", "t2@a-1=20", "t3@a-1=10", "t4@a-1=10", "t5@a-2=20")
	for _, st := range []Strategy{StrategyBalance, StrategyEvacuate, StrategyFill, StrategyManual} {
		req := Request{Strategy: st, Shard: "a-3", Moves: []ManualMove{{"t1", "a-3"}}}
		if st == StrategyEvacuate {
			req.Shard = "a-2"
		}
		p, err := Make(req, w)
		if err != nil {
			t.Fatalf("%s: %v", st, err)
		}
		if p.Strategy != st {
			t.Errorf("strategy %s, want %s", p.Strategy, st)
		}
		checkPlan(t, Options{}, p, w)
	}
	p, err := Make(Request{Strategy: StrategyMoveTenant, Tenant: "x", Targets: map[string]string{"runner": "r-2"}}, moveTenantWorlds()...)
	if err != nil || len(p.Moves) != 1 {
		t.Fatalf("move-tenant: %v %v", err, p)
	}
	if _, err := Make(Request{Strategy: "shuffle"}, w); !errors.Is(err, ErrInvalid) {
		t.Errorf("unknown strategy: %v", err)
	}
	if _, err := Make(Request{Strategy: StrategyBalance, Kind: "runner"}, w); !errors.Is(err, ErrInvalid) {
		t.Errorf("unknown kind: %v", err)
	}
}

// cooling marks tenant as moved by the autopilot within its cool-down.
func cooling(w World, tenant string) World {
	for i := range w.Tenants {
		if w.Tenants[i].ID == tenant {
			w.Tenants[i].Cooling = true
		}
	}
	return w
}

// Retake takes over again the tenants a takeover left held, from a live source: each to the
// least utilised shard that can host it (not its owner, not a shard without a live instance),
// and names what it could not do.
func TestRetake(t *testing.T) {
	w := drain(world("aggregate", []string{"a-1:100", "a-2:100", "a-3:100", "a-4:100"},
		"held1@a-1=30", "held2@a-1=10", "stay@a-1=5", "busy@a-2=50", "held3@a-3=5"), "a-4")
	for _, id := range []string{"held1", "held2", "held3"} {
		i := slices.IndexFunc(w.Tenants, func(x Tenant) bool { return x.ID == id })
		w.Tenants[i].Moving = true
	}
	p, err := Retake(w, []string{"held1", "held2", "held3", "gone", "stay"}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	checkPlan(t, Options{}, p, w)
	got := map[string]string{}
	for _, m := range p.Moves {
		if !m.Takeover || !strings.Contains(m.Goal, "take over again") {
			t.Errorf("move %+v: want a takeover whose goal says it is taken over again", m)
		}
		got[m.Tenant] = m.From + "->" + m.To
	}
	// Heaviest first, never to the owner or the draining a-4: held1 (30) to a-3 (at 5%, a-2 at
	// 50%), held2 (10) to a-3 (now 35%), held3 (5) off a-3 to a-1 (now 5%).
	want := map[string]string{"held1": "a-1->a-3", "held2": "a-1->a-3", "held3": "a-3->a-1"}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("moves %v, want %v", got, want)
	}
	if p.Strategy != StrategyFailover || !p.Complete || len(p.Notes) != 1 || !strings.Contains(p.Notes[0], "2 tenants are no longer in a takeover ([gone stay])") {
		t.Fatalf("plan %s complete=%v notes %q: want a failover plan, complete, with a note on gone and stay", p.Strategy, p.Complete, p.Notes)
	}
}
