package rebalancer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Rollback reverses a plan. Moves that have not started are skipped; moves before commit are
// aborted (the placement goes back to the source); committed moves finish forward first. Then
// every completed move is reversed by a new plan (RollbackOf = id), applied at once. It needs
// the leader lease, so it refuses while another rebalancer applies.
func (e *Engine) Rollback(ctx context.Context, id string) (PlanRecord, error) {
	lctx, stop, err := e.lead(ctx)
	if err != nil {
		return PlanRecord{}, err
	}
	defer stop()
	rec, moves, err := e.Plan(lctx, id)
	if err != nil {
		return rec, err
	}
	if rec.RolledBackBy != "" {
		return e.apply(lctx, rec.RolledBackBy) // resume an interrupted rollback
	}
	var back []planner.Move
	maxWave := 0
	for i := range moves {
		m := &moves[i]
		if err := e.stopMove(lctx, m, "rolled back", true); err != nil {
			return rec, err
		}
		if m.State != MoveDone {
			continue
		}
		p, err := e.st.Placements(m.Kind).Latest(lctx, m.Tenant)
		if err != nil {
			return rec, err
		}
		if p.Shard != m.To || p.Phase != schema.PhaseActive {
			continue // moved again since; leave it
		}
		back = append(back, planner.Move{Kind: m.Kind, Tenant: m.Tenant, From: m.To, To: m.From, Load: m.Load, Revision: p.Revision, Wave: m.Wave})
		maxWave = max(maxWave, m.Wave)
	}
	for i := range back {
		back[i].Wave = maxWave - back[i].Wave + 1 // cross-kind moves of a tenant undo in reverse order
	}
	now := time.Now().UTC()
	rb := PlanRecord{ID: NewPlanID(now), Status: PlanPlanned, Actor: "rollback/" + e.cfg.Holder, Created: now, Updated: now,
		RollbackOf: id, Plan: planner.Plan{Strategy: "rollback", Concurrency: max(rec.Plan.Concurrency, 1), Waves: maxWave, Moves: back, Complete: true}}
	if _, err := e.storePlan(lctx, &rb); err != nil {
		return rec, err
	}
	rec.RolledBackBy, rec.Status = rb.ID, PlanRolledBack
	if err := e.savePlan(lctx, &rec); err != nil {
		return rec, err
	}
	return e.apply(lctx, rb.ID)
}

// stopMove brings a move to a terminal state without going further than needed: pending is
// skipped, warming is aborted (handoff too if abortHandoff: a rollback; a cancel lets it
// finish), committed and takeover finish. why is the reason.
func (e *Engine) stopMove(ctx context.Context, m *MoveRecord, why string, abortHandoff bool) error {
	w := e.newSignalWatch(m)
	defer w.stop()
	for !m.State.Terminal() {
		p, err := e.st.Placements(m.Kind).Latest(ctx, m.Tenant)
		if err != nil && !errors.Is(err, schema.ErrNotFound) {
			return err
		}
		switch {
		case m.State == MovePending && !m.ours(p):
			m.State, m.Reason, m.Finished = MoveSkipped, why+" before it started", time.Now().UTC()
			err = e.saveMove(ctx, m)
		case m.ours(p) && (p.Phase == schema.PhaseWarming || abortHandoff && p.Phase == schema.PhaseHandoff):
			err = e.abort(ctx, m, p, why)
		default:
			err = e.round(ctx, m, p, w) // reconcile, or finish a committed move
		}
		if err != nil && !errors.Is(err, schema.ErrConflict) {
			return fmt.Errorf("rebalancer: stop move %s: %w", m.Key(), err)
		}
	}
	return nil
}
