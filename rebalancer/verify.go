package rebalancer

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Move verification: a committed move's target state at the fence compared with the
// source's, by the digests both shards recorded there (schema.BucketVerify). Verify judges
// any plan's moves on demand (`rebalance verify`, GET /api/plans/{id}/verify); rebalance serve
// judges each move of a kind whose config says verify as it finishes, audits the verdict and
// counts it (tm_rebalancer_move_verify_total: a mismatch is an alert).

// Results a MoveVerdict has besides schema's match, mismatch and unverified.
const (
	// VerifyNotMoved: the move did not commit (pending, skipped, aborted, failed before its
	// commit): there is no target state to compare.
	VerifyNotMoved = "not-moved"
	// VerifyPending: the move is still running.
	VerifyPending = "pending"
)

// MoveVerdict is one move's verification.
type MoveVerdict struct {
	Plan   string    `json:"plan"`
	Move   string    `json:"move"`
	Kind   string    `json:"kind"`
	Tenant string    `json:"tenant"`
	From   string    `json:"from"`
	To     string    `json:"to"`
	Epoch  uint64    `json:"epoch"`
	State  MoveState `json:"state"`
	schema.Verdict
	// Checked is when the verdict was made.
	Checked time.Time `json:"checked"`
}

// Key is the verdict's move, as in placements and audit events.
func (v MoveVerdict) Key() string { return v.Plan + "/" + v.Move }

// VerifyKey is the key of a move's stored verdict in tm_rebalance.
func VerifyKey(plan, move string) string { return "verify." + plan + "." + move }

// ErrMoveNotFound means the plan has no move of that id.
var ErrMoveNotFound = errors.New("move not found")

// Verify judges the moves of plan id, or only move (its id, "m00001", or its key
// "<plan>/<move>") when move is not "", from the digests recorded at each move's fence. id may
// also be a move key alone.
func (e *Engine) Verify(ctx context.Context, id, move string) ([]MoveVerdict, error) {
	if plan, m, ok := strings.Cut(id, "/"); ok {
		id, move = plan, m
	}
	_, moves, err := e.Plan(ctx, id)
	if err != nil {
		return nil, err
	}
	var out []MoveVerdict
	for _, m := range moves {
		if move != "" && m.ID != move {
			continue
		}
		v, err := VerifyMove(ctx, e.st, m)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	if move != "" && len(out) == 0 {
		return nil, fmt.Errorf("%w: plan %s has no move %s", ErrMoveNotFound, id, move)
	}
	return out, nil
}

// VerifyMove judges one move from its digest records.
func VerifyMove(ctx context.Context, st *schema.Store, m MoveRecord) (MoveVerdict, error) {
	v := MoveVerdict{Plan: m.Plan, Move: m.ID, Kind: m.Kind, Tenant: m.Tenant, From: m.From, To: m.To, Epoch: m.Epoch,
		State: m.State, Checked: time.Now().UTC()}
	switch {
	case m.State == MoveCommitted:
		v.Result, v.Detail = VerifyPending, "committed; the source is still draining"
		return v, nil
	case !m.State.Terminal():
		v.Result, v.Detail = VerifyPending, "the move is "+string(m.State)
		return v, nil
	case m.Commit.IsZero():
		v.Result, v.Detail = VerifyNotMoved, "the move did not commit ("+string(m.State)+")"
		return v, nil
	}
	recs, err := st.Digests().List(ctx, m.Kind, m.Tenant, m.Epoch)
	if errors.Is(err, schema.ErrNotFound) {
		recs, err = nil, nil // nothing provisioned, nothing recorded
	}
	if err != nil {
		return v, fmt.Errorf("rebalancer: digests of move %s: %w", m.Key(), err)
	}
	v.Verdict = schema.CompareDigests(recs, m.From, m.To)
	if len(recs) == 0 {
		v.Detail = "no digests recorded at the fence (the kind's services make none, or the move predates verification)"
	}
	return v, nil
}

// Summary counts verdicts by result.
func Summary(vs []MoveVerdict) map[string]int {
	out := map[string]int{}
	for _, v := range vs {
		out[v.Result]++
	}
	return out
}
