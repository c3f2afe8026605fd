package planner

import (
	"fmt"
	"sort"
)

// Balance plans moves that bring every shard's utilisation to at most (1+Tolerance) times the
// mean utilisation, with as few moves as it can. Draining shards are left alone (neither give
// nor take): evacuate them. It fails with ErrNoCapacity only if the load exceeds the total
// capacity; a goal it cannot reach (pinned or oversized tenants, labels, budget) gives an
// incomplete plan whose Notes say why.
//
// # Algorithm
//
// Each shard's ceiling is min(capacity, mean*(1+tol)*capacity). Shards above their ceiling are
// donors, in a max-heap by utilisation; shards below it that may receive are receivers, in a
// max-heap by room (ceiling - load). Repeatedly, the most utilised donor gives one tenant, chosen
// among its unpinned tenants that fit the largest room: the lightest tenant that covers the
// donor's whole excess if there is one (the donor is then done with a single move), otherwise the
// heaviest. The tenant goes to the receiver with the most room whose labels, tenant limit and
// capacity accept it. A donor that has no tenant any receiver can take is left as it is (and
// noted). It stops when no donor is left or the budget is spent. Every tenant moves at most once
// and receivers never rise above their ceiling, so it terminates after at most one move per tenant;
// all choices break ties by load, input order and shard name, so the plan is deterministic.
//
// # Lower bound
//
// Plan.MinMoves is a lower bound on the moves of any plan reaching the same ceilings: a donor's
// load only falls when one of its own tenants leaves (arrivals only add), so at least k_d of its
// unpinned tenants must leave, where k_d is the least k whose k heaviest unpinned tenants weigh
// at least its excess. Moves leaving different donors are different moves, so the sum of k_d over
// donors bounds the whole plan. The greedy meets k_d exactly for every donor whose receivers
// have room, which is why its move count lands on or near the bound.
func Balance(w World, o Options) (*Plan, error) {
	o, err := o.withDefaults()
	if err != nil {
		return nil, err
	}
	s, err := newState(&w, o)
	if err != nil {
		return nil, err
	}
	p := newPlan(StrategyBalance, o)
	b := newBalancer(s)
	if need := b.totalLoad - b.totalCap; need > 0 {
		return nil, fmt.Errorf("%w: %s carries %.1f load over %.1f capacity: need %.1f more, add a shard or raise capacity",
			ErrNoCapacity, w.Kind, b.totalLoad, b.totalCap, need)
	}
	p.MinMoves = b.lowerBound()
	b.run()
	p.add(s)
	after := p.Summary(w.Kind).After
	p.Complete = len(b.stuck) == 0 && leq(after.Max, after.Mean*(1+o.Tolerance))
	if !s.budgetLeft() && !p.Complete {
		p.Notes = append(p.Notes, fmt.Sprintf("the move budget of %d is spent before %s is balanced: raise the budget or plan again after these moves", o.Budget, w.Kind))
	}
	for _, d := range b.stuck {
		p.Notes = append(p.Notes, fmt.Sprintf("%s/%s stays above its ceiling: no receiver can take its remaining unpinned tenants (capacity, tenant limit or labels)", w.Kind, w.Shards[d].Name))
	}
	return p.finish(), nil
}

type balancer struct {
	s                   *state
	ceil                []float64 // per shard
	donors, receivers   heap32
	stuck               []int32 // donors that could not be brought down
	skip                []bool  // per tenant: no receiver can take it
	head                []int32 // per donor: first entry of its list that may be available
	totalLoad, totalCap float64
}

func newBalancer(s *state) *balancer {
	b := &balancer{s: s, ceil: make([]float64, len(s.w.Shards))}
	for i, sh := range s.w.Shards {
		if !s.excluded[i] {
			b.totalLoad += s.load[i]
			b.totalCap += sh.Capacity
		}
	}
	m := ratio(b.totalLoad, b.totalCap) * (1 + s.opts.Tolerance)
	b.donors.less = func(x, y int32) bool {
		ux, uy := s.util(x), s.util(y)
		if ux != uy {
			return ux > uy
		}
		return s.rank[x] < s.rank[y]
	}
	b.receivers.less = func(x, y int32) bool {
		rx, ry := b.ceil[x]-s.load[x], b.ceil[y]-s.load[y]
		if rx != ry {
			return rx > ry
		}
		return s.rank[x] < s.rank[y]
	}
	for _, si := range s.order {
		if s.excluded[si] {
			continue // draining shards neither give nor take here: evacuate them
		}
		c := s.w.Shards[si].Capacity
		b.ceil[si] = min(c, m*c)
		switch {
		case !leq(s.load[si], b.ceil[si]):
			b.donors.Push(si)
		case s.load[si] < b.ceil[si] && matches(s.w.Shards[si].Labels, s.opts.Require):
			b.receivers.Push(si)
		}
	}
	if b.donors.Len() > 0 {
		s.buildSegments()
		for _, d := range b.donors.items {
			s.tenantsOf(d, true)
		}
	}
	return b
}

