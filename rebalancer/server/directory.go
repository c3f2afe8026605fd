package server

import (
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

func (s *Server) registerDirectoryRoutes(r chi.Router) {
	r.Get("/api/instances", s.handleInstances)
	r.Get("/api/audit", s.handleAudit)
	r.Get("/api/kinds", s.handleKinds)
	r.Put("/api/kinds/{kind}", s.handlePutKind)
}

// handleInstances lists the directory: ?kind=, ?status=online,degraded (derived statuses) and
// ?label=k=v (repeatable: every one must match), the multi-host design's host list filters.
func (s *Server) handleInstances(w http.ResponseWriter, r *http.Request) {
	kind, err := kindParam(r)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	q := r.URL.Query()
	var f rebalancer.InstanceFilter
	if f.Statuses, err = rebalancer.ParseStatuses(q.Get("status")); err != nil {
		s.fail(w, r, badRequest(err.Error()))
		return
	}
	if f.Labels, err = rebalancer.ParseLabels(q["label"]); err != nil {
		s.fail(w, r, badRequest(err.Error()))
		return
	}
	views, err := rebalancer.Instances(r.Context(), s.st, kind, s.cfg.Health, time.Now())
	if err != nil {
		s.fail(w, r, err)
		return
	}
	tmhttp.WriteJSON(w, http.StatusOK, f.Filter(views))
}

// handleAudit reads the journal: ?kind= &tenant= &since= (RFC 3339 time or a duration back
// from now, like 1h) &limit= (default 100, at most maxAuditLimit). kind and tenant are names,
// never subject wildcards: they become the stream filter.
func (s *Server) handleAudit(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	aq := schema.AuditQuery{Tenant: q.Get("tenant")}
	var err error
	if aq.Kind, err = kindParam(r); err != nil {
		s.fail(w, r, err)
		return
	}
	if aq.Tenant != "" && !schema.ValidTenant(aq.Tenant) {
		s.fail(w, r, badRequest(schema.CheckTenant(aq.Tenant).Error()))
		return
	}
	if aq.Limit, err = intParam(r, "limit", 100); err != nil {
		s.fail(w, r, err)
		return
	}
	if aq.Limit < 1 || aq.Limit > maxAuditLimit {
		s.fail(w, r, badRequest(fmt.Sprintf("limit must be 1 to %d", maxAuditLimit)))
		return
	}
	if v := q.Get("since"); v != "" {
		if aq.Since, err = rebalancer.ParseSince(v, time.Now()); err != nil {
			s.fail(w, r, badRequest(err.Error()))
			return
		}
	}
	evs, err := s.st.Audit().Read(r.Context(), aq)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if evs == nil {
		evs = []schema.AuditEvent{}
	}
	tmhttp.WriteJSON(w, http.StatusOK, evs)
}

// maxAuditLimit bounds the entries one audit read returns.
const maxAuditLimit = 1000

// kindParam is ?kind=, "" or a valid kind name (400 otherwise: "*" or "a.b" would widen a
// subject filter).
func kindParam(r *http.Request) (string, error) {
	kind := r.URL.Query().Get("kind")
	if kind == "" {
		return "", nil
	}
	if err := schema.CheckName("kind", kind); err != nil {
		return "", badRequest(err.Error())
	}
	return kind, nil
}

func (s *Server) handleKinds(w http.ResponseWriter, r *http.Request) {
	kcs, err := s.st.Kinds().List(r.Context())
	if err != nil {
		s.fail(w, r, err)
		return
	}
	tmhttp.WriteJSON(w, http.StatusOK, kcs)
}

// handlePutKind registers or replaces a kind's config (body: schema.KindConfig; zero fields
// take their defaults) and audits the change as kind.set. Any process may write it.
func (s *Server) handlePutKind(w http.ResponseWriter, r *http.Request) {
	kind := chi.URLParam(r, "kind")
	var kc schema.KindConfig
	if err := tmhttp.ReadJSON(w, r, 1<<20, &kc); err != nil {
		s.fail(w, r, badRequest("the body must be a JSON kind config (policy, unplaced, capacity, hold_budget, ...): "+err.Error()))
		return
	}
	if kc.Kind != "" && kc.Kind != kind {
		s.fail(w, r, badRequest(fmt.Sprintf("the body names kind %q but the path %q", kc.Kind, kind)))
		return
	}
	kc.Kind = kind
	before, err := s.st.Kinds().Get(r.Context(), kind)
	if err != nil && !errors.Is(err, schema.ErrUnknownKind) {
		s.fail(w, r, err)
		return
	}
	kc, err = s.st.Kinds().Put(r.Context(), kc)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	ev := schema.AuditEvent{Actor: "api/" + s.cfg.Holder, Action: "kind.set", Kind: kind, After: kc}
	if before.Kind != "" {
		ev.Before = before
	}
	if err := s.st.Audit().Append(r.Context(), ev); err != nil {
		s.log.Warn("audit failed", "action", ev.Action, "err", err)
	}
	tmhttp.WriteJSON(w, http.StatusOK, kc)
}

func (s *Server) handleHealthz(w http.ResponseWriter, _ *http.Request) {
	tmhttp.WriteJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

// handleReadyz is ready while NATS is connected; it says whether this process leads.
func (s *Server) handleReadyz(w http.ResponseWriter, r *http.Request) {
	if !s.st.JS().Conn().IsConnected() {
		tmhttp.WriteProblem(w, r, tmhttp.Problem{Type: tmhttp.TypeBase + "not-ready", Title: "Not ready", Status: http.StatusServiceUnavailable,
			Detail: "not connected to NATS", RetryAfter: 1})
		return
	}
	tmhttp.WriteJSON(w, http.StatusOK, map[string]any{"status": "ready", "leader": s.IsLeader(), "holder": s.cfg.Holder})
}
