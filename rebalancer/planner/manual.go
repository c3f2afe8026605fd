package planner

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
)

// Manual plans the operator's moves, in the order given, checking each against the world as the
// moves before it leave it: the tenant exists and is not pinned, the target is not draining,
// carries the required labels and has room. A move to the tenant's current shard is dropped.
// Any violation fails the whole plan.
func Manual(w World, moves []ManualMove, o Options) (*Plan, error) {
	o, err := o.withDefaults()
	if err != nil {
		return nil, err
	}
	s, err := newState(&w, o)
	if err != nil {
		return nil, err
	}
	idx := make(map[string]int32, len(moves))
	for _, m := range moves {
		idx[m.Tenant] = -1
	}
	for i := range w.Tenants {
		if _, ok := idx[w.Tenants[i].ID]; ok {
			idx[w.Tenants[i].ID] = int32(i)
		}
	}
	for _, m := range moves {
		if err := s.manual(idx[m.Tenant], m.Tenant, m.To); err != nil {
			return nil, err
		}
	}
	p := newPlan(StrategyManual, o)
	p.add(s)
	p.Complete = true
	return p.finish(), nil
}

// manual plans moving tenant t (named id, -1 if absent) to shard to.
func (s *state) manual(t int32, id, to string) error {
	k := s.w.Kind
	if t < 0 {
		return fmt.Errorf("%w: %s has no placement for tenant %q: check the name, or let it be placed first", ErrUnknownTenant, k, id)
	}
	r, ok := s.byName[to]
	if !ok {
		return fmt.Errorf("%w: %s has no shard %q: name one the directory lists", ErrInvalid, k, to)
	}
	if s.owner[t] == r {
		return nil
	}
	ten := &s.w.Tenants[t]
	sh := &s.w.Shards[r]
	switch {
	case ten.fixed():
		return fmt.Errorf("%w: %s/%s is %s: %s", ErrPinned, k, id, ten.staying(), map[string]string{
			"pinned": "unpin it before moving it", "moving": "wait for its move to end", "cooling down": "the autopilot moved it lately; wait for its cool-down to end"}[ten.staying()])
	case !s.budgetLeft():
		return fmt.Errorf("%w: the plan needs more than the budget of %d moves: raise the budget", ErrBudget, s.opts.Budget)
	case sh.Draining:
		return fmt.Errorf("%w: %s/%s is draining and takes no tenants: pick another shard", ErrInvalid, k, to)
	case !matches(sh.Labels, ten.Requires) || !matches(sh.Labels, s.opts.Require):
		return fmt.Errorf("%w: %s/%s needs labels %s%s, shard %s has %s: pick a matching shard",
			ErrLabels, k, id, labelString(ten.Requires), requireSuffix(s.opts.Require), to, labelString(sh.Labels))
	case sh.MaxTenants > 0 && int(s.count[r]) >= sh.MaxTenants:
		return fmt.Errorf("%w: %s/%s already hosts its maximum of %d tenants: pick another shard or raise its capacity", ErrNoCapacity, k, to, sh.MaxTenants)
	case !leq(s.load[r]+ten.Load, sh.Capacity):
		return fmt.Errorf("%w: %s/%s has %.1f load of %.1f capacity, %s adds %.1f: need %.1f more, pick another shard or raise capacity",
			ErrNoCapacity, k, to, s.load[r], sh.Capacity, id, ten.Load, s.load[r]+ten.Load-sh.Capacity)
	}
	s.move(t, r)
	return nil
}

// MoveTenant plans moving one tenant in several kinds: targets maps kind to shard, and each
// kind's world must be among worlds. It yields one move per kind whose owner changes, in the
// order aggregate, projection, runner, then other kinds by name, each in its own wave.
// The budget counts all of them.
func MoveTenant(worlds []World, tenant string, targets map[string]string, o Options) (*Plan, error) {
	o, err := o.withDefaults()
	if err != nil {
		return nil, err
	}
	if len(targets) == 0 {
		return nil, fmt.Errorf("%w: moving %s needs at least one kind=shard target", ErrInvalid, tenant)
	}
	kinds := make([]string, 0, len(targets))
	for k := range targets {
		kinds = append(kinds, k)
	}
	slices.SortFunc(kinds, func(a, b string) int {
		return cmp.Or(cmp.Compare(kindRank(a), kindRank(b)), strings.Compare(a, b))
	})
	p := newPlan(StrategyMoveTenant, o)
	for _, k := range kinds {
		i := slices.IndexFunc(worlds, func(w World) bool { return w.Kind == k })
		if i < 0 {
			return nil, fmt.Errorf("%w: no world for kind %q: load its directory and placements", ErrInvalid, k)
		}
		ko := o
		ko.Budget = 0 // checked over all kinds below
		s, err := newState(&worlds[i], ko)
		if err != nil {
			return nil, err
		}
		t := int32(slices.IndexFunc(worlds[i].Tenants, func(x Tenant) bool { return x.ID == tenant }))
		if err := s.manual(t, tenant, targets[k]); err != nil {
			return nil, err
		}
		p.add(s)
	}
	if o.Budget > 0 && len(p.Moves) > o.Budget {
		return nil, fmt.Errorf("%w: moving %s takes %d moves, the budget is %d: raise the budget", ErrBudget, tenant, len(p.Moves), o.Budget)
	}
	p.Complete = true
	return p.finish(), nil
}
