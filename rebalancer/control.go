package rebalancer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// ErrPlanState means a plan cannot take the control asked for in its status (a finished plan
// cannot be paused, a plan that is not paused cannot be resumed).
var ErrPlanState = errors.New("plan state")

// SetControl records an operator's instruction to plan id (ControlPause, ControlCancel, or ""
// to resume) by actor, and returns the plan as stored. A plan no engine applies takes effect at
// once: pausing a planned plan makes it paused, cancelling a planned or paused one skips its
// moves (none is under way) and makes it cancelled. A plan being applied takes it at its next
// move (see apply); resuming clears the pause, and the caller then applies the plan again.
func (e *Engine) SetControl(ctx context.Context, id string, c Control, actor string) (PlanRecord, error) {
	for range 16 {
		rec, err := e.setControl(ctx, id, c, actor)
		if !errors.Is(err, schema.ErrConflict) {
			return rec, err
		}
		// The plan's apply wrote its record meanwhile: read it again.
	}
	return PlanRecord{}, fmt.Errorf("rebalancer: plan %s kept changing underneath", id)
}

func (e *Engine) setControl(ctx context.Context, id string, c Control, actor string) (PlanRecord, error) {
	rec, moves, err := e.Plan(ctx, id)
	if err != nil {
		return rec, err
	}
	switch {
	case rec.Status.Finished():
		return rec, fmt.Errorf("%w: plan %s is %s; there is nothing to %s", ErrPlanState, id, rec.Status, verb(c))
	case c == "" && rec.Status != PlanPaused && rec.Control != ControlPause:
		return rec, fmt.Errorf("%w: plan %s is %s, not paused; apply it instead", ErrPlanState, id, rec.Status)
	}
	rec.Control, rec.ControlBy = c, actor
	switch {
	case c == ControlPause && rec.Status == PlanPlanned:
		rec.Status = PlanPaused
	case c == ControlCancel && (rec.Status == PlanPlanned || rec.Status == PlanPaused):
		for i := range moves {
			if moves[i].State == MovePending {
				moves[i].State, moves[i].Reason, moves[i].Finished = MoveSkipped, "cancelled by "+actor, time.Now().UTC()
				if err := e.saveMove(ctx, &moves[i]); err != nil {
					return rec, err
				}
			}
		}
		rec.Status = PlanCancelled
	}
	rec.Updated = time.Now().UTC()
	rev, err := e.st.Rebalance().Update(ctx, schema.PlanKey(id), rec.Revision, rec)
	if err != nil {
		return rec, err
	}
	rec.Revision = rev
	e.cfg.Logger.Info("plan control", "plan", id, "control", verb(c), "by", actor, "status", rec.Status)
	return rec, nil
}

func verb(c Control) string {
	if c == "" {
		return "resume"
	}
	return string(c)
}

// controlPoll is how often an apply reads its plan's record for a pause or a cancel.
const controlPoll = 250 * time.Millisecond

// planControl is what an apply knows of its plan's control, read from the plan record.
type planControl struct {
	mu      sync.Mutex
	control Control
	actor   string
	cancel  chan struct{} // closed once the plan is cancelled
	done    chan struct{}
	wg      sync.WaitGroup
	// read reads the plan record's control now: halted asks it before a move starts, since an
	// operator's pause is answered as soon as the record holds it and the poll may not have
	// seen it yet.
	read func() (ctl Control, actor string, ok bool)
}

// watchControl follows rec's control (polling its record) until stop.
func (e *Engine) watchControl(ctx context.Context, rec *PlanRecord) *planControl {
	c := &planControl{cancel: make(chan struct{}), done: make(chan struct{})}
	c.set(rec.Control, rec.ControlBy)
	c.read = func() (Control, string, bool) {
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		var cur PlanRecord
		if _, err := e.st.Rebalance().Latest(rctx, schema.PlanKey(rec.ID), &cur); err != nil {
			return "", "", false
		}
		return cur.Control, cur.ControlBy, true
	}
	c.wg.Go(func() {
		t := time.NewTicker(controlPoll)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				var cur PlanRecord
				if _, err := e.st.Rebalance().Latest(ctx, schema.PlanKey(rec.ID), &cur); err == nil {
					c.set(cur.Control, cur.ControlBy)
				}
			case <-c.done:
				return
			case <-ctx.Done():
				return
			}
		}
	})
	return c
}

func (c *planControl) set(ctl Control, actor string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.control == ControlCancel {
		return // a cancel is final
	}
	c.control, c.actor = ctl, actor
	if ctl == ControlCancel {
		close(c.cancel)
	}
}

func (c *planControl) stop() {
	close(c.done)
	c.wg.Wait()
}

// halted reports whether no more moves may start (paused or cancelled), from the plan record
// as it is now (what the poll last saw if NATS does not answer).
func (c *planControl) halted() bool {
	if c == nil {
		return false
	}
	if c.read != nil {
		if ctl, actor, ok := c.read(); ok {
			c.set(ctl, actor)
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.control != ""
}

// cancelled reports whether the plan was cancelled.
func (c *planControl) cancelled() bool {
	if c == nil {
		return false
	}
	select {
	case <-c.cancel:
		return true
	default:
		return false
	}
}

// cancelled is closed once the plan is cancelled (nil control: never).
func (c *planControl) cancelCh() <-chan struct{} {
	if c == nil {
		return nil
	}
	return c.cancel
}

func (c *planControl) by() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.actor
}

// cancelMove ends a move of a cancelled plan: pending is skipped, warming is aborted, and a
// move past its handoff (handoff, takeover, committed) finishes.
func (e *Engine) cancelMove(ctx context.Context, m *MoveRecord, ctl *planControl) error {
	if m.State.Terminal() {
		return nil
	}
	if m.State == MovePending {
		m.State, m.Reason, m.Finished = MoveSkipped, "cancelled by "+ctl.by(), time.Now().UTC()
		return e.saveMove(ctx, m)
	}
	return e.stopMove(ctx, m, "cancelled by "+ctl.by(), false)
}
