package shardkit

import (
	"context"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// Mount registers the admin routes (/admin/*, behind the bearer token) and /healthz, /readyz
// and /metrics (open) on the service's chi router. Mount them outside the Gate. A service on
// another router uses [Shard.MountMux] or [Shard.Handler].
func (s *Shard) Mount(r chi.Router) {
	for _, rt := range s.api.ownRoutes() {
		r.Method(rt.method, rt.path, rt.h)
	}
}

// MountMux registers the same routes as [Shard.Mount] on a net/http ServeMux, each with its
// method ("GET /healthz", "POST /admin/drain", ...), so the service's own patterns, "/"
// included, and its other /admin/... routes stay its own.
func (s *Shard) MountMux(mux *http.ServeMux) {
	for _, rt := range s.api.ownRoutes() {
		mux.Handle(rt.method+" "+rt.path, rt.h)
	}
}

// Handler serves the routes of [Shard.Mount] and answers 404 (problem+json) to anything
// else: for a router that can delegate a path, e.g. /healthz, /readyz, /metrics and /admin/.
func (s *Shard) Handler() http.Handler {
	mux := http.NewServeMux()
	s.MountMux(mux)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		tmhttp.WriteError(w, r, tmhttp.Errorf(http.StatusNotFound, "not-found", "Not found",
			r.Method+" "+r.URL.Path+" is not a shard route: the shard serves GET /healthz, /readyz, /metrics, /admin/tenants and /admin/drain, POST /admin/drain and /admin/reload, DELETE /admin/drain"), "", "")
	})
	return mux
}

// ownRoute is one of the shard's own routes.
type ownRoute struct {
	method, path string
	h            http.Handler
}

// adminAPI serves the shard's own routes: health, readiness, and the admin endpoints.
type adminAPI struct{ s *Shard }

// ownRoutes are the shard's routes: health and metrics open, /admin/* behind the admin token.
func (a *adminAPI) ownRoutes() []ownRoute {
	admin := func(f http.HandlerFunc) http.Handler { return a.s.requireToken(f) }
	return []ownRoute{
		{"GET", "/healthz", http.HandlerFunc(a.handleHealthz)},
		{"GET", "/readyz", http.HandlerFunc(a.handleReadyz)},
		{"GET", "/metrics", promhttp.HandlerFor(a.s.cfg.Gatherer, promhttp.HandlerOpts{})},
		{"POST", "/admin/drain", admin(a.handleDrain)},
		{"GET", "/admin/drain", admin(a.handleDrainStatus)},
		{"DELETE", "/admin/drain", admin(a.handleUndrain)},
		{"POST", "/admin/reload", admin(a.handleReload)},
		{"GET", "/admin/tenants", admin(a.handleTenants)},
		{"GET", "/admin/verify", admin(a.handleVerify)},
		{"POST", "/admin/verify/release", admin(a.handleVerifyRelease)},
	}
}

// requireToken admits requests bearing the admin token; without a configured token every
// admin request is refused.
func (s *Shard) requireToken(next http.Handler) http.Handler {
	return tmhttp.RequireBearer(s.cfg.AdminToken, EnvAdminToken)(next)
}

func (a *adminAPI) handleHealthz(w http.ResponseWriter, _ *http.Request) {
	tmhttp.WriteJSON(w, http.StatusOK, map[string]string{"status": "ok", "instance": a.s.self})
}

// Readiness is /readyz's body.
type Readiness struct {
	Ready    bool   `json:"ready"`
	Instance string `json:"instance"`
	Detail   string `json:"detail,omitempty"`
	// PlacementStaleness is how long the placement snapshot has been cut off from NATS.
	PlacementStaleness string `json:"placement_staleness,omitempty"`
}

func (a *adminAPI) handleReadyz(w http.ResponseWriter, _ *http.Request) {
	rd := Readiness{Ready: a.s.ready.Load(), Instance: a.s.self}
	if st := a.s.watcher.Staleness(); st > 0 {
		rd.PlacementStaleness = st.Round(time.Millisecond).String()
	}
	status := http.StatusOK
	if !rd.Ready {
		status = http.StatusServiceUnavailable
		rd.Detail = "starting: not registered yet"
		select {
		case <-a.s.running:
			rd.Detail = "shutting down: draining"
		default:
		}
	}
	tmhttp.WriteJSON(w, status, rd)
}

// TenantStatus is one hosted tenant's line in /admin/tenants and /admin/drain.
type TenantStatus struct {
	Tenant string `json:"tenant"`
	// Phase is what this instance reports: serving, warming, ready, draining or drained.
	Phase string `json:"phase"`
	// Placement is the placement's phase, Owner its shard and Epoch its epoch.
	Placement schema.Phase `json:"placement,omitempty"`
	Owner     string       `json:"owner,omitempty"`
	Epoch     uint64       `json:"epoch,omitempty"`
	InFlight  int64        `json:"in_flight"`
	Requests  uint64       `json:"requests"`
	Errors    uint64       `json:"errors"`
	Applied   uint64       `json:"applied"`
	Fence     uint64       `json:"fence,omitempty"`
	Lag       uint64       `json:"lag"`
	// Size is the tenant's stored size, if the service measures it (Hooks.Sizes).
	Size *schema.TenantSize `json:"size,omitempty"`
}

