package rebalancer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/tenantmesh/tenantmesh/internal/ctxtime"
	"github.com/tenantmesh/tenantmesh/internal/tracing"
	"github.com/tenantmesh/tenantmesh/shardkit/kvwatch"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// drive runs one move to a terminal state. Each round reads the placement, works out where the
// move really stands (the placement names the move while it runs) and takes the next step.
// The placement is read from its stream's leader: a replica that is behind could show the
// placement as it was before this move's own last write, and the round would take the move
// for aborted while its warming stays in place (a chaos run found one so). committed, if set,
// is called once the move has committed (its pause is known).
func (e *Engine) drive(ctx context.Context, m *MoveRecord, committed func(), ctl *planControl) (err error) {
	ctx, span := tracer.Start(ctx, "move", trace.WithAttributes(attribute.String("tm.kind", m.Kind),
		attribute.String("tm.tenant", m.Tenant), attribute.String("tm.from", m.From), attribute.String("tm.to", m.To),
		attribute.String("tm.move", m.Key())))
	defer func() { endSpan(span, err, attribute.String("tm.move.state", string(m.State))) }()
	w := e.newSignalWatch(m)
	w.cancelled = ctl.cancelCh()
	defer w.stop()
	for !m.State.Terminal() {
		if err := ctx.Err(); err != nil {
			return err
		}
		if m.State == MovePending && ctl.cancelled() {
			m.State, m.Reason, m.Finished = MoveSkipped, "cancelled by "+ctl.by(), time.Now().UTC()
			return e.saveMove(ctx, m)
		}
		p, err := e.st.Placements(m.Kind).Latest(ctx, m.Tenant)
		if errors.Is(err, schema.ErrNotFound) {
			m.State, m.Reason = MoveSkipped, "the tenant is no longer placed"
			if err := e.saveMove(ctx, m); err != nil {
				return err
			}
			continue
		}
		if err != nil {
			return err
		}
		if err := e.round(ctx, m, p, w); err != nil {
			if errors.Is(err, schema.ErrConflict) {
				continue // someone wrote the placement meanwhile: read it again
			}
			return err
		}
		if committed != nil && !m.Commit.IsZero() {
			committed()
			committed = nil
		}
	}
	return nil
}

// ours reports whether p is in a phase this move put it in.
func (m *MoveRecord) ours(p schema.Placement) bool { return p.Move == m.Key() }

