package rebalancer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/ctxtime"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
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
	e.tell(id, c, actor, rev)
	e.cfg.Logger.Info("plan control", "plan", id, "control", verb(c), "by", actor, "status", rec.Status)
	return rec, nil
}

func verb(c Control) string {
	if c == "" {
		return "resume"
	}
	return string(c)
}

// planControl is what an apply knows of its plan's control, from a watch of the plan record.
type planControl struct {
	mu      sync.Mutex
	control Control
	actor   string
	rev     uint64        // the plan record's revision control and actor are from
	cancel  chan struct{} // closed once the plan is cancelled
	stopped context.CancelFunc
	wg      sync.WaitGroup
}

// watchControl follows rec's control until stop: a pause or cancel this engine records
// (SetControl) at once, another process's as its watch of the plan record delivers it.
//
// It once read the whole plan record before every move and four times a second: with 3,000
// moves the record is about 0.6 MB, and make scale's rebalancer received 11 MB/s and decoded
// them. A watch delivers the record only when it changes, which is rare while it is applied.
func (e *Engine) watchControl(ctx context.Context, rec *PlanRecord) *planControl {
	c := &planControl{cancel: make(chan struct{})}
	c.set(rec.Control, rec.ControlBy, rec.Revision)
	e.controls.Store(rec.ID, c)
	wctx, stop := context.WithCancel(ctx)
	c.stopped = func() {
		stop()
		e.controls.CompareAndDelete(rec.ID, c)
	}
	c.wg.Go(func() { e.followControl(wctx, rec.ID, c) })
	return c
}

// followControl keeps c equal to the control of plan id's record until ctx ends, made again a
// second after its watch fails.
func (e *Engine) followControl(ctx context.Context, id string, c *planControl) {
	for ctx.Err() == nil {
		w, err := e.st.KV(schema.BucketRebalance).Watch(ctx, schema.PlanKey(id))
		if err == nil {
			for u := range w.Updates() {
				if u == nil || u.Operation() != jetstream.KeyValuePut {
					continue
				}
				var ctl struct {
					Control Control `json:"control"`
					By      string  `json:"control_by"`
				}
				if err := jsx.Unmarshal(u.Value(), &ctl); err == nil {
					c.set(ctl.Control, ctl.By, u.Revision())
				}
			}
			_ = w.Stop()
		} else if ctx.Err() == nil {
			e.cfg.Logger.Warn("watching the plan's record for a pause or a cancel; trying again", "plan", id, "err", err)
		}
		ctxtime.Sleep(ctx, time.Second)
	}
}

// tell hands a control this engine recorded to its apply of the plan, if it runs one.
func (e *Engine) tell(id string, ctl Control, actor string, rev uint64) {
	if c, ok := e.controls.Load(id); ok {
		c.(*planControl).set(ctl, actor, rev)
	}
}

// set takes the control of the plan record at revision rev, unless c knows a later one (the
// watch's first value may be older than what this engine told it).
func (c *planControl) set(ctl Control, actor string, rev uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.control == ControlCancel || rev < c.rev {
		return // a cancel is final
	}
	c.control, c.actor, c.rev = ctl, actor, rev
	if ctl == ControlCancel {
		close(c.cancel)
	}
}

func (c *planControl) stop() {
	c.stopped()
	c.wg.Wait()
}

// halted reports whether no more moves may start (paused or cancelled).
func (c *planControl) halted() bool {
	if c == nil {
		return false
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
