package planner

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"sync"
	"testing"
)

// skewedWorld builds nTenants over nShards with skew on every axis: tenant loads are Zipf
// (1 + Zipf(s=1.2) over 0..999, so most tenants weigh 1-3 and a few weigh hundreds), shards are
// filled unevenly (shard j draws tenants with weight 0.3 + 1.7*(j/n)^2, about 7x from first to
// last), capacities alternate between 1x and 1.5x, and 0.1% of tenants are pinned.
func skewedWorld(nShards, nTenants int, seed uint64) World {
	r := rand.New(rand.NewPCG(seed, 1))
	z := rand.NewZipf(r, 1.2, 1, 999)
	w := World{Kind: "aggregate", Shards: make([]Shard, nShards), Tenants: make([]Tenant, nTenants)}
	cum := make([]float64, nShards)
	total := 0.0
	for j := range nShards {
		x := float64(j) / float64(nShards)
		total += 0.3 + 1.7*x*x
		cum[j] = total
	}
	var load float64
	for i := range w.Tenants {
		j := sort.SearchFloat64s(cum, r.Float64()*total)
		t := &w.Tenants[i]
		t.ID = fmt.Sprintf("tenant-%07d", i)
		t.Shard = fmt.Sprintf("aggregate-%04d", j)
		t.Load = float64(1 + z.Uint64())
		t.Revision = uint64(i + 1)
		t.Pinned = r.IntN(1000) == 0
		load += t.Load
	}
	// Capacity: the mean shard sits at 1/3 of its capacity.
	base := 3 * load / (1.25 * float64(nShards))
	for j := range w.Shards {
		w.Shards[j] = Shard{Name: fmt.Sprintf("aggregate-%04d", j), Capacity: base * (1 + 0.5*float64(j%2))}
	}
	return w
}

// lowerBound computes, independently of the planner, the fewest moves any plan needs to bring
// every shard to at most min(capacity, (1+tol) * mean utilisation * capacity): each shard above
// that ceiling by excess e must lose at least k of its own unpinned tenants, k being the least
// count whose heaviest k loads sum to e (arrivals only raise a shard's load, and no k-1 tenants of
// the shard weigh as much as its heaviest k-1). A move leaves exactly one shard, so the per-shard
// minima add up to a bound for the whole plan. It ignores receivers' room, labels and tenant
// limits, which can only raise the true minimum, so it stays a valid lower bound.
func lowerBound(w World, tol float64) int {
	idx := map[string]int{}
	var l, c float64
	for i, s := range w.Shards {
		idx[s.Name] = i
		if !s.Draining {
			c += s.Capacity
		}
	}
	loads := make([][]float64, len(w.Shards))
	sum := make([]float64, len(w.Shards))
	for _, t := range w.Tenants {
		i := idx[t.Shard]
		sum[i] += t.Load
		if !w.Shards[i].Draining {
			l += t.Load
		}
		if !t.Pinned && t.Load > 0 {
			loads[i] = append(loads[i], t.Load)
		}
	}
	mean := l / c
	n := 0
	for i, s := range w.Shards {
		if s.Draining {
			continue
		}
		excess := sum[i] - min(s.Capacity, mean*(1+tol)*s.Capacity)
		if !(excess > 1e-9*s.Capacity) {
			continue
		}
		slices.Sort(loads[i])
		for k := len(loads[i]) - 1; k >= 0 && excess > 1e-9*s.Capacity; k-- {
			excess -= loads[i][k]
			n++
		}
	}
	return n
}

var (
	bigOnce  sync.Once
	bigWorld World
)

// BenchmarkBalance1M is the key figure: balance 1M tenants over 1,000 shards. Goals: under 1 s
// per plan, max/mean <= 1.05, moves within 1.1x of the lower bound.
//
//	go test ./rebalancer/planner -run '^$' -bench Balance1M -count 3
func BenchmarkBalance1M(b *testing.B) {
	bigOnce.Do(func() { bigWorld = skewedWorld(1000, 1_000_000, 1) })
	benchBalance(b, bigWorld)
}

// BenchmarkBalance100k is a smaller companion (100k tenants, 100 shards).
func BenchmarkBalance100k(b *testing.B) { benchBalance(b, skewedWorld(100, 100_000, 2)) }

func benchBalance(b *testing.B, w World) {
	lb := lowerBound(w, DefaultTolerance)
	b.ReportAllocs()
	b.ResetTimer()
	var p *Plan
	for b.Loop() {
		var err error
		if p, err = Balance(w, Options{}); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	s := p.Summary(w.Kind)
	if p.MinMoves != lb {
		b.Errorf("the plan's lower bound %d differs from the independent one %d", p.MinMoves, lb)
	}
	b.ReportMetric(float64(len(p.Moves)), "moves")
	b.ReportMetric(float64(lb), "lower_bound")
	b.ReportMetric(float64(len(p.Moves))/float64(max(lb, 1)), "moves/bound")
	b.ReportMetric(s.Before.MaxOverMean, "max/mean_before")
	b.ReportMetric(s.After.MaxOverMean, "max/mean")
	if !p.Complete || s.After.MaxOverMean > 1+DefaultTolerance+1e-9 {
		b.Errorf("not balanced: max/mean %.4f, notes %v", s.After.MaxOverMean, p.Notes)
	}
}

// TestBalanceSkewed checks the benchmark's goals on a world small enough for every test run.
func TestBalanceSkewed(t *testing.T) {
	w := skewedWorld(100, 20_000, 3)
	p, err := Balance(w, Options{})
	if err != nil {
		t.Fatal(err)
	}
	checkPlan(t, Options{}, p, w)
	lb := lowerBound(w, DefaultTolerance)
	s := p.Summary(w.Kind)
	t.Logf("%d moves, lower bound %d, max/mean %.3f -> %.4f", len(p.Moves), lb, s.Before.MaxOverMean, s.After.MaxOverMean)
	if !p.Complete || s.After.MaxOverMean > 1.05+1e-9 {
		t.Fatalf("not balanced: max/mean %.4f", s.After.MaxOverMean)
	}
	if p.MinMoves != lb || float64(len(p.Moves)) > 1.1*float64(lb) {
		t.Fatalf("%d moves, bound %d (plan says %d): want within 1.1x", len(p.Moves), lb, p.MinMoves)
	}
}