// round takes one step of the move from placement p.
func (e *Engine) round(ctx context.Context, m *MoveRecord, p schema.Placement, w *signalWatch) error {
	// First reconcile the record with the placement: a crash may have left the record behind.
	switch {
	case m.ours(p) && p.Phase == schema.PhaseWarming && m.State != MoveWarming:
		m.State, m.Epoch = MoveWarming, p.Epoch
		if m.Started.IsZero() {
			m.Started = time.Now().UTC()
		}
		return e.saveMove(ctx, m)
	case m.ours(p) && p.Phase == schema.PhaseTakeover && m.State != MoveTakeover:
		m.State, m.Epoch, m.Takeover = MoveTakeover, p.Epoch, true
		now := time.Now().UTC()
		if m.Started.IsZero() {
			m.Started = now
		}
		if m.Handoff.IsZero() {
			m.Handoff = now
		}
		return e.saveMove(ctx, m)
	case m.ours(p) && p.Phase == schema.PhaseHandoff && m.State != MoveHandoff:
		m.State, m.Epoch = MoveHandoff, p.Epoch
		if m.Handoff.IsZero() {
			m.Handoff = time.Now().UTC()
		}
		return e.saveMove(ctx, m)
	case m.ours(p) && p.Phase == schema.PhaseDraining && m.State != MoveCommitted:
		// Committed (by the target, or by this engine) before a crash recorded it: record it
		// now, with the handoff it ended as the move defines it.
		handoff := schema.Placement{Kind: m.Kind, Tenant: m.Tenant, Shard: m.From, Epoch: p.Epoch - 1, Phase: schema.PhaseHandoff,
			Target: m.To, Move: m.Key(), Pinned: p.Pinned}
		return e.committed(ctx, m, handoff, p)
	case !m.ours(p) && m.State != MovePending && m.Epoch > 0:
		// The move's phases are over: it finished (new owner, next epoch) or was aborted.
		switch {
		case p.Shard == m.To && p.Epoch == m.Epoch+1:
			m.State = MoveDone
			if m.Commit.IsZero() {
				m.Commit = p.UpdatedAt // a takeover's commit, recorded after a crash
			}
		case p.Shard == m.From && p.Epoch == m.Epoch:
			m.State = MoveAborted
			if m.Reason == "" {
				m.Reason = "aborted before commit"
			}
		default:
			m.State, m.Reason = MoveFailed, fmt.Sprintf("the placement changed under the move (now %s at epoch %d)", p.Shard, p.Epoch)
		}
		m.Finished = time.Now().UTC()
		return e.saveMove(ctx, m)
	}

	for {
		// A step that wrote the placement the next step starts from hands it on (next), so
		// the handoff goes straight to its wait without reading back what warm-up wrote.
		var next *schema.Placement
		var step func(context.Context) error
		switch m.State {
		case MovePending:
			if m.Takeover {
				step = func(ctx context.Context) error { return e.startTakeover(ctx, m, p, w) }
			} else {
				step = func(ctx context.Context) error { return e.start(ctx, m, p) }
			}
		case MoveWarming:
			step = func(ctx context.Context) (err error) { next, err = e.warm(ctx, m, p, w); return err }
		case MoveHandoff:
			step = func(ctx context.Context) error { return e.handoff(ctx, m, p, w) }
		case MoveTakeover:
			step = func(ctx context.Context) error { return e.takeover(ctx, m, p, w) }
		case MoveCommitted:
			step = func(ctx context.Context) error { return e.finish(ctx, m, p, w) }
		default:
			return nil
		}
		sctx, span := tracer.Start(ctx, "move."+string(m.State))
		err := step(sctx)
		endSpan(span, err, attribute.String("tm.move.state", string(m.State)))
		if err != nil || next == nil {
			return err
		}
		p = *next
	}
}

// tracer makes the rebalancer's spans: plan.apply, one move span per move, and a span per
// step of it (move.pending, move.warming, move.handoff, move.committed).
var tracer = tracing.NewTracer("github.com/tenantmesh/tenantmesh/rebalancer")

