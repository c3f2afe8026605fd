package projection

import (
	"net/http"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Hooks connect the views to shardkit's move protocol: warm-up to a fence, the applied
// sequence, the fence a drained source reports (its applied sequence, with the views' digest
// there), exact lag, release after a drain or a move away, a placement re-check on reload, and
// the views' digest at the fence that verifies a move.
func (s *Service) Hooks() shardkit.Hooks {
	return shardkit.Hooks{Warm: s.Warm, Applied: s.Applied, Fence: s.Fence, Lag: s.Lag, Release: s.Release, Reload: s.Reload,
		Sizes: s.Sizes, Digest: s.Digest}
}

// Routes are the routes the service publishes in the registry.
func (s *Service) Routes() []schema.Route { return RouteTable }

// Handler serves the service's routes on their own router: the tenant routes behind sk's gate,
// the admin ones behind its token check.
func (s *Service) Handler(sk *shardkit.Shard) http.Handler {
	r := chi.NewRouter()
	s.Mount(r, sk.Gate, sk.RequireAdmin)
	return r
}

// Sizes are the stored views' sizes of the tenants this instance hosts. shardkit hook.
func (s *Service) Sizes() []schema.TenantSize {
	hosted := s.hosted()
	out := make([]schema.TenantSize, 0, len(hosted))
	for _, ts := range hosted {
		out = append(out, schema.TenantSize{Tenant: ts.tenant, ViewBytes: ts.viewBytes.Load()})
	}
	return out
}
