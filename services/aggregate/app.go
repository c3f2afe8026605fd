package aggregate

import (
	"net/http"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Hooks connect the ledger to shardkit's move protocol (shardkit/events): warm-up to a fence,
// the applied sequence, the fence a drained source reports, release after a drain, and the
// per-account state digest at the fence that verifies a move.
func (s *Service) Hooks() shardkit.Hooks {
	h := s.log.Hooks()
	h.Digest = s.log.Digest
	return h
}

// Routes are the routes the service publishes in the registry.
func (s *Service) Routes() []schema.Route { return RouteTable }

// Handler serves the service's routes on their own router: the tenant routes behind sk's gate,
// the admin ones behind its token check. It also tells the event log at which epoch sk may
// write each tenant, so a takeover's epoch marker fences this instance once another shard took
// a tenant over.
func (s *Service) Handler(sk *shardkit.Shard) http.Handler {
	s.log.SetWriteEpoch(sk.WriteEpoch)
	r := chi.NewRouter()
	s.Mount(r, sk.Gate, sk.RequireAdmin)
	return r
}
