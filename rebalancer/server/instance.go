package server

import (
	"errors"
	"io"
	"net/http"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// registerInstanceRoutes serves one instance's page and its operator flag.
func (s *Server) registerInstanceRoutes(r chi.Router) {
	r.Get("/api/instances/{key}", s.handleInstance)
	r.Put("/api/instances/{key}/degraded", s.handleSetDegraded)
	r.Delete("/api/instances/{key}/degraded", s.handleClearDegraded)
}

// handleInstance is one instance's page: fields, tenants, recent runs, circuits, history.
func (s *Server) handleInstance(w http.ResponseWriter, r *http.Request) {
	d, err := rebalancer.Detail(r.Context(), s.st, chi.URLParam(r, "key"), s.cfg.Health,
		rebalancer.DetailSources{Telemetry: s.tel, Circuits: s.circuits}, time.Now())
	if err != nil {
		s.fail(w, r, err)
		return
	}
	tmhttp.WriteJSON(w, http.StatusOK, d)
}

// DegradedRequest is the body of PUT /api/instances/{key}/degraded.
type DegradedRequest struct {
	// Reason says why, for the dashboard and the audit journal.
	Reason string `json:"reason"`
}

// handleSetDegraded flags an instance degraded by hand: gateways and planners treat it like any
// degraded instance until the flag is cleared.
func (s *Server) handleSetDegraded(w http.ResponseWriter, r *http.Request) {
	var req DegradedRequest
	if err := tmhttp.ReadJSON(w, r, 16<<10, &req); err != nil && !errors.Is(err, io.EOF) {
		s.fail(w, r, badRequest(`the body must be {"reason": "..."}: `+err.Error()))
		return
	}
	s.setDegraded(w, r, true, req.Reason)
}

func (s *Server) handleClearDegraded(w http.ResponseWriter, r *http.Request) {
	s.setDegraded(w, r, false, "cleared")
}

func (s *Server) setDegraded(w http.ResponseWriter, r *http.Request, on bool, reason string) {
	inst, err := rebalancer.SetDegraded(r.Context(), s.st, chi.URLParam(r, "key"), on, reason, "api/"+s.cfg.Holder)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	now := time.Now()
	tmhttp.WriteJSON(w, http.StatusOK, rebalancer.InstanceView{Instance: inst, Key: inst.Key(), Status: s.cfg.Health.Status(inst, now),
		HeartbeatAge: now.Sub(inst.Heartbeat).Seconds()})
}
