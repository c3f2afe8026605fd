package planner

import (
	"fmt"
	"slices"
)

// Evacuate plans moving every tenant off shard, heaviest first, each to the least utilised
// shard that can host it (not draining, labels, tenant limit, capacity). It fails with
// ErrPinned if the shard holds tenants that must stay (pinned, moving, cooling down), ErrNoCapacity or ErrLabels if some tenant fits
// nowhere, and ErrBudget if the budget is smaller than the number of tenants: an evacuation is
// all or nothing. The evacuated shard is left out of the utilisation figures.
func Evacuate(w World, shard string, o Options) (*Plan, error) {
	o, err := o.withDefaults()
	if err != nil {
		return nil, err
	}
	s, err := newState(&w, o)
	if err != nil {
		return nil, err
	}
	src, ok := s.byName[shard]
	if !ok {
		return nil, fmt.Errorf("%w: %s has no shard %q: name one the directory lists", ErrInvalid, w.Kind, shard)
	}
	s.excluded[src] = true
	s.buildSegments()
	seg := slices.Clone(s.tenantsOf(src, true))
	var pinned []string
	var need float64
	for _, t := range seg {
		if ten := &w.Tenants[t]; ten.fixed() {
			pinned = append(pinned, ten.ID+" ("+ten.staying()+")")
		} else {
			need += ten.Load
		}
	}
	if len(pinned) > 0 {
		return nil, pinnedError(w.Kind, shard, pinned)
	}
	if o.Budget > 0 && len(seg) > o.Budget {
		return nil, fmt.Errorf("%w: evacuating %s/%s takes %d moves, the budget is %d: raise the budget", ErrBudget, w.Kind, shard, len(seg), o.Budget)
	}
	var room float64
	for i, sh := range w.Shards {
		if int32(i) != src && !sh.Draining && matches(sh.Labels, o.Require) {
			room += max(0, sh.Capacity-s.load[i])
		}
	}
	if !leq(need, room) {
		return nil, fmt.Errorf("%w: evacuating %s/%s needs room for %.1f load, the other shards have %.1f: need %.1f more, add a shard or raise capacity",
			ErrNoCapacity, w.Kind, shard, need, room, need-room)
	}
	h := heap32{less: func(x, y int32) bool {
		ux, uy := s.util(x), s.util(y)
		if ux != uy {
			return ux < uy
		}
		return s.rank[x] < s.rank[y]
	}}
	for _, si := range s.order {
		if si != src && !w.Shards[si].Draining {
			h.Push(si)
		}
	}
	for _, t := range seg {
		r := popHost(s, &h, t)
		if r < 0 {
			return nil, noHostError(s, t)
		}
		s.move(t, r)
		h.Push(r)
	}
	p := newPlan(StrategyEvacuate, o)
	p.add(s)
	p.Complete = true
	return p.finish(), nil
}

// popHost pops the first shard of h (in heap order) that can host t; the others go back. -1: none.
func popHost(s *state, h *heap32, t int32) int32 {
	var tried []int32
	found := int32(-1)
	for h.Len() > 0 {
		r := h.Pop()
		if s.canHost(r, t) {
			found = r
			break
		}
		tried = append(tried, r)
	}
	for _, r := range tried {
		h.Push(r)
	}
	return found
}

// noHostError says why no shard can take tenant t.
func noHostError(s *state, t int32) error {
	ten := &s.w.Tenants[t]
	labelled := false
	for i, sh := range s.w.Shards {
		if !sh.Draining && int32(i) != s.owner[t] && matches(sh.Labels, ten.Requires) && matches(sh.Labels, s.opts.Require) {
			labelled = true
		}
	}
	if !labelled {
		return fmt.Errorf("%w: %s/%s needs labels %s%s and no other shard has them: label a shard or relax the requirement",
			ErrLabels, s.w.Kind, ten.ID, labelString(ten.Requires), requireSuffix(s.opts.Require))
	}
	return fmt.Errorf("%w: no shard matching its labels has room for %s/%s (load %.1f): add a shard or raise capacity or max tenants",
		ErrNoCapacity, s.w.Kind, ten.ID, ten.Load)
}

func requireSuffix(req map[string]string) string {
	if len(req) == 0 {
		return ""
	}
	return " (and the request's " + labelString(req) + ")"
}
