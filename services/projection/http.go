package projection

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// RouteTable is what the service serves, for the route registry.
var RouteTable = []schema.Route{
	{Method: "POST", Prefix: "/query/", Kind: Kind},
	{Method: "GET", Prefix: "/views", Kind: Kind},
}

// Mount registers the tenant routes on r behind gate (shardkit's placement gate), and the admin
// checkpoint route behind admin (shardkit's token check).
func (s *Service) Mount(r chi.Router, gate, admin func(http.Handler) http.Handler) {
	r.With(gate).Post("/query/{view}", s.handleQuery)
	r.With(gate).Get("/views", s.handleViews)
	r.With(admin).Get("/admin/projection/tenant", s.handleTenant)
}

// Result is the answer to a query.
type Result struct {
	View       string `json:"view"`
	Items      []any  `json:"items"`
	NextCursor string `json:"next_cursor,omitempty"`
	// Applied is the stream sequence of the tenant's last applied event; Lag the stream
	// sequence of its last event minus Applied (0: the views are current).
	Applied uint64 `json:"applied"`
	Lag     uint64 `json:"lag"`
}

// Query runs q against the tenant's view, adding the tenant (and waiting up to QueryWait for
// its catch-up) if this instance does not hold it yet.
func (s *Service) Query(ctx context.Context, tenant, viewType string, q Query) (Result, error) {
	v := Views[viewType]
	if v == nil {
		return Result{}, unknownView(viewType)
	}
	p, err := compile(v, q)
	if err != nil {
		return Result{}, err
	}
	ts := s.host(tenant)
	wctx, cancel := context.WithTimeout(ctx, s.cfg.QueryWait)
	defer cancel()
	select {
	case <-ts.caught:
	case <-wctx.Done():
		return Result{}, fmt.Errorf("%w: %s has applied up to sequence %d so far; retry shortly", ErrWarming, tenant, ts.appliedSeq())
	}
	ts.mu.RLock()
	if ts.refused != nil {
		err := ts.refused
		ts.mu.RUnlock()
		return Result{}, fmt.Errorf("%w: %w", ErrRefused, err)
	}
	items, next, scanned := p.run(ts)
	applied := ts.applied
	ts.mu.RUnlock()
	s.m.scanned.WithLabelValues(v.name).Observe(float64(scanned))
	res := Result{View: v.name, Items: items, NextCursor: next, Applied: applied}
	last, err := s.st.lastSeq(ctx, tenant)
	if err != nil {
		return Result{}, err
	}
	if last > applied {
		res.Lag = last - applied
	}
	s.m.viewLag.WithLabelValues(v.name).Observe(float64(res.Lag))
	return res, nil
}

func tenantOf(r *http.Request) string { return r.Header.Get(tmhttp.HeaderTenant) }

func (s *Service) handleQuery(w http.ResponseWriter, r *http.Request) {
	tenant, viewType := tenantOf(r), chi.URLParam(r, "view")
	if Views[viewType] == nil {
		s.m.queries.WithLabelValues("unknown", "bad").Inc()
		writeErr(w, r, unknownView(viewType), tenant)
		return
	}
	q, err := decodeQuery(w, r)
	if err == nil {
		var res Result
		start := time.Now()
		if res, err = s.Query(r.Context(), tenant, viewType, q); err == nil {
			s.m.queries.WithLabelValues(viewType, "ok").Inc()
			s.m.queryTime.WithLabelValues(viewType).Observe(time.Since(start).Seconds())
			tmhttp.WriteJSON(w, http.StatusOK, res)
			return
		}
	}
	result := "error"
	if errors.Is(err, ErrBadQuery) {
		result = "bad"
	}
	s.m.queries.WithLabelValues(viewType, result).Inc()
	writeErr(w, r, err, tenant)
}

// decodeQuery reads one JSON query from the body (an empty body is the empty query).
func decodeQuery(w http.ResponseWriter, r *http.Request) (Query, error) {
	var q Query
	err := tmhttp.ReadJSON(w, r, MaxQueryBytes, &q)
	var mbe *http.MaxBytesError
	switch {
	case err == nil:
		return q, nil
	case errors.Is(err, io.EOF):
		return Query{}, nil
	case errors.As(err, &mbe):
		return Query{}, badQuery("the body is over %d bytes", MaxQueryBytes)
	case errors.Is(err, tmhttp.ErrNotOneValue):
		return Query{}, badQuery("the body must hold exactly one JSON object")
	}
	return Query{}, badQuery("the body must be one JSON object {\"filter\": [{\"field\", \"op\", \"value\"}], \"sort\": [{\"field\", \"desc\"}], \"limit\", \"cursor\"}: %v", err)
}