// lowerBound is the sum over donors of the fewest unpinned tenants whose loads cover the excess.
func (b *balancer) lowerBound() int {
	s, total := b.s, 0
	for _, d := range b.donors.items {
		excess := s.load[d] - b.ceil[d]
		for _, t := range s.tenantsOf(d, false) {
			if excess <= 0 || leq(excess, 0) {
				break
			}
			if ten := &s.w.Tenants[t]; !ten.fixed() && ten.Load > 0 {
				excess -= ten.Load
				total++
			}
		}
	}
	return total
}

func (b *balancer) run() {
	s := b.s
	b.skip = make([]bool, len(s.w.Tenants))
	b.head = make([]int32, len(s.w.Shards))
	for b.donors.Len() > 0 && s.budgetLeft() {
		d := b.donors.Top()
		if b.receivers.Len() == 0 {
			b.stuck = append(b.stuck, b.donors.items...)
			return
		}
		if !b.step(d) {
			b.stuck = append(b.stuck, b.donors.Pop())
			continue
		}
		if leq(s.load[d], b.ceil[d]) {
			b.donors.Pop()
		} else {
			b.donors.Fix()
		}
	}
}

// step moves one tenant off donor d; false if none of its tenants can go anywhere.
func (b *balancer) step(d int32) bool {
	s := b.s
	seg := s.tenantsOf(d, false) // sorted heaviest first by newBalancer
	for b.receivers.Len() > 0 {
		top := b.receivers.Top()
		t := b.pick(d, seg, b.ceil[top]-s.load[top], s.load[d]-b.ceil[d])
		if t < 0 {
			return false
		}
		if r := b.receiverFor(t); r >= 0 {
			s.move(t, r)
			sh := &s.w.Shards[r]
			if s.load[r] < b.ceil[r] && (sh.MaxTenants == 0 || int(s.count[r]) < sh.MaxTenants) {
				b.receivers.Push(r)
			}
			return true
		}
		b.skip[t] = true
	}
	return false
}

// pick chooses donor d's tenant: among available tenants no heavier than room, the lightest that
// covers excess, else the heaviest. seg is sorted heaviest first. -1: none.
func (b *balancer) pick(d int32, seg []int32, room, excess float64) int32 {
	s := b.s
	ts := s.w.Tenants
	avail := func(t int32) bool {
		return s.owner[t] == d && !b.skip[t] && !ts[t].fixed() && ts[t].Load > 0 && s.fitsBytes(t)
	}
	// Entries before head[d] are gone for good (moved or skipped): donors never receive.
	h := int(b.head[d])
	for h < len(seg) && !avail(seg[h]) {
		h++
	}
	b.head[d] = int32(h)
	i0 := sort.Search(len(seg), func(i int) bool { return leq(ts[seg[i]].Load, room) })
	i0 = max(i0, h)
	j := sort.Search(len(seg), func(i int) bool { return ts[seg[i]].Load < excess })
	for k := j - 1; k >= i0; k-- {
		if avail(seg[k]) {
			return seg[k]
		}
	}
	for k := max(i0, j); k < len(seg); k++ {
		if avail(seg[k]) {
			return seg[k]
		}
	}
	return -1
}

// receiverFor pops the receiver with the most room that can host t (-1: none); the receivers
// tried before it go back on the heap.
func (b *balancer) receiverFor(t int32) int32 {
	s := b.s
	var tried []int32
	found := int32(-1)
	for b.receivers.Len() > 0 {
		r := b.receivers.Top()
		if !leq(s.w.Tenants[t].Load, b.ceil[r]-s.load[r]) {
			break // the rest have less room
		}
		b.receivers.Pop()
		if s.canHost(r, t) {
			found = r
			break
		}
		tried = append(tried, r)
	}
	for _, r := range tried {
		b.receivers.Push(r)
	}
	return found
}
