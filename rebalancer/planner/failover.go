package planner

import (
	"fmt"
	"maps"
	"slices"
)

// Failover plans taking over every tenant of the shards down (they have no live instance) onto
// the live shards: heaviest first, each to the least utilised shard that can host it (labels,
// tenant limit, load capacity). Unlike Evacuate it is not all or nothing: availability comes
// first, so a tenant that fits under no shard's load capacity goes to the least utilised one
// that matches its labels and has a free tenant slot (a note says so), and only a tenant no
// shard can take at all stays (a note says which). Pinned tenants stay, with a note: the pin is
// the operator's word. Tenants in the middle of a move from a down shard are taken over (their
// move's source cannot finish it). The budget does not apply: every move is a takeover
// (Move.Takeover), and the plan is complete when every tenant was placed.
func Failover(w World, down []string, o Options) (*Plan, error) {
	s, err := takeoverState(&w, o)
	if err != nil {
		return nil, err
	}
	var srcs []int32
	for _, name := range down {
		si, ok := s.byName[name]
		if !ok {
			return nil, fmt.Errorf("%w: %s has no shard %q: name one the directory or a placement lists", ErrInvalid, w.Kind, name)
		}
		s.excluded[si] = true
		srcs = append(srcs, si)
	}
	s.buildSegments()
	var moving []int32
	var pinned []string
	for _, si := range srcs {
		for _, t := range s.tenantsOf(si, true) {
			if w.Tenants[t].Pinned {
				pinned = append(pinned, w.Tenants[t].ID)
				continue
			}
			moving = append(moving, t)
		}
	}
	return s.takeOver(moving, pinned, "%s: %d pinned tenants stay on their dead shard (%s): unpin them to fail them over", nil), nil
}

// Retake plans taking over again tenants a takeover left held: the takeover ended without
// committing (its target had no live instance, or was not ready in time), so the placement
// still says takeover and gateways hold the tenant's requests, though its source may be live
// again. Each named tenant goes, as in Failover, to the least utilised shard that can host it;
// never to its owner (a takeover never goes back to the owner it fenced), and not to a shard
// marked draining (one without a live instance). A tenant the world does not list, or lists
// as no longer moving, is left with a note.
func Retake(w World, tenants []string, o Options) (*Plan, error) {
	s, err := takeoverState(&w, o)
	if err != nil {
		return nil, err
	}
	want := make(map[string]bool, len(tenants))
	for _, t := range tenants {
		want[t] = true
	}
	var moving []int32
	var pinned []string
	for i := range w.Tenants {
		t := &w.Tenants[i]
		switch {
		case !want[t.ID] || !t.Moving:
			continue // a tenant no longer moving keeps its note below
		case t.Pinned:
			pinned = append(pinned, t.ID)
		default:
			moving = append(moving, int32(i))
		}
		delete(want, t.ID)
	}
	p := s.takeOver(moving, pinned, "%s: %d pinned tenants stay in their takeover (%s): unpin them to take them over", func(m *Move) {
		m.Goal = "take over again from " + m.Kind + "/" + m.From + ": its takeover ended without committing and holds the tenant's requests"
	})
	if len(want) > 0 {
		p.Notes = append(p.Notes, fmt.Sprintf("%s: %d tenants are no longer in a takeover (%s): nothing to do for them", w.Kind, len(want), names10(slices.Sorted(maps.Keys(want)))))
	}
	return p, nil
}

// takeoverState is the working state of a takeover plan: no budget applies.
func takeoverState(w *World, o Options) (*state, error) {
	o, err := o.withDefaults()
	if err != nil {
		return nil, err
	}
	o.Budget = 0
	return newState(w, o)
}

// takeOver plans the takeover of tenants moving, heaviest first, each to the least utilised
// shard that can host it or, failing that, to the least utilised one whose labels and tenant
// limit allow it (availability comes first). pinnedNote formats the note on the pinned tenants
// left (kind, count, names); goal, if set, names each move's goal.
func (s *state) takeOver(moving []int32, pinned []string, pinnedNote string, goal func(*Move)) *Plan {
	w := s.w
	// Heaviest first across all sources, as Evacuate orders one shard's.
	slices.SortStableFunc(moving, func(a, b int32) int {
		ta, tb := &w.Tenants[a], &w.Tenants[b]
		switch {
		case ta.Load > tb.Load:
			return -1
		case ta.Load < tb.Load:
			return 1
		}
		return 0
	})
	over := 0
	var stranded []string
	for _, t := range moving {
		r := s.leastUtilised(t, s.canHost)
		if r < 0 {
			if r = s.leastUtilised(t, s.canHostOver); r >= 0 {
				over++
			}
		}
		if r < 0 {
			stranded = append(stranded, w.Tenants[t].ID)
			continue
		}
		s.move(t, r)
		m := &s.moves[len(s.moves)-1]
		m.Takeover = true
		if goal != nil {
			goal(m)
		}
	}
	p := newPlan(StrategyFailover, s.opts)
	p.add(s)
	if over > 0 {
		p.Notes = append(p.Notes, fmt.Sprintf("%s: %d tenants went over a shard's load capacity: no shard had room for them, and a tenant served over capacity beats one not served; add a shard, then balance", w.Kind, over))
	}
	if len(pinned) > 0 {
		p.Notes = append(p.Notes, fmt.Sprintf(pinnedNote, w.Kind, len(pinned), names10(pinned)))
	}
	if len(stranded) > 0 {
		p.Notes = append(p.Notes, fmt.Sprintf("%s: no live shard can host %d tenants (labels or tenant limit: %s): add a shard that can", w.Kind, len(stranded), names10(stranded)))
	}
	p.Complete = len(pinned) == 0 && len(stranded) == 0
	return p.finish()
}

// leastUtilised is the shard ok allows for tenant t with the lowest utilisation (ties: by
// name), or -1.
func (s *state) leastUtilised(t int32, ok func(si, t int32) bool) int32 {
	best := int32(-1)
	for _, si := range s.order {
		if s.excluded[si] || !ok(si, t) {
			continue
		}
		if best < 0 || s.util(si) < s.util(best) {
			best = si
		}
	}
	return best
}

// canHostOver is canHost without the load capacity: labels and the tenant limit only.
func (s *state) canHostOver(si, t int32) bool {
	sh := &s.w.Shards[si]
	ten := &s.w.Tenants[t]
	if sh.Draining || s.owner[t] == si {
		return false
	}
	if sh.MaxTenants > 0 && int(s.count[si]) >= sh.MaxTenants {
		return false
	}
	return matches(sh.Labels, ten.Requires) && matches(sh.Labels, s.opts.Require)
}

// names10 lists up to ten names, then how many more.
func names10(names []string) string {
	if len(names) <= 10 {
		return fmt.Sprint(names)
	}
	return fmt.Sprintf("%v and %d more", names[:10], len(names)-10)
}