// ViewInfo describes a view type for GET /views.
type ViewInfo struct {
	Name   string            `json:"name"`
	About  string            `json:"about"`
	Key    string            `json:"key"`
	Fields map[string]string `json:"fields"`
	Ops    map[string]string `json:"ops"`
}

// Describe lists the view types with their fields and the ops each field allows.
func Describe() []ViewInfo {
	var out []ViewInfo
	for _, name := range ViewNames() {
		v := Views[name]
		vi := ViewInfo{Name: v.name, About: v.about, Key: v.key, Fields: map[string]string{}, Ops: map[string]string{}}
		for _, f := range v.fields {
			vi.Fields[f.name] = f.typ.String()
		}
		for t, ops := range typeOps {
			vi.Ops[t.String()] = fmt.Sprint(ops)
		}
		out = append(out, vi)
	}
	return out
}

func (s *Service) handleViews(w http.ResponseWriter, r *http.Request) {
	tmhttp.WriteJSON(w, http.StatusOK, struct {
		Views    []ViewInfo `json:"views"`
		MaxLimit int        `json:"max_limit"`
		Default  int        `json:"default_limit"`
	}{Describe(), MaxLimit, DefaultLimit})
}

// TenantInfo is a tenant's projection state on this instance.
type TenantInfo struct {
	Tenant     string     `json:"tenant"`
	Hosted     bool       `json:"hosted"`
	Applied    uint64     `json:"applied"`
	Lag        uint64     `json:"lag"`
	Pending    uint64     `json:"pending"`
	Checkpoint Checkpoint `json:"checkpoint"`
}

// handleTenant reports a tenant's applied sequence, lag, exact count of unapplied events and
// stored checkpoint: GET /admin/projection/tenant?tenant_id=.
func (s *Service) handleTenant(w http.ResponseWriter, r *http.Request) {
	tenant := r.URL.Query().Get("tenant_id")
	if err := schema.CheckTenant(tenant); err != nil {
		writeErr(w, r, err, tenant)
		return
	}
	info, err := s.TenantInfo(r.Context(), tenant)
	if err != nil {
		writeErr(w, r, err, tenant)
		return
	}
	tmhttp.WriteJSON(w, http.StatusOK, info)
}

// TenantInfo reports the tenant's state here: Lag is the sequence distance, Pending the number
// of the tenant's events not applied yet.
func (s *Service) TenantInfo(ctx context.Context, tenant string) (TenantInfo, error) {
	info := TenantInfo{Tenant: tenant, Hosted: s.lookup(tenant) != nil}
	var err error
	if info.Lag, info.Applied, err = s.lag(ctx, tenant); err != nil {
		return info, err
	}
	if info.Lag > 0 {
		if info.Pending, err = s.st.pending(ctx, tenant, info.Applied); err != nil {
			return info, err
		}
	}
	info.Checkpoint, err = s.st.checkpoint(ctx, tenant)
	return info, err
}

// writeErr is the one place that maps the service's errors to HTTP.
func writeErr(w http.ResponseWriter, r *http.Request, err error, tenant string) {
	tmhttp.WriteError(w, r, problemOf(err), tenant, Kind)
}

// problemOf maps the service's errors to their answers, for HTTP and gRPC alike.
func problemOf(err error) error {
	var e *tmhttp.Error
	switch {
	case errors.Is(err, ErrBadQuery):
		e = &tmhttp.Error{Status: http.StatusBadRequest, Type: "bad-query", Title: "Bad query", Detail: err.Error()}
	case errors.Is(err, ErrUnknownView):
		e = &tmhttp.Error{Status: http.StatusNotFound, Type: "unknown-view", Title: "Unknown view type", Detail: err.Error()}
	case errors.Is(err, ErrWarming):
		e = &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "warming", Title: "Views are catching up", Detail: err.Error(), RetryAfter: time.Second}
	case errors.Is(err, ErrRefused):
		e = &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "newer-format", Title: "Views stopped at a newer event format",
			Detail: err.Error(), RetryAfter: 30 * time.Second}
	case schema.IsUnavailable(err):
		e = &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "store-unavailable", Title: "Event store unavailable",
			Detail: "the event store did not answer in time; retry the query", RetryAfter: time.Second}
	}
	if e != nil {
		return e
	}
	return err
}
