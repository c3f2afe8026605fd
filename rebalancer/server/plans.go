package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

func (s *Server) registerPlanRoutes(r chi.Router) {
	r.Get("/api/plans", s.handleListPlans)
	r.Post("/api/plans", s.handleCreatePlan)
	r.Get("/api/plans/{id}", s.handleGetPlan)
	r.Post("/api/plans/{id}/apply", s.handleApply)
	r.Post("/api/plans/{id}/rollback", s.handleRollback)
	r.Post("/api/plans/{id}/pause", s.handleControl(rebalancer.ControlPause))
	r.Post("/api/plans/{id}/resume", s.handleControl(""))
	r.Post("/api/plans/{id}/cancel", s.handleControl(rebalancer.ControlCancel))
	r.Get("/api/leader", s.handleLeader)
}

// ControlRequest is the optional body of POST /api/plans/{id}/pause|resume|cancel.
type ControlRequest struct {
	Actor string `json:"actor,omitempty"`
}

// handleControl pauses, resumes ("") or cancels a plan. A pause or cancel of a plan being
// applied takes effect at its next move (202); resuming applies the plan again here (the
// leader), from where it stopped.
func (s *Server) handleControl(c rebalancer.Control) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var req ControlRequest
		if r.ContentLength != 0 {
			if err := tmhttp.ReadJSON(w, r, 1<<16, &req); err != nil && !errors.Is(err, io.EOF) {
				s.fail(w, r, badRequest(`the body is optional: {"actor": "who asks"}: `+err.Error()))
				return
			}
		}
		actor := req.Actor
		if actor == "" {
			actor = "api"
		}
		id := chi.URLParam(r, "id")
		if c == "" && !s.IsLeader() {
			s.fail(w, r, s.notLeader(r.Context()))
			return
		}
		rec, err := s.eng.SetControl(r.Context(), id, c, actor)
		if err != nil {
			s.fail(w, r, err)
			return
		}
		if c == "" {
			apply := func(ctx context.Context) (rebalancer.PlanRecord, error) { return s.eng.Apply(ctx, id) }
			if rec.Origin == "autopilot" && !rec.Proposed {
				s.auto.Adopt(s.leaderContext(), rec)
			} else if err := s.startWork(r.Context(), id, apply); err != nil {
				s.fail(w, r, err)
				return
			}
			rec.Status = rebalancer.PlanApplying
		}
		w.Header().Set("Location", "/api/plans/"+id)
		tmhttp.WriteJSON(w, http.StatusAccepted, rec)
	}
}

// PlanRequest is the body of POST /api/plans: a planner request, plus DryRun to only compute
// the plan and Actor to name who asked (default "api").
type PlanRequest struct {
	planner.Request
	DryRun bool   `json:"dry_run,omitempty"`
	Actor  string `json:"actor,omitempty"`
}

// PlanResponse is one plan with its moves (GET /api/plans/{id}, POST /api/plans).
type PlanResponse struct {
	Plan  rebalancer.PlanRecord   `json:"plan"`
	Moves []rebalancer.MoveRecord `json:"moves"`
}

func (s *Server) handleListPlans(w http.ResponseWriter, r *http.Request) {
	limit, err := intParam(r, "limit", 50)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	sums, err := s.eng.Summaries(r.Context(), limit)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if sums == nil {
		sums = []rebalancer.PlanSummary{}
	}
	tmhttp.WriteJSON(w, http.StatusOK, sums)
}

func (s *Server) handleCreatePlan(w http.ResponseWriter, r *http.Request) {
	var req PlanRequest
	if err := tmhttp.ReadJSON(w, r, 1<<20, &req); err != nil {
		s.fail(w, r, badRequest("the body must be a JSON plan request (strategy, kind, shard, moves, tenant, targets, tolerance, budget, concurrency, require, dry_run): "+err.Error()))
		return
	}
	p, err := rebalancer.MakePlan(r.Context(), s.st, req.Request, rebalancer.WorldOptions{Telemetry: s.tel, Thresholds: s.cfg.Health.Thresholds})
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if req.DryRun {
		tmhttp.WriteJSON(w, http.StatusOK, map[string]any{"plan": p})
		return
	}
	actor := req.Actor
	if actor == "" {
		actor = "api"
	}
	// Answer with the records as written: reading them back could fail (or, from a replica
	// that is behind, miss them) after the plan was stored, and a client that retried would
	// store a second plan.
	rec, moves, err := s.eng.CreatePlanMoves(r.Context(), p, actor)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	w.Header().Set("Location", "/api/plans/"+rec.ID)
	tmhttp.WriteJSON(w, http.StatusCreated, PlanResponse{Plan: rec, Moves: moves})
}

