package aggregate

import (
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Hooks connect the ledger to shardkit's move protocol: warm-up to a fence, the applied
// sequence, the fence a drained source reports, and release after a drain.
func (s *Service) Hooks() shardkit.Hooks {
	return shardkit.Hooks{Warm: s.Warm, Applied: s.Applied, Fence: s.Fence, Release: s.Release}
}

// Routes are the routes the service publishes in the registry.
func (s *Service) Routes() []schema.Route { return RouteTable }
