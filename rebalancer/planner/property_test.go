package planner

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"
)

// randomWorld builds a small world from seed: 2-12 shards with mixed capacities, tenant limits
// and labels; up to 300 tenants (simple: 70 per shard or more), some pinned, some needing a region. simple worlds have none of
// those constraints and many light tenants, so balance must always reach the tolerance.
func randomWorld(seed uint64, simple bool) World {
	r := rand.New(rand.NewPCG(seed, 7))
	w := World{Kind: "aggregate"}
	ns := 2 + r.IntN(11)
	regions := []string{"eu", "us"}
	for i := range ns {
		sh := Shard{Name: fmt.Sprintf("a-%d", i+1), Capacity: float64(50 + r.IntN(200))}
		if !simple {
			if r.IntN(4) == 0 {
				sh.MaxTenants = 5 + r.IntN(40)
			}
			sh.Labels = map[string]string{"region": regions[r.IntN(2)]}
			sh.Draining = r.IntN(8) == 0
		}
		w.Shards = append(w.Shards, sh)
	}
	var capTotal float64
	for _, sh := range w.Shards {
		capTotal += sh.Capacity
	}
	nt := r.IntN(300)
	if simple {
		// With loads in [0.5, 1.5] of their mean and 70 tenants per shard, the heaviest tenant
		// weighs at most tol * total load / shards: then some receiver always has room for it.
		nt = 70*ns + r.IntN(100)
	}
	// Loads fill 20-80% of the total capacity, skewed onto a few shards.
	fill := 0.2 + 0.6*r.Float64()
	mean := fill * capTotal / float64(max(nt, 1))
	for i := range nt {
		ten := Tenant{ID: fmt.Sprintf("t%03d", i), Revision: uint64(1 + r.IntN(1000))}
		ten.Load = mean * r.ExpFloat64()
		if simple {
			ten.Load = mean * (0.5 + r.Float64())
		} else {
			ten.Pinned = r.IntN(20) == 0
			if r.IntN(5) == 0 {
				ten.Requires = map[string]string{"region": regions[r.IntN(2)]}
			}
			if r.IntN(10) == 0 {
				ten.Load = 0
			}
		}
		// Skew: half the tenants land on the first shard or two.
		if r.IntN(2) == 0 {
			ten.Shard = w.Shards[r.IntN(min(2, ns))].Name
		} else {
			ten.Shard = w.Shards[r.IntN(ns)].Name
		}
		w.Tenants = append(w.Tenants, ten)
	}
	return w
}

// checkRandom plans every strategy on w and checks the invariants. Errors are allowed only
// when they are the typed ones a strategy documents.
func checkRandom(t *testing.T, w World, simple bool, budget int) {
	t.Helper()
	o := Options{Budget: budget, Concurrency: 3}
	p, err := Balance(w, o)
	if errors.Is(err, ErrNoCapacity) {
		return
	}
	if err != nil {
		t.Fatalf("balance: %v", err)
	}
	checkPlan(t, o, p, w)
	if p.Complete && len(p.Moves) < p.MinMoves {
		t.Fatalf("balance: %d moves beat the lower bound %d", len(p.Moves), p.MinMoves)
	}
	if simple && budget == 0 && !p.Complete {
		t.Fatalf("balance of a feasible world is incomplete:\n%s", p)
	}
	if again, _ := Balance(w, o); !reflect.DeepEqual(p, again) {
		t.Fatal("balance is not deterministic")
	}
	for _, sh := range w.Shards {
		p, err := Evacuate(w, sh.Name, o)
		switch {
		case errors.Is(err, ErrNoCapacity), errors.Is(err, ErrPinned), errors.Is(err, ErrLabels), errors.Is(err, ErrBudget):
		case err != nil:
			t.Fatalf("evacuate %s: %v", sh.Name, err)
		default:
			checkPlan(t, o, p, w)
			for _, d := range p.Shards {
				if d.Shard == sh.Name && d.TenantsAfter != 0 {
					t.Fatalf("evacuate %s leaves %d tenants", sh.Name, d.TenantsAfter)
				}
			}
		}
		p, err = Fill(w, sh.Name, o)
		switch {
		case errors.Is(err, ErrInvalid) && sh.Draining, errors.Is(err, ErrLabels):
		case err != nil:
			t.Fatalf("fill %s: %v", sh.Name, err)
		default:
			checkPlan(t, o, p, w)
		}
	}
}

func TestRandomWorlds(t *testing.T) {
	for seed := range uint64(300) {
		simple := seed%3 == 0
		budget := 0
		if seed%5 == 1 {
			budget = 1 + int(seed%17)
		}
		w := randomWorld(seed, simple)
		t.Run(fmt.Sprint(seed), func(t *testing.T) { checkRandom(t, w, simple, budget) })
	}
}

// FuzzPlan explores more worlds with `go test -fuzz FuzzPlan`; plain `go test` runs the seeds.
func FuzzPlan(f *testing.F) {
	for _, s := range []uint64{1, 2, 3, 42, 1000} {
		f.Add(s, s%2 == 0, uint8(s%7))
	}
	f.Fuzz(func(t *testing.T, seed uint64, simple bool, budget uint8) {
		checkRandom(t, randomWorld(seed, simple), simple, int(budget))
	})
}
