package aggregate

import (
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/shardkit/events"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// MaxCommandBytes bounds a command's body.
const MaxCommandBytes = 64 << 10

// RouteTable is what the service serves, for the route registry.
var RouteTable = []schema.Route{
	{Method: "POST", Prefix: "/commands", Kind: "aggregate"},
	{Method: "GET", Prefix: "/aggregates/", Kind: "aggregate"},
	{Method: "GET", Prefix: "/ledger/", Kind: "aggregate"},
}

// Mount registers the tenant routes on r, each behind gate (shardkit's placement gate), and
// the admin size route behind admin (shardkit's token check).
func (s *Service) Mount(r chi.Router, gate, admin func(http.Handler) http.Handler) {
	r.With(gate).Post("/commands", s.handleCommand)
	r.With(gate).Get("/aggregates/{type}/{id}", s.handleGet)
	r.With(gate).Get("/ledger/totals", s.handleTotals)
	r.With(admin).Get("/admin/aggregate/size", s.handleSize)
}

func tenantOf(r *http.Request) string { return r.Header.Get(tmhttp.HeaderTenant) }

func (s *Service) handleCommand(w http.ResponseWriter, r *http.Request) {
	tenant := tenantOf(r)
	var cmd Command
	if err := tmhttp.ReadJSON(w, r, MaxCommandBytes, &cmd); err != nil {
		writeErr(w, r, fmt.Errorf("%w: the body must be one JSON command {aggregate_type, aggregate_id, command, payload, expected_version?, idempotency_key}: %v", ErrBadPayload, err), tenant)
		return
	}
	if cmd.IdempotencyKey == "" {
		cmd.IdempotencyKey = r.Header.Get("Idempotency-Key")
	}
	res, err := s.Handle(r.Context(), tenant, cmd)
	if err != nil {
		writeErr(w, r, err, tenant)
		return
	}
	status := http.StatusCreated
	if res.Replayed {
		status = http.StatusOK
		w.Header().Set("Idempotent-Replayed", "true")
	}
	tmhttp.WriteJSON(w, status, res)
}

func (s *Service) handleGet(w http.ResponseWriter, r *http.Request) {
	tenant := tenantOf(r)
	if typ := chi.URLParam(r, "type"); typ != AccountType {
		writeErr(w, r, fmt.Errorf("%w %q: the ledger has only %q", ErrUnknownAggregate, typ, AccountType), tenant)
		return
	}
	acc, err := s.Account(r.Context(), tenant, chi.URLParam(r, "id"))
	if err != nil {
		writeErr(w, r, err, tenant)
		return
	}
	tmhttp.WriteJSON(w, http.StatusOK, acc)
}

func (s *Service) handleTotals(w http.ResponseWriter, r *http.Request) {
	tenant := tenantOf(r)
	t, seq, err := s.Totals(r.Context(), tenant)
	if err != nil {
		writeErr(w, r, err, tenant)
		return
	}
	tmhttp.WriteJSON(w, http.StatusOK, struct {
		Totals
		Tenant  string `json:"tenant"`
		Applied uint64 `json:"applied"`
	}{t, tenant, seq})
}

func (s *Service) handleSize(w http.ResponseWriter, r *http.Request) {
	tenant := r.URL.Query().Get("tenant_id")
	if err := schema.CheckTenant(tenant); err != nil {
		writeErr(w, r, err, tenant)
		return
	}
	sz, err := s.TenantSize(r.Context(), tenant)
	if err != nil {
		writeErr(w, r, err, tenant)
		return
	}
	tmhttp.WriteJSON(w, http.StatusOK, sz)
}

// writeErr answers err as problem+json (or a gRPC status: tmhttp.WriteProblem).
func writeErr(w http.ResponseWriter, r *http.Request, err error, tenant string) {
	tmhttp.WriteError(w, r, problemOf(err), tenant, "aggregate")
}

// problemOf is the one place that maps the service's errors to their answers, for HTTP and
// gRPC alike.
func problemOf(err error) error {
	status, typ, title := 0, "", ""
	switch {
	case errors.Is(err, ErrBadPayload), errors.Is(err, ErrUnknownCommand):
		status, typ, title = http.StatusBadRequest, "bad-command", "Bad command"
	case errors.Is(err, ErrUnknownAggregate), errors.Is(err, ErrNoAccount):
		status, typ, title = http.StatusNotFound, "not-found", "Not found"
	case errors.Is(err, ErrVersionConflict), errors.Is(err, ErrAccountExists):
		status, typ, title = http.StatusConflict, "conflict", "Conflict"
	case errors.Is(err, ErrInsufficient), errors.Is(err, ErrAccountClosed), errors.Is(err, ErrNotEmpty):
		status, typ, title = http.StatusConflict, "rejected", "Command rejected by the ledger"
	}
	if status == 0 && (errors.Is(err, events.ErrStore) || schema.IsUnavailable(err)) {
		return &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "store-unavailable", Title: "Event store unavailable",
			Detail:     "the event store did not answer in time; the command may or may not have been applied: retry it with the same idempotency key",
			RetryAfter: time.Second}
	}
	if status != 0 {
		return &tmhttp.Error{Status: status, Type: typ, Title: title, Detail: err.Error()}
	}
	return err
}
