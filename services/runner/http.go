package runner

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// MaxBodyBytes bounds a POST /jobs body.
const MaxBodyBytes = MaxPayloadBytes + 4<<10

// RouteTable is what the service serves, for the route registry.
var RouteTable = []schema.Route{
	{Method: "POST", Prefix: "/jobs", Kind: Kind},
	{Method: "GET", Prefix: "/jobs", Kind: Kind},
	{Method: "POST", Prefix: "/schedules", Kind: Kind},
	{Method: "GET", Prefix: "/schedules", Kind: Kind},
	{Method: "DELETE", Prefix: "/schedules", Kind: Kind},
}

// Mount registers the tenant routes behind gate (shardkit's placement gate) and the instance
// views behind admin (shardkit's token check).
func (s *Service) Mount(r chi.Router, gate, admin func(http.Handler) http.Handler) {
	a := &api{s: s}
	r.With(gate).Post("/jobs", a.handleCreate)
	r.With(gate).Get("/jobs", a.handleList)
	r.With(gate).Get("/jobs/{id}", a.handleGet)
	s.sched.mount(r, gate)
	r.With(admin).Get("/admin/runner/status", a.handleStatus)
	r.With(admin).Get("/admin/runner/instances", a.handleInstances)
	r.With(admin).Get("/admin/runner/tenant", a.handleTenant)
}

// api serves the runner's HTTP routes.
type api struct{ s *Service }

func tenantOf(r *http.Request) string { return r.Header.Get(tmhttp.HeaderTenant) }

func (a *api) handleCreate(w http.ResponseWriter, r *http.Request) {
	tenant := tenantOf(r)
	var nj NewJob
	if err := tmhttp.ReadJSON(w, r, MaxBodyBytes, &nj); err != nil {
		writeErr(w, r, fmt.Errorf("%w: the body must be one JSON job {type, payload?, instance?, idempotency_key?}: %v", ErrBadJob, err), tenant)
		return
	}
	if nj.IdempotencyKey == "" {
		nj.IdempotencyKey = r.Header.Get("Idempotency-Key")
	}
	run, created, err := a.s.Create(r.Context(), tenant, nj)
	if err != nil {
		writeErr(w, r, err, tenant)
		return
	}
	w.Header().Set("Location", "/jobs/"+run.ID)
	if !created {
		w.Header().Set("Idempotent-Replayed", "true")
		tmhttp.WriteJSON(w, http.StatusOK, run)
		return
	}
	tmhttp.WriteJSON(w, http.StatusAccepted, run)
}

func (a *api) handleGet(w http.ResponseWriter, r *http.Request) {
	tenant := tenantOf(r)
	ctx, cancel := context.WithTimeout(r.Context(), a.s.cfg.OpTimeout)
	defer cancel()
	run, err := a.s.Get(ctx, tenant, chi.URLParam(r, "id"))
	if err != nil {
		writeErr(w, r, err, tenant)
		return
	}
	tmhttp.WriteJSON(w, http.StatusOK, run)
}

func (a *api) handleList(w http.ResponseWriter, r *http.Request) {
	tenant := tenantOf(r)
	limit := 100
	if v := r.URL.Query().Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 1000 {
			writeErr(w, r, fmt.Errorf("%w: limit must be 1 to 1000", ErrBadJob), tenant)
			return
		}
		limit = n
	}
	ctx, cancel := context.WithTimeout(r.Context(), 4*a.s.cfg.OpTimeout)
	defer cancel()
	runs, err := a.s.List(ctx, tenant, Status(r.URL.Query().Get("status")), limit)
	if err != nil {
		writeErr(w, r, err, tenant)
		return
	}
	tmhttp.WriteJSON(w, http.StatusOK, struct {
		Tenant string `json:"tenant"`
		Jobs   []Run  `json:"jobs"`
	}{tenant, runs})
}

func (a *api) handleStatus(w http.ResponseWriter, r *http.Request) {
	tmhttp.WriteJSON(w, http.StatusOK, a.s.Status())
}

func (a *api) handleInstances(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), a.s.cfg.OpTimeout)
	defer cancel()
	views, err := a.s.Instances(ctx)
	if err != nil {
		writeErr(w, r, err, "")
		return
	}
	tmhttp.WriteJSON(w, http.StatusOK, struct {
		Instances []InstanceView `json:"instances"`
	}{views})
}

// writeErr is the one place that maps the service's errors to HTTP.
func writeErr(w http.ResponseWriter, r *http.Request, err error, tenant string) {
	tmhttp.WriteError(w, r, problemOf(err), tenant, Kind)
}

// problemOf maps the service's errors to their answers, for HTTP and gRPC alike.
func problemOf(err error) error {
	var e *tmhttp.Error
	switch {
	case errors.Is(err, schema.ErrInvalidTenant):
		e = &tmhttp.Error{Status: http.StatusBadRequest, Type: "bad-tenant", Title: "Bad tenant id"}
	case errors.Is(err, ErrBadJob), errors.Is(err, ErrUnknownType):
		e = &tmhttp.Error{Status: http.StatusBadRequest, Type: "bad-job", Title: "Bad job"}
	case errors.Is(err, ErrBadSchedule):
		e = &tmhttp.Error{Status: http.StatusBadRequest, Type: "bad-schedule", Title: "Bad schedule"}
	case errors.Is(err, ErrNoSchedule):
		e = &tmhttp.Error{Status: http.StatusNotFound, Type: "not-found", Title: "No such schedule"}
	case errors.Is(err, ErrScheduleExists):
		e = &tmhttp.Error{Status: http.StatusConflict, Type: "schedule-exists", Title: "Schedule exists"}
	case errors.Is(err, ErrNoJob):
		e = &tmhttp.Error{Status: http.StatusNotFound, Type: "not-found", Title: "No such job"}
	case errors.Is(err, ErrQueueFull):
		retry := time.Second
		var qf *queueFullError
		if errors.As(err, &qf) {
			retry = qf.retry
		}
		e = &tmhttp.Error{Status: http.StatusTooManyRequests, Type: "queue-full", Title: "Tenant queue full", RetryAfter: retry}
	case schema.IsUnavailable(err):
		e = &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "store-unavailable", Title: "Job store unavailable",
			Detail: "the job store did not answer in time; retry with the same Idempotency-Key to create the job once", RetryAfter: time.Second}
	default:
		return err
	}
	if e.Detail == "" {
		e.Detail = err.Error()
	}
	return e
}