func (a *adminAPI) tenantStatus(ts *tenantState) TenantStatus {
	ts.mu.Lock()
	st := TenantStatus{Tenant: ts.tenant, Phase: string(ts.phase), Fence: ts.fence, Lag: ts.lag, Applied: ts.applied}
	ts.mu.Unlock()
	st.InFlight, st.Requests, st.Errors = ts.inflight.Load(), ts.requests.Load(), ts.errors.Load()
	if st.Phase == "" {
		st.Phase = "serving"
		if ts.draining.Load() {
			st.Phase = string(schema.SignalDraining)
		}
	}
	if a.s.cfg.Hooks.Applied != nil {
		st.Applied = a.s.cfg.Hooks.Applied(ts.tenant)
	}
	if e, ok := a.s.watcher.Lookup(a.s.kind, ts.tenant); ok {
		st.Placement, st.Owner, st.Epoch = e.Phase, e.Shard, e.Epoch
	}
	return st
}

// Tenants lists the tenants this instance holds state for, by name.
func (s *Shard) Tenants() []TenantStatus {
	var out []TenantStatus
	for _, ts := range s.states.all() {
		out = append(out, s.api.tenantStatus(ts))
	}
	slices.SortFunc(out, func(a, b TenantStatus) int { return strings.Compare(a.Tenant, b.Tenant) })
	return out
}

func (a *adminAPI) handleTenants(w http.ResponseWriter, _ *http.Request) {
	sizes, total := a.s.rep.sizes()
	by := make(map[string]*schema.TenantSize, len(sizes))
	for i := range sizes {
		by[sizes[i].Tenant] = &sizes[i]
	}
	tenants := a.s.Tenants()
	for i := range tenants {
		tenants[i].Size = by[tenants[i].Tenant]
	}
	if sizes == nil {
		sizes = []schema.TenantSize{}
	}
	// sizes lists every hosted tenant the service measures (largest first), also those
	// without requests since start, which tenants leaves out.
	tmhttp.WriteJSON(w, http.StatusOK, map[string]any{"instance": a.s.self, "tenants": tenants, "sizes": sizes, "stored_bytes": total})
}

// adminTenant reads and checks the tenant_id parameter.
func (a *adminAPI) adminTenant(w http.ResponseWriter, r *http.Request) (string, bool) {
	tenant := r.URL.Query().Get("tenant_id")
	if err := schema.CheckTenant(tenant); err != nil {
		tmhttp.WriteError(w, r, err, tenant, a.s.kind)
		return "", false
	}
	return tenant, true
}

// handleDrain starts draining a tenant and answers 202 at once; GET the same URL to follow it.
func (a *adminAPI) handleDrain(w http.ResponseWriter, r *http.Request) {
	tenant, ok := a.adminTenant(w, r)
	if !ok {
		return
	}
	ts := a.s.states.getOrCreate(tenant)
	ts.setDraining(true) // refuse new requests from now on, before the answer
	a.s.goTask(func() {
		if _, err := a.s.Drain(a.s.runCtx, tenant); err != nil {
			a.s.cfg.Logger.Warn("admin drain", "tenant", tenant, "err", err)
		}
	})
	tmhttp.WriteJSON(w, http.StatusAccepted, a.tenantStatus(ts))
}

func (a *adminAPI) handleDrainStatus(w http.ResponseWriter, r *http.Request) {
	tenant, ok := a.adminTenant(w, r)
	if !ok {
		return
	}
	ts := a.s.states.get(tenant)
	if ts == nil {
		tmhttp.WriteJSON(w, http.StatusOK, TenantStatus{Tenant: tenant, Phase: "serving"})
		return
	}
	tmhttp.WriteJSON(w, http.StatusOK, a.tenantStatus(ts))
}

func (a *adminAPI) handleUndrain(w http.ResponseWriter, r *http.Request) {
	tenant, ok := a.adminTenant(w, r)
	if !ok {
		return
	}
	if err := a.s.Undrain(r.Context(), tenant); err != nil {
		tmhttp.WriteError(w, r, err, tenant, a.s.kind)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// handleReload re-reads the kind, re-registers the instance and its routes, and calls the
// service's Reload hook.
func (a *adminAPI) handleReload(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	if err := a.s.Reload(ctx); err != nil {
		tmhttp.WriteError(w, r, err, "", a.s.kind)
		return
	}
	tmhttp.WriteJSON(w, http.StatusOK, map[string]string{"status": "reloaded", "instance": a.s.self})
}

// Reload re-reads the kind's config, re-registers the instance and its routes (repairing them
// if a sweeper removed them) and calls the Reload hook.
func (s *Shard) Reload(ctx context.Context) error {
	kc, err := s.st.Kinds().Get(ctx, s.kind)
	if err != nil {
		return err
	}
	if err := s.checkFallback(kc); err != nil {
		s.cfg.Logger.Warn("forward fallback off", "err", err)
	}
	s.kindCfg.Store(&kc)
	if s.ready.Load() {
		if err := s.register(ctx); err != nil {
			return err
		}
	}
	if s.cfg.Hooks.Reload != nil {
		return s.cfg.Hooks.Reload(ctx)
	}
	return nil
}
