package server

import (
	"net/http"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

func (s *Server) registerTenantRoutes(r chi.Router) {
	r.Get("/api/tenants", s.handleTenants)
}

// tenantReportAge is how old a load report may be to count in /api/tenants.
const tenantReportAge = 15 * time.Second

// handleTenants lists the largest tenants by stored size from telemetry: ?kind= &limit=
// (default 20, at most 1000).
func (s *Server) handleTenants(w http.ResponseWriter, r *http.Request) {
	limit, err := intParam(r, "limit", 20)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if limit < 1 || limit > 1000 {
		s.fail(w, r, badRequest("limit must be 1 to 1000"))
		return
	}
	kind, err := kindParam(r)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	reports := s.tel.Reports(kind, time.Now(), tenantReportAge)
	tmhttp.WriteJSON(w, http.StatusOK, rebalancer.LargestTenants(reports, limit))
}
