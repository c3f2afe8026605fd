package server

import (
	"net/http"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/rebalancer/autopilot"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// registerAutopilotRoutes serves the autopilot's status, change freezes and maintenance marks.
func (s *Server) registerAutopilotRoutes(r chi.Router) {
	r.Get("/api/autopilot", s.handleAutopilot)
	r.Put("/api/autopilot/freeze", s.handleFreeze)
	r.Delete("/api/autopilot/freeze", s.handleUnfreeze)
	r.Put("/api/autopilot/maintenance/{kind}/{shard}", s.handleMaintenance(true))
	r.Delete("/api/autopilot/maintenance/{kind}/{shard}", s.handleMaintenance(false))
}

func (s *Server) handleAutopilot(w http.ResponseWriter, r *http.Request) {
	st, err := s.auto.Status(r.Context())
	if err != nil {
		s.fail(w, r, err)
		return
	}
	tmhttp.WriteJSON(w, http.StatusOK, st)
}

// FreezeRequest is the body of PUT /api/autopilot/freeze: until a time, or for a duration.
type FreezeRequest struct {
	Until  time.Time `json:"until,omitzero"`
	For    string    `json:"for,omitempty"`
	Reason string    `json:"reason"`
	Actor  string    `json:"actor,omitempty"`
}

func (s *Server) handleFreeze(w http.ResponseWriter, r *http.Request) {
	var req FreezeRequest
	if err := tmhttp.ReadJSON(w, r, 1<<16, &req); err != nil {
		s.fail(w, r, badRequest(`the body is {"for": "2h"} or {"until": "2026-12-01T06:00:00Z"}, with "reason": `+err.Error()))
		return
	}
	until := req.Until
	if req.For != "" {
		d, err := time.ParseDuration(req.For)
		if err != nil || d <= 0 {
			s.fail(w, r, badRequest(`"for" is a positive duration such as "2h" or "30m"`))
			return
		}
		until = time.Now().Add(d)
	}
	if until.IsZero() || req.Reason == "" {
		s.fail(w, r, badRequest(`a freeze needs an end ("for" or "until") and a "reason" that says why`))
		return
	}
	st, err := autopilot.FreezeUntil(r.Context(), s.st, until, req.Reason, actorOr(req.Actor))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	tmhttp.WriteJSON(w, http.StatusOK, st)
}

func (s *Server) handleUnfreeze(w http.ResponseWriter, r *http.Request) {
	st, err := autopilot.Unfreeze(r.Context(), s.st)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	tmhttp.WriteJSON(w, http.StatusOK, st)
}

// MaintenanceRequest is the body of PUT /api/autopilot/maintenance/{kind}/{shard}.
type MaintenanceRequest struct {
	Reason string `json:"reason"`
	Actor  string `json:"actor,omitempty"`
}

func (s *Server) handleMaintenance(on bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var req MaintenanceRequest
		if on {
			if err := tmhttp.ReadJSON(w, r, 1<<16, &req); err != nil || req.Reason == "" {
				s.fail(w, r, badRequest(`the body is {"reason": "why the shard goes down"}`))
				return
			}
		}
		st, err := autopilot.SetMaintenance(r.Context(), s.st, chi.URLParam(r, "kind"), chi.URLParam(r, "shard"), on, req.Reason, actorOr(req.Actor))
		if err != nil {
			s.fail(w, r, err)
			return
		}
		tmhttp.WriteJSON(w, http.StatusOK, st)
	}
}

func actorOr(a string) string {
	if a == "" {
		return "api"
	}
	return a
}
