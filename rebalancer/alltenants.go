package rebalancer

import (
	"fmt"
	"slices"

	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// A shard labelled schema.LabelTenants=all consumes every tenant (a multi-tenant projection
// shard) and takes part in no move: a move needs a shard filtering by placement at both ends.
// The world leaves such a shard out (it receives no tenant; its tenants are pinned), and a
// request naming one is refused with the reason.

// consumesAll reports whether a shard's labels mark it multi-tenant.
func consumesAll(labels map[string]string) bool {
	return labels[schema.LabelTenants] == schema.TenantsAll
}

// fenceOffAllTenantShards takes a world's multi-tenant shards out of planning.
func fenceOffAllTenantShards(w *planner.World) {
	var all []string
	for i := range w.Shards {
		if consumesAll(w.Shards[i].Labels) {
			w.Shards[i].Draining, w.Shards[i].Capacity = true, 0
			all = append(all, w.Shards[i].Name)
		}
	}
	if len(all) == 0 {
		return
	}
	for i := range w.Tenants {
		if slices.Contains(all, w.Tenants[i].Shard) {
			w.Tenants[i].Pinned = true
		}
	}
}

// refuseAllTenantShards refuses a request that names a multi-tenant shard as a move's source
// or target.
func refuseAllTenantShards(req planner.Request, worlds []planner.World) error {
	for _, w := range worlds {
		shard := map[string]bool{}
		for _, s := range w.Shards {
			if consumesAll(s.Labels) {
				shard[s.Name] = true
			}
		}
		if len(shard) == 0 {
			continue
		}
		refuse := func(name, role string) error {
			if !shard[name] {
				return nil
			}
			return fmt.Errorf("%w: %s shard %s consumes every tenant (labelled %s=%s, a multi-tenant shard): it cannot be a move's %s; moves need tenant-filtered shards",
				planner.ErrInvalid, w.Kind, name, schema.LabelTenants, schema.TenantsAll, role)
		}
		owner := map[string]string{}
		for _, t := range w.Tenants {
			owner[t.ID] = t.Shard
		}
		if req.Kind == w.Kind || req.Kind == "" {
			switch req.Strategy {
			case planner.StrategyEvacuate:
				if err := refuse(req.Shard, "source"); err != nil {
					return err
				}
			case planner.StrategyFill:
				if err := refuse(req.Shard, "target"); err != nil {
					return err
				}
			}
			for _, m := range req.Moves {
				if err := refuse(m.To, "target"); err != nil {
					return err
				}
				if err := refuse(owner[m.Tenant], "source"); err != nil {
					return err
				}
			}
		}
		if req.Strategy == planner.StrategyMoveTenant {
			if err := refuse(req.Targets[w.Kind], "target"); err != nil {
				return err
			}
			if _, moving := req.Targets[w.Kind]; moving {
				if err := refuse(owner[req.Tenant], "source"); err != nil {
					return err
				}
			}
		}
	}
	return nil
}
