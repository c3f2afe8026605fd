package server

import (
	"context"
	"errors"
	"net/http"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/backoff"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// Move verification in rebalance serve: GET /api/plans/{id}/verify judges a plan's moves (and
// /api/plans/{id}/moves/{move}/verify one of them) from the digests their shards recorded at
// each fence; and the leader judges every move of a kind whose config says verify as soon as
// it is done, stores the verdict (verify.<plan>.<move> in tm_rebalance), audits it
// (move.verify) and counts it in tm_rebalancer_move_verify_total, whose mismatch series is
// the TenantmeshMoveVerifyMismatch alert.

// VerifyResponse is GET /api/plans/{id}/verify's body.
type VerifyResponse struct {
	Plan string `json:"plan"`
	// Summary counts the moves by result.
	Summary  map[string]int           `json:"summary"`
	Verdicts []rebalancer.MoveVerdict `json:"verdicts"`
}

func (s *Server) registerVerifyRoutes(r chi.Router) {
	r.Get("/api/plans/{id}/verify", s.handleVerifyPlan)
	r.Get("/api/plans/{id}/moves/{move}/verify", s.handleVerifyMove)
}

func (s *Server) handleVerifyPlan(w http.ResponseWriter, r *http.Request) {
	id := chi.URLParam(r, "id")
	vs, err := s.eng.Verify(r.Context(), id, "")
	if err != nil {
		s.fail(w, r, verifyError(err))
		return
	}
	if vs == nil {
		vs = []rebalancer.MoveVerdict{}
	}
	tmhttp.WriteJSON(w, http.StatusOK, VerifyResponse{Plan: id, Summary: rebalancer.Summary(vs), Verdicts: vs})
}

func (s *Server) handleVerifyMove(w http.ResponseWriter, r *http.Request) {
	vs, err := s.eng.Verify(r.Context(), chi.URLParam(r, "id"), chi.URLParam(r, "move"))
	if err != nil {
		s.fail(w, r, verifyError(err))
		return
	}
	tmhttp.WriteJSON(w, http.StatusOK, vs[0])
}

func verifyError(err error) error {
	if errors.Is(err, rebalancer.ErrMoveNotFound) {
		return &tmhttp.Error{Status: http.StatusNotFound, Type: "move-not-found", Title: "Move not found", Detail: err.Error()}
	}
	return err
}

// autoVerifier judges the moves of kinds that verify as they finish, on the leader.
type autoVerifier struct {
	s     *Server
	total *prometheus.CounterVec
	sem   chan struct{} // bounds the verifications running at once
}

func newAutoVerifier(s *Server) (*autoVerifier, error) {
	a := &autoVerifier{s: s, sem: make(chan struct{}, 8),
		total: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tm_rebalancer_move_verify_total",
			Help: "Moves of kinds that verify, judged as they finished, by kind and result (match, mismatch, unverified): a mismatch means a target's state at the fence differed from its source's.",
		}, []string{"kind", "result"})}
	return a, s.reg.Register(a.total)
}

// moveDone is told of every move record that became done while this process watches.
func (a *autoVerifier) moveDone(ctx context.Context, m rebalancer.MoveRecord) {
	if !a.s.IsLeader() {
		return
	}
	a.s.work.Go(func() {
		select {
		case a.sem <- struct{}{}:
		case <-ctx.Done():
			return
		}
		defer func() { <-a.sem }()
		a.verify(ctx, m)
	})
}

// verify judges m if its kind verifies moves; digests still on their way (a target's record is
// written beside its commit) are waited for a few seconds.
func (a *autoVerifier) verify(ctx context.Context, m rebalancer.MoveRecord) {
	s := a.s
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	kc, err := s.st.Kinds().Get(ctx, m.Kind)
	if err != nil || !kc.Verify {
		return
	}
	var v rebalancer.MoveVerdict
	pauses := backoff.Policy{Initial: 100 * time.Millisecond, Max: 2 * time.Second}.Pauses()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if v, err = rebalancer.VerifyMove(ctx, s.st, m); err != nil {
			s.log.Warn("verifying a move", "move", m.Key(), "err", err)
		} else if v.Result != schema.VerifyUnverified || time.Now().After(deadline) {
			break
		}
		if !pauses.Wait(ctx) {
			return
		}
	}
	if err != nil {
		return
	}
	if _, err := s.st.Rebalance().Create(ctx, rebalancer.VerifyKey(m.Plan, m.ID), v); err != nil {
		if schema.IsConflict(err) {
			return // another leader judged it
		}
		s.log.Warn("storing a move's verdict", "move", m.Key(), "err", err)
	}
	a.total.WithLabelValues(m.Kind, v.Result).Inc()
	ev := schema.AuditEvent{Actor: "rebalancer/" + s.cfg.Holder, Action: "move.verify", Kind: m.Kind, Tenant: m.Tenant,
		Plan: m.Plan, Move: m.ID, After: v, Detail: v.Result + ": " + v.Detail, ID: "move.verify." + m.Plan + "." + m.ID}
	if err := s.st.Audit().Append(ctx, ev); err != nil {
		s.log.Warn("audit failed", "action", ev.Action, "err", err)
	}
	s.hub.publish("verify", v)
	if v.Result == schema.VerifyMismatch {
		s.log.Error("move verification: the target's state differs from the source's", "move", m.Key(), "kind", m.Kind,
			"tenant", m.Tenant, "from", m.From, "to", m.To, "fence", v.Fence, "detail", v.Detail)
		return
	}
	s.log.Info("move.verify", "move", m.Key(), "kind", m.Kind, "tenant", m.Tenant, "result", v.Result, "detail", v.Detail)
}
