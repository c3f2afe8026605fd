package planner

import (
	"fmt"
	"sort"
)

// Fill plans moves into shard (typically new and empty) from the most utilised shards until it
// reaches the mean utilisation: it stops once the shard is within Tolerance below the mean and
// never takes it above (1+Tolerance) of the mean or its capacity. Each move takes the heaviest
// tenant of the most utilised shard that fits both the room left on the filled shard and the
// donor's load above (1-Tolerance) of the mean, so donors are not pushed far below the mean.
func Fill(w World, shard string, o Options) (*Plan, error) {
	o, err := o.withDefaults()
	if err != nil {
		return nil, err
	}
	s, err := newState(&w, o)
	if err != nil {
		return nil, err
	}
	dst, ok := s.byName[shard]
	if !ok {
		return nil, fmt.Errorf("%w: %s has no shard %q: register its instances first", ErrInvalid, w.Kind, shard)
	}
	sh := &w.Shards[dst]
	if sh.Draining {
		return nil, fmt.Errorf("%w: %s/%s is draining: it cannot be filled; mark it online first", ErrInvalid, w.Kind, shard)
	}
	if !matches(sh.Labels, o.Require) {
		return nil, fmt.Errorf("%w: %s/%s lacks the requested labels %s: fill a matching shard or change the request", ErrLabels, w.Kind, shard, labelString(o.Require))
	}
	mean := s.mean()
	goal := mean * sh.Capacity
	ceil := min(sh.Capacity, goal*(1+o.Tolerance))
	floor := goal * (1 - o.Tolerance)
	s.buildSegments()
	donors := heap32{less: func(x, y int32) bool {
		ux, uy := s.util(x), s.util(y)
		if ux != uy {
			return ux > uy
		}
		return s.rank[x] < s.rank[y]
	}}
	for _, si := range s.order {
		if si != dst && !s.excluded[si] && s.util(si) > mean {
			s.tenantsOf(si, true)
			donors.Push(si)
		}
	}
	ts := w.Tenants
	for s.load[dst] < floor && donors.Len() > 0 && s.budgetLeft() {
		if sh.MaxTenants > 0 && int(s.count[dst]) >= sh.MaxTenants {
			break
		}
		d := donors.Top()
		seg := s.tenantsOf(d, false)
		// A donor may give down to the bottom of the tolerance band around the mean.
		lim := min(ceil-s.load[dst], s.load[d]-mean*(1-o.Tolerance)*w.Shards[d].Capacity)
		i := sort.Search(len(seg), func(i int) bool { return leq(ts[seg[i]].Load, lim) })
		t := int32(-1)
		for ; i < len(seg); i++ {
			if c := seg[i]; s.owner[c] == d && !ts[c].fixed() && ts[c].Load > 0 && s.canHost(dst, c) {
				t = c
				break
			}
		}
		if t < 0 {
			donors.Pop() // nothing of d fits: try the next donor
			continue
		}
		s.move(t, dst)
		if s.util(d) > mean {
			donors.Fix()
		} else {
			donors.Pop()
		}
	}
	p := newPlan(StrategyFill, o)
	p.add(s)
	p.Complete = s.load[dst] >= floor
	if !p.Complete {
		why := "no tenant of a shard above the mean fits the room left (capacity, tenant limit, labels or tenant sizes)"
		if !s.budgetLeft() {
			why = fmt.Sprintf("the move budget of %d is spent: raise it or plan again", o.Budget)
		}
		p.Notes = append(p.Notes, fmt.Sprintf("%s/%s reaches %.1f of its goal %.1f: %s", w.Kind, shard, s.load[dst], goal, why))
	}
	return p.finish(), nil
}