// endSpan ends span with the outcome err (a conflict that makes the move read again is not an
// error) and attrs.
func endSpan(span trace.Span, err error, attrs ...attribute.KeyValue) {
	span.SetAttributes(attrs...)
	if err != nil && !errors.Is(err, schema.ErrConflict) {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// start puts the placement in warming(from -> to), if it is still what the plan saw.
func (e *Engine) start(ctx context.Context, m *MoveRecord, p schema.Placement) error {
	if p.Revision != m.Revision || p.Phase != schema.PhaseActive || p.Shard != m.From {
		m.State = MoveSkipped
		m.Reason = fmt.Sprintf("the tenant changed since the plan (planned from revision %d on %s; now revision %d, %s on %s)",
			m.Revision, m.From, p.Revision, p.Phase, p.Shard)
		m.Finished = time.Now().UTC()
		return e.saveMove(ctx, m)
	}
	next := p
	next.Phase, next.Target, next.Move, next.Strategy = schema.PhaseWarming, m.To, m.Key(), m.Strategy
	if _, err := e.transition(ctx, m, "move.warming", p, next); err != nil {
		return err
	}
	m.State, m.Epoch, m.Started = MoveWarming, p.Epoch, time.Now().UTC()
	return e.saveMove(ctx, m)
}

// warm waits for every live instance of the target to be ready, then starts the handoff. If
// the source shard dies meanwhile (Presence), the move becomes a takeover.
func (e *Engine) warm(ctx context.Context, m *MoveRecord, p schema.Placement, w *signalWatch) (*schema.Placement, error) {
	deadline := m.Started.Add(e.cfg.WarmTimeout)
	sourceDown, targetDown := false, false
	err := w.wait(ctx, deadline, func(v signalView) bool {
		if sourceDown = e.shardDown(m.Kind, m.From); sourceDown {
			return true
		}
		if targetDown = e.shardDown(m.Kind, m.To); targetDown {
			return true
		}
		return v.all(m.To, func(s schema.TenantSignal) bool { return s.Phase == schema.SignalReady && s.Epoch == m.Epoch })
	})
	if err == nil && sourceDown {
		return nil, e.toTakeover(ctx, m, p, w)
	}
	if err == nil && targetDown {
		return nil, e.abort(ctx, m, p, fmt.Sprintf("the target %s has no live instance", m.To))
	}
	if errors.Is(err, errCancelled) {
		return nil, e.abort(ctx, m, p, "the plan was cancelled")
	}
	if errors.Is(err, errTimeout) {
		return nil, e.abort(ctx, m, p, fmt.Sprintf("the target %s was not ready within %s", m.To, e.cfg.WarmTimeout))
	}
	if err != nil {
		return nil, err
	}
	next := p
	next.Phase = schema.PhaseHandoff
	got, err := e.transition(ctx, m, "move.handoff", p, next)
	if err != nil {
		return nil, err
	}
	// The handoff's own write time, as the commit's is (Commit = the draining placement's
	// UpdatedAt): a target that commits before this returns must not make the pause negative.
	m.State, m.Handoff = MoveHandoff, got.UpdatedAt
	if m.Handoff.IsZero() {
		m.Handoff = time.Now().UTC()
	}
	if err := e.saveMove(ctx, m); err != nil {
		return nil, err
	}
	// The tenant's requests are held from now on: the handoff step goes straight to the wait
	// for the fence, without reading back the placement this step just wrote.
	return &got, nil
}

// handoff waits for the source to drain (its fence) and the target to reach the fence, then
// commits: the target owns the tenant at the next epoch.
func (e *Engine) handoff(ctx context.Context, m *MoveRecord, p schema.Placement, w *signalWatch) error {
	deadline := m.Handoff.Add(e.cfg.HandoffTimeout)
	var fence uint64
	for trustReleased := true; ; trustReleased = false {
		released, sourceDown, targetDown := false, false, false
		err := w.wait(ctx, deadline, func(v signalView) bool {
			// A source that died before it drained cannot hand the tenant over: the move
			// becomes a takeover (its drained signal, if it comes, still lets it commit early).
			if sourceDown = e.shardDown(m.Kind, m.From); sourceDown {
				return true
			}
			// A target that died holds the tenant's requests for nothing: abort at once (the
			// source serves again). Should it have committed first, the abort's CAS loses and
			// the drive loop finds the commit (and the failover then takes the tenant over).
			if targetDown = e.shardDown(m.Kind, m.To); targetDown {
				return true
			}
			// The target may commit, and the source report drained at the commit's epoch,
			// before this view showed the source's drained at the handoff's: then the signals
			// this wait looks for are gone, and only the commit's tell that the handoff is over
			// (a move once waited out the whole HandoffTimeout so, and finished 10 s late).
			if f, ok := v.released(m.From, m.Epoch+1); ok && trustReleased {
				fence, released = f, true
				return true
			}
			f, ok := v.fence(m.From, m.Epoch)
			if !ok {
				return false
			}
			fence = f
			return v.all(m.To, func(s schema.TenantSignal) bool {
				return s.Phase == schema.SignalReady && s.Fence == f && s.Applied >= f
			})
		})
		if errors.Is(err, errTimeout) {
			return e.abort(ctx, m, p, fmt.Sprintf("handoff not ready to commit within %s (source drained and target at the fence)", e.cfg.HandoffTimeout))
		}
		if err != nil {
			return err
		}
		if sourceDown {
			return e.toTakeover(ctx, m, p, w)
		}
		if targetDown {
			return e.abort(ctx, m, p, fmt.Sprintf("the target %s has no live instance", m.To))
		}
		if !released {
			break
		}
		// The placement, from its leader, is the proof: committed, it is recorded; changed
		// otherwise, the drive loop reads it again; unchanged, the signal was not about this
		// handoff, and the wait goes on for the fence without it (the rebalancer must not
		// commit on it).
		cur, err := e.st.Placements(m.Kind).Latest(ctx, m.Tenant)
		if err != nil {
			return err
		}
		if cur.Revision != p.Revision {
			m.Fence = fence
			if m.ours(cur) && cur.Phase == schema.PhaseDraining && cur.Epoch == p.Epoch+1 {
				return e.committed(ctx, m, p, cur)
			}
			return nil
		}
	}
	m.Fence = fence
	// The target commits itself once it is at the fence (shardkit). Commit here only if it has
	// not within commitGrace: a target that died after reporting ready.
	if committed, err := e.awaitTargetCommit(ctx, m, p, w); committed || err != nil {
		return err
	}
	next := schema.Placement{Kind: p.Kind, Tenant: p.Tenant, Shard: m.To, Epoch: p.Epoch + 1, Phase: schema.PhaseDraining,
		Source: m.From, Move: m.Key(), Pinned: p.Pinned}
	got, err := e.transition(ctx, m, "move.commit", p, next)
	if err != nil {
		return err
	}
	m.State, m.Commit = MoveCommitted, got.UpdatedAt
	return e.saveMove(ctx, m)
}

// commitGrace is how long the rebalancer leaves a ready target to commit a handoff itself.
const commitGrace = 2 * time.Second

// awaitTargetCommit waits up to commitGrace for the target to commit the handoff p. The sign
// of a commit is the former owner reporting drained at the next epoch (it releases the tenant
// when it sees the commit), or no former owner left to report; the placement, read again, is
// the proof. committed means the placement changed: the drive loop reads it and goes on.
func (e *Engine) awaitTargetCommit(ctx context.Context, m *MoveRecord, p schema.Placement, w *signalWatch) (committed bool, err error) {
	graceEnd := time.Now().Add(commitGrace)
	for {
		werr := w.wait(ctx, graceEnd, func(v signalView) bool {
			_, released := v.released(m.From, m.Epoch+1)
			return released || (v.live != nil && len(v.live[m.From]) == 0)
		})
		if werr != nil && !errors.Is(werr, errTimeout) {
			return false, werr
		}
		cur, err := e.st.Placements(m.Kind).Latest(ctx, m.Tenant)
		if err != nil {
			return false, err
		}
		if cur.Revision != p.Revision {
			if m.ours(cur) && cur.Phase == schema.PhaseDraining && cur.Epoch == p.Epoch+1 {
				return true, e.committed(ctx, m, p, cur)
			}
			return true, nil // aborted or changed: the drive loop reads it again
		}
		if werr != nil || time.Now().After(graceEnd) || !ctxtime.Sleep(ctx, 50*time.Millisecond) {
			if ctx.Err() == nil {
				e.cfg.Logger.Warn("the target did not commit the handoff within the grace; committing it here",
					"move", m.Key(), "tenant", m.Tenant, "to", m.To, "grace", commitGrace)
			}
			return false, ctx.Err() // grace over (nil): commit here
		}
	}
}

// finish waits (bounded) for the former owner to report drained, then makes the new owner
// plainly active. After commit a move only goes forward.
func (e *Engine) finish(ctx context.Context, m *MoveRecord, p schema.Placement, w *signalWatch) error {
	err := w.wait(ctx, time.Now().Add(e.cfg.DrainTimeout), func(v signalView) bool {
		if m.Steps == nil {
			m.Steps = v.steps(m.To, m.Epoch)
		}
		if v.live != nil && len(v.live[m.From]) == 0 {
			return true // no live instance of the former owner: nothing to wait for
		}
		return v.all(m.From, func(s schema.TenantSignal) bool { return s.Phase == schema.SignalDrained && s.Epoch == m.Epoch+1 })
	})
	if errors.Is(err, errTimeout) {
		m.Reason = fmt.Sprintf("the former owner %s did not report drained within %s; finished anyway (the epoch fences it)", m.From, e.cfg.DrainTimeout)
	} else if err != nil {
		return err
	}
	next := p
	next.Phase, next.Source, next.Move, next.Strategy = schema.PhaseActive, "", "", ""
	if _, err := e.transition(ctx, m, "move.done", p, next); err != nil {
		return err
	}
	m.State, m.Finished = MoveDone, time.Now().UTC()
	return e.saveMove(ctx, m)
}

// abort returns the tenant to its source, before commit.
func (e *Engine) abort(ctx context.Context, m *MoveRecord, p schema.Placement, reason string) error {
	next := p
	next.Phase, next.Target, next.Move, next.Strategy = schema.PhaseActive, "", "", ""
	if _, err := e.transition(ctx, m, "move.abort", p, next); err != nil {
		return err
	}
	m.State, m.Reason, m.Finished = MoveAborted, reason, time.Now().UTC()
	e.cfg.Logger.Warn("move aborted", "move", m.Key(), "kind", m.Kind, "tenant", m.Tenant, "reason", reason)
	return e.saveMove(ctx, m)
}

// transition writes the placement by CAS and audits it.
func (e *Engine) transition(ctx context.Context, m *MoveRecord, action string, prev, next schema.Placement) (schema.Placement, error) {
	next.UpdatedBy = "rebalancer/" + e.cfg.Holder
	got, err := e.st.Placements(next.Kind).Update(ctx, prev, next)
	if err != nil {
		return got, err
	}
	e.audit(ctx, m, action, prev, got)
	return got, e.step(action)
}

// audit journals the placement change prev -> got of move m, and logs it. A commit has one
// name (the target writes it, and the rebalancer that sees it, or sees it again after a
// restart, records it): the journal keeps it once.
func (e *Engine) audit(ctx context.Context, m *MoveRecord, action string, prev, got schema.Placement) {
	ev := schema.AuditEvent{Actor: got.UpdatedBy, Action: action, Kind: m.Kind, Tenant: m.Tenant, Plan: m.Plan, Move: m.ID,
		Before: prev, After: got, Revision: got.Revision}
	if action == "move.commit" {
		ev.ID = "move.commit." + m.Plan + "." + m.ID
	}
	if err := e.st.Audit().Append(ctx, ev); err != nil {
		e.cfg.Logger.Warn("audit failed", "action", action, "err", err)
	}
	e.cfg.Logger.Info(action, "move", m.Key(), "kind", m.Kind, "tenant", m.Tenant, "from", m.From, "to", m.To, "epoch", got.Epoch, "by", got.UpdatedBy)
}

// committed records that the move's target committed handoff -> draining (audit, record).
func (e *Engine) committed(ctx context.Context, m *MoveRecord, handoff, draining schema.Placement) error {
	e.audit(ctx, m, "move.commit", handoff, draining)
	m.State, m.Epoch, m.Commit = MoveCommitted, draining.Epoch-1, draining.UpdatedAt
	return e.saveMove(ctx, m)
}

var errTimeout = errors.New("timed out")

// signalView is the tenant's signals and the live instances of the move's two shards.
type signalView struct {
	sigs map[string]schema.TenantSignal // instance key -> signal
	live map[string][]string            // shard -> live instance keys
}

// all reports whether shard has at least one live instance and every one satisfies ok.
func (v signalView) all(shard string, ok func(schema.TenantSignal) bool) bool {
	insts := v.live[shard]
	if len(insts) == 0 {
		return false
	}
	for _, k := range insts {
		s, found := v.sigs[k]
		if !found || !ok(s) {
			return false
		}
	}
	return true
}

// fence is the highest fence reported drained at epoch by every live instance of shard (at
// least one). A source with no live instance left reports nothing, and its tenant is not
// handed off on a guess that nothing is in flight there: the move becomes a takeover (with
// Presence), which fences the source, or it aborts at HandoffTimeout.
func (v signalView) fence(shard string, epoch uint64) (uint64, bool) {
	var f uint64
	ok := v.all(shard, func(s schema.TenantSignal) bool {
		if s.Phase != schema.SignalDrained || s.Epoch != epoch {
			return false
		}
		f = max(f, s.Fence)
		return true
	})
	return f, ok
}

// steps is the handoff's timeline a live instance of shard (the move's target) reported on its
// ready signal at epoch (the handoff's), if one did.
func (v signalView) steps(shard string, epoch uint64) *schema.HandoffSteps {
	for _, k := range v.live[shard] {
		if s, found := v.sigs[k]; found && s.Phase == schema.SignalReady && s.Epoch == epoch && s.Steps != nil {
			return s.Steps
		}
	}
	return nil
}

// released reports whether a live instance of shard (the move's source) reports drained at
// epoch (the commit's, one past the handoff's), which it does only once it has seen the commit,
// and the fence it reports (the handoff's).
func (v signalView) released(shard string, epoch uint64) (fence uint64, ok bool) {
	for _, k := range v.live[shard] {
		if s, found := v.sigs[k]; found && s.Phase == schema.SignalDrained && s.Epoch == epoch {
			return s.Fence, true
		}
	}
	return 0, false
}

// signalWatch is one move's view of its tenant's signals and of the live instances of its two
// shards, from the engine's shared signal hub and directory view (one follower each for all
// running moves), so a step waits on a current view instead of opening a watch and listing the
// directory on the handoff's critical path.
type signalWatch struct {
	e       *Engine
	m       *MoveRecord
	start   sync.Once
	started bool
	// every, if set, also wakes wait this often (a condition on time); fencedAt is when this
	// engine wrote the move's takeover, or first drove it (a takeover's lease counts from it).
	every    time.Duration
	fencedAt time.Time
	// cancelled, closed when the move's plan is cancelled, ends a wait with errCancelled (only
	// warming waits for it: a move past its handoff finishes).
	cancelled <-chan struct{}
}

func (e *Engine) newSignalWatch(m *MoveRecord) *signalWatch { return &signalWatch{e: e, m: m} }

// run takes hold of the shared views on first use; stop lets go of them.
func (w *signalWatch) run() {
	w.start.Do(func() {
		w.e.dir.acquire()
		w.e.sigs.acquire()
		w.started = true
	})
}

func (w *signalWatch) stop() {
	w.start.Do(func() {}) // a later run takes nothing
	if w.started {
		w.e.sigs.release()
		w.e.dir.release()
	}
}

// wait re-evaluates cond on every change of the view until it holds or deadline passes.
func (w *signalWatch) wait(ctx context.Context, deadline time.Time, cond func(signalView) bool) error {
	w.run()
	wctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	var tick <-chan time.Time
	if w.every > 0 {
		t := time.NewTicker(w.every)
		defer t.Stop()
		tick = t.C
	}
	var presence <-chan struct{} // nil: never
	for {
		if w.e.cfg.Presence != nil {
			presence = w.e.cfg.Presence.Changed()
		}
		live, dirSynced, dirCh := w.e.dir.live(w.m.Kind, w.m.From, w.m.To)
		sigs, sigSynced, sigCh := w.e.sigs.tenant(w.m.Kind, w.m.Tenant)
		if sigSynced && dirSynced && cond(signalView{sigs: sigs, live: live}) {
			return nil
		}
		select {
		case <-sigCh:
		case <-dirCh:
		case <-presence:
		case <-tick:
		case <-w.cancelled:
			if w.m.State == MoveWarming {
				return errCancelled
			}
			w.cancelled = nil // past the handoff: finish
		case <-wctx.Done():
			return w.e.waitErr(ctx)
		}
	}
}

// errCancelled ends a warming move's wait when its plan is cancelled.
var errCancelled = errors.New("plan cancelled")

func (e *Engine) waitErr(ctx context.Context) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return errTimeout
}

// applySignal updates sigs (instance key -> signal) from one follower entry.
func applySignal(sigs map[string]schema.TenantSignal, e kvwatch.Entry) {
	parts := strings.Split(e.Key, ".") // <kind>.<tenant>.<shard>.<instance>
	if len(parts) != 4 {
		return
	}
	key := schema.InstanceID{Kind: parts[0], Shard: parts[2], Instance: parts[3]}.Key()
	var sig schema.TenantSignal
	if e.Op != kvwatch.Put || json.Unmarshal(e.Value, &sig) != nil {
		delete(sigs, key)
		return
	}
	sigs[key] = sig
}
