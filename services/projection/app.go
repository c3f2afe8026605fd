package projection

import (
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Hooks connect the views to shardkit's move protocol: warm-up to a fence, the applied
// sequence (also the fence a drained source reports), exact lag, and release after a drain or
// a move away.
func (s *Service) Hooks() shardkit.Hooks {
	return shardkit.Hooks{Warm: s.Warm, Applied: s.Applied, Lag: s.Lag, Release: s.Release}
}

// Routes are the routes the service publishes in the registry.
func (s *Service) Routes() []schema.Route { return RouteTable }
