package projection

import (
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Hooks connect the views to shardkit's move protocol: warm-up to a fence, the applied
// sequence (also the fence a drained source reports), exact lag, release after a drain or a
// move away, and a placement re-check on reload.
func (s *Service) Hooks() shardkit.Hooks {
	return shardkit.Hooks{Warm: s.Warm, Applied: s.Applied, Lag: s.Lag, Release: s.Release, Reload: s.Reload}
}

// Routes are the routes the service publishes in the registry.
func (s *Service) Routes() []schema.Route { return RouteTable }