func (s *Server) handleGetPlan(w http.ResponseWriter, r *http.Request) {
	rec, moves, err := s.eng.Plan(r.Context(), chi.URLParam(r, "id"))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if moves == nil {
		moves = []rebalancer.MoveRecord{}
	}
	tmhttp.WriteJSON(w, http.StatusOK, PlanResponse{Plan: rec, Moves: moves})
}

func (s *Server) handleApply(w http.ResponseWriter, r *http.Request) {
	s.startPlanWork(w, r, "applying", s.eng.Apply)
}

func (s *Server) handleRollback(w http.ResponseWriter, r *http.Request) {
	s.startPlanWork(w, r, "rolling_back", s.eng.Rollback)
}

// startPlanWork checks the plan exists and is not finished, then starts fn in the background.
func (s *Server) startPlanWork(w http.ResponseWriter, r *http.Request, what string, fn func(context.Context, string) (rebalancer.PlanRecord, error)) {
	id := chi.URLParam(r, "id")
	rec, _, err := s.eng.Plan(r.Context(), id)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if what == "applying" && rec.Status.Finished() {
		s.fail(w, r, &tmhttp.Error{Status: http.StatusConflict, Type: "plan-finished", Title: "Plan already finished",
			Detail: fmt.Sprintf("plan %s is %s; make a new plan", id, rec.Status)})
		return
	}
	if err := s.startWork(r.Context(), id, func(ctx context.Context) (rebalancer.PlanRecord, error) { return fn(ctx, id) }); err != nil {
		s.fail(w, r, err)
		return
	}
	w.Header().Set("Location", "/api/plans/"+id)
	tmhttp.WriteJSON(w, http.StatusAccepted, map[string]string{"plan": id, "status": what, "events": "/api/events"})
}

func (s *Server) handleLeader(w http.ResponseWriter, r *http.Request) {
	l, ok, err := rebalancer.Lease(r.Context(), s.st, time.Now())
	if err != nil {
		s.fail(w, r, err)
		return
	}
	out := map[string]any{"self": s.cfg.Holder, "leading": s.IsLeader()}
	if ok {
		out["holder"], out["expires"] = l.Holder, l.Expires
	}
	s.mu.Lock()
	if s.busy != "" {
		out["applying"] = s.busy
	}
	s.mu.Unlock()
	tmhttp.WriteJSON(w, http.StatusOK, out)
}

// errorFor maps the rebalancer's errors to HTTP answers; schema errors are mapped by tmhttp.
func errorFor(err error) error {
	var te *tmhttp.Error
	switch {
	case errors.As(err, &te):
		return err
	case errors.Is(err, rebalancer.ErrPlanNotFound):
		return &tmhttp.Error{Status: http.StatusNotFound, Type: "plan-not-found", Title: "Plan not found", Detail: err.Error()}
	case errors.Is(err, errNotLeader):
		return &tmhttp.Error{Status: http.StatusConflict, Type: "not-leader", Title: "Not the leader", Detail: err.Error()}
	case errors.Is(err, errBusy):
		return &tmhttp.Error{Status: http.StatusConflict, Type: "busy", Title: "An apply is in progress", Detail: err.Error()}
	case errors.Is(err, rebalancer.ErrPlanState):
		return &tmhttp.Error{Status: http.StatusConflict, Type: "plan-state", Title: "Not possible in the plan's state", Detail: err.Error()}
	case errors.Is(err, planner.ErrInvalid), errors.Is(err, planner.ErrUnknownTenant), errors.Is(err, planner.ErrPinned),
		errors.Is(err, planner.ErrLabels), errors.Is(err, planner.ErrBudget), errors.Is(err, planner.ErrNoCapacity):
		return &tmhttp.Error{Status: http.StatusUnprocessableEntity, Type: "plan-infeasible", Title: "The plan cannot be made", Detail: err.Error()}
	}
	return err
}

func (s *Server) fail(w http.ResponseWriter, r *http.Request, err error) {
	err = errorFor(err)
	switch p := tmhttp.FromError(err); {
	case p.Status == http.StatusServiceUnavailable:
		s.log.Warn("request failed for now", "method", r.Method, "path", r.URL.Path, "err", err)
	case p.Status >= 500:
		s.log.Error("request failed", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	tmhttp.WriteError(w, r, err, r.URL.Query().Get("tenant"), r.URL.Query().Get("kind"))
}

func badRequest(detail string) error {
	return &tmhttp.Error{Status: http.StatusBadRequest, Type: "invalid-request", Title: "Invalid request", Detail: detail}
}

func intParam(r *http.Request, name string, def int) (int, error) {
	v := r.URL.Query().Get(name)
	if v == "" {
		return def, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		return 0, badRequest(fmt.Sprintf("%s=%q must be a number >= 0", name, v))
	}
	return n, nil
}
