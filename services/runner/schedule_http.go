package runner

import (
	"context"
	"fmt"
	"net/http"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// MaxScheduleBodyBytes bounds a POST /schedules body.
const MaxScheduleBodyBytes = MaxBodyBytes

// mount registers the schedule routes behind gate.
func (sc *Scheduler) mount(r chi.Router, gate func(http.Handler) http.Handler) {
	r.With(gate).Post("/schedules", sc.handleCreate)
	r.With(gate).Get("/schedules", sc.handleList)
	r.With(gate).Get("/schedules/{id}", sc.handleGet)
	r.With(gate).Delete("/schedules/{id}", sc.handleDelete)
}

func (sc *Scheduler) handleCreate(w http.ResponseWriter, r *http.Request) {
	tenant := tenantOf(r)
	var ns NewSchedule
	if err := tmhttp.ReadJSON(w, r, MaxScheduleBodyBytes, &ns); err != nil {
		writeErr(w, r, fmt.Errorf("%w: the body must be one JSON schedule {id?, cron, job: {type, payload?, instance?}}: %v", ErrBadSchedule, err), tenant)
		return
	}
	sch, err := sc.Create(r.Context(), tenant, ns)
	if err != nil {
		writeErr(w, r, err, tenant)
		return
	}
	w.Header().Set("Location", "/schedules/"+sch.ID)
	tmhttp.WriteJSON(w, http.StatusCreated, sch)
}

func (sc *Scheduler) handleGet(w http.ResponseWriter, r *http.Request) {
	tenant := tenantOf(r)
	ctx, cancel := context.WithTimeout(r.Context(), sc.s.cfg.OpTimeout)
	defer cancel()
	sch, err := sc.Get(ctx, tenant, chi.URLParam(r, "id"))
	if err != nil {
		writeErr(w, r, err, tenant)
		return
	}
	tmhttp.WriteJSON(w, http.StatusOK, sch)
}

func (sc *Scheduler) handleList(w http.ResponseWriter, r *http.Request) {
	tenant := tenantOf(r)
	ctx, cancel := context.WithTimeout(r.Context(), 4*sc.s.cfg.OpTimeout)
	defer cancel()
	list, err := sc.List(ctx, tenant)
	if err != nil {
		writeErr(w, r, err, tenant)
		return
	}
	tmhttp.WriteJSON(w, http.StatusOK, struct {
		Tenant    string     `json:"tenant"`
		Schedules []Schedule `json:"schedules"`
	}{tenant, list})
}

func (sc *Scheduler) handleDelete(w http.ResponseWriter, r *http.Request) {
	tenant := tenantOf(r)
	ctx, cancel := context.WithTimeout(r.Context(), sc.s.cfg.OpTimeout)
	defer cancel()
	if err := sc.Delete(ctx, tenant, chi.URLParam(r, "id")); err != nil {
		writeErr(w, r, err, tenant)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}
