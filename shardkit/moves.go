package shardkit

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/backoff"
	"github.com/tenantmesh/tenantmesh/internal/ctxtime"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// mover plays the shard's part in the move protocol for each tenant a placement change
// involves: warm up and report ready as the target, commit the handoff, quiesce and report
// drained as the source, release the tenant after. One task per tenant at a time.
type mover struct{ s *Shard }

// handleChange reacts to one placement change of the kind (see doc.go, "Moves"). It only
// starts tasks; it never blocks.
func (mv *mover) handleChange(c placement.Change) {
	me := mv.s.cfg.ID.Shard
	n, o := c.New, c.Old
	seen := time.Now() // the handoff's timeline starts here on both of its shards
	switch {
	case c.NewOK && n.Phase == schema.PhaseTakeover && n.Target == me:
		mv.startTask(c.Tenant, func(ctx context.Context, ts *tenantState) { mv.takeoverTask(ctx, ts, n) })
	case c.NewOK && (n.Phase == schema.PhaseWarming || n.Phase == schema.PhaseHandoff) && n.Target == me:
		mv.startTask(c.Tenant, func(ctx context.Context, ts *tenantState) { mv.warmTask(ctx, ts, n, c.Move, seen) })
	case c.NewOK && n.Phase.Moving() && n.Shard == me:
		// A handoff, or a takeover of this shard that found it alive after all (it was frozen,
		// or cut off for a while): stop, let in-flight requests finish, report drained. A
		// takeover commits on it without waiting out this instance's lease.
		mv.startTask(c.Tenant, func(ctx context.Context, ts *tenantState) { mv.handoffTask(ctx, ts, n, seen) })
	case c.NewOK && n.Phase == schema.PhaseDraining && n.Source == me:
		mv.startTask(c.Tenant, func(ctx context.Context, ts *tenantState) { mv.commitTask(ctx, ts, n) })
	case c.NewOK && mv.s.gk.owns(n):
		if mv.s.states.get(c.Tenant) != nil {
			mv.startTask(c.Tenant, func(ctx context.Context, ts *tenantState) { mv.resumeTask(ctx, ts, n) })
		}
	case c.OldOK && (mv.s.gk.owns(o) || o.Shard == me || o.Target == me || o.Source == me):
		mv.startTask(c.Tenant, func(ctx context.Context, ts *tenantState) { mv.leaveTask(ctx, ts, o) })
	}
}

// startTask runs fn as the tenant's move task, after cancelling (and waiting for) the previous
// one, so a tenant's tasks run one at a time, in order.
func (mv *mover) startTask(tenant string, fn func(context.Context, *tenantState)) {
	if mv.s.runCtx.Err() != nil {
		return
	}
	ts := mv.s.states.getOrCreate(tenant)
	ctx, cancel := context.WithCancel(mv.s.runCtx)
	done := make(chan struct{})
	ts.mu.Lock()
	prevCancel, prevDone := ts.task, ts.taskDone
	ts.task, ts.taskDone = cancel, done
	ts.mu.Unlock()
	if prevCancel != nil {
		prevCancel()
	}
	mv.s.goTask(func() {
		defer close(done)
		defer cancel()
		if prevDone != nil {
			<-prevDone
		}
		fn(ctx, ts)
		ts.mu.Lock()
		if ts.taskDone == done {
			ts.task, ts.taskDone = nil, nil
		}
		ts.mu.Unlock()
	})
}

// warmTask runs on a move's target: warming reports warming, calls Warm and reports ready; at
// handoff it learns the source's fence from the source's drained signals, warms up to it and
// reports ready with that fence. seen is when the watcher applied e; move is a handoff's move
// workflow (placement.Change.Move).
func (mv *mover) warmTask(ctx context.Context, ts *tenantState, e placement.Entry, move string, seen time.Time) {
	var fence uint64
	var steps *schema.HandoffSteps
	if e.Phase == schema.PhaseHandoff {
		var ok bool
		if fence, steps, ok = mv.awaitFence(ctx, ts.tenant, e.Shard, e.Epoch); !ok {
			return
		}
		steps.TargetSaw, steps.TargetNoted = seen, time.Now()
	} else {
		mv.putSignal(ctx, ts, schema.TenantSignal{Phase: schema.SignalWarming, Epoch: e.Epoch, Applied: mv.s.cfg.Hooks.applied(ts.tenant)})
	}
	ready, ok := mv.warmTo(ctx, ts, e, fence)
	if !ok {
		return
	}
	if e.Phase == schema.PhaseHandoff {
		steps.TargetAtFence = time.Now()
		ready.Steps = steps
		mv.commit(ctx, ts, e, move, ready)
	} else {
		mv.putSignal(ctx, ts, ready)
	}
}

// warmTo calls Warm until the tenant's applied sequence reaches fence, reporting warming (with
// the lag) between tries, and returns the ready signal to report; false if ctx ended first.
func (mv *mover) warmTo(ctx context.Context, ts *tenantState, e placement.Entry, fence uint64) (schema.TenantSignal, bool) {
	for {
		var err error
		if mv.s.cfg.Hooks.Warm != nil {
			err = mv.s.cfg.Hooks.Warm(ctx, ts.tenant, fence)
		}
		if ctx.Err() != nil {
			return schema.TenantSignal{}, false
		}
		applied := mv.s.cfg.Hooks.applied(ts.tenant)
		lag := mv.s.cfg.Hooks.lag(ts.tenant, fence, applied)
		if err == nil && applied >= fence {
			mv.s.metrics.clearLag(ts.tenant)
			return schema.TenantSignal{Phase: schema.SignalReady, Epoch: e.Epoch, Applied: applied, Fence: fence, Lag: lag}, true
		}
		if err != nil {
			mv.s.cfg.Logger.Warn("warm-up failed; retrying", "tenant", ts.tenant, "fence", fence, "err", err)
		}
		mv.s.metrics.setLag(ts.tenant, lag)
		mv.putSignal(ctx, ts, schema.TenantSignal{Phase: schema.SignalWarming, Epoch: e.Epoch, Applied: applied, Fence: fence, Lag: lag})
		if !ctxtime.Sleep(ctx, mv.s.cfg.WarmRetry) {
			return schema.TenantSignal{}, false
		}
	}
}

// takeoverTask runs on a takeover's target. The former owner does not drain (it has no live
// instance, or was fenced for another reason), so there is no source fence to wait for: the
// service fences the former owner's late writes in its own store (Hooks.Takeover, at the epoch
// this shard will own the tenant at) and names the sequence to warm up to; the instance warms
// up to it and reports ready. The rebalancer commits (takeover -> active here at the next
// epoch) once every live instance here is ready and no instance of the former owner can still
// serve.
func (mv *mover) takeoverTask(ctx context.Context, ts *tenantState, e placement.Entry) {
	mv.putSignal(ctx, ts, schema.TenantSignal{Phase: schema.SignalWarming, Epoch: e.Epoch, Applied: mv.s.cfg.Hooks.applied(ts.tenant)})
	var fence uint64
	for hook := mv.s.cfg.Hooks.Takeover; hook != nil; {
		var err error
		if fence, err = hook(ctx, ts.tenant, e.Epoch+1); err == nil {
			break
		}
		if ctx.Err() != nil {
			return
		}
		mv.s.cfg.Logger.Warn("takeover: fencing the former owner failed; retrying", "tenant", ts.tenant, "from", e.Shard, "err", err)
		if !ctxtime.Sleep(ctx, mv.s.cfg.WarmRetry) {
			return
		}
	}
	if ready, ok := mv.warmTo(ctx, ts, e, fence); ok {
		mv.putSignal(ctx, ts, ready)
	}
}

// commit ends a handoff on its target: once every live instance of this shard is at the fence
// (ready at the move's epoch), the placement passes to this shard at the next epoch, by
// compare-and-set on the handoff revision, so a sibling, the rebalancer or an abort writing
// first simply wins. The rebalancer, which sees the commit, audits it in order with the
// move's other steps. The rebalancer commits only if no target did within its grace (a target
// that died after reporting ready). With no sibling to wait for, the ready signal and the
// commit are written at once: the handoff pause is the source's drain and two writes.
func (mv *mover) commit(ctx context.Context, ts *tenantState, e placement.Entry, move string, ready schema.TenantSignal) {
	me := mv.s.cfg.ID.Instance
	live, _ := mv.s.peers.liveNames(mv.s.cfg.ID.Shard)
	alone := !slices.ContainsFunc(live, func(n string) bool { return n != me })
	sent := make(chan time.Time, 1) // when the commit's write went out (the timeline's last step)
	if !alone {
		mv.putSignal(ctx, ts, ready)
		if !mv.awaitSiblings(ctx, ts.tenant, ready) {
			return
		}
	} else {
		// Not cancelled with the task, as the commit's write is not: the watcher seeing the
		// commit cancels this task, and a ready write not sent by then was lost (under load
		// the target's signal stayed at warming). The next task starts once this one ends, so
		// its own writes come after. It carries the commit's stamp, so it waits for the
		// commit to be sent (or not to be).
		written, committing := make(chan struct{}), make(chan struct{})
		go func() {
			defer close(written)
			select {
			case at := <-sent:
				if ready.Steps != nil {
					steps := *ready.Steps
					steps.TargetCommit = at
					ready.Steps = &steps
				}
			case <-committing:
			}
			wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			mv.putSignal(wctx, ts, ready)
		}()
		defer func() { close(committing); <-written }()
	}
	mv.commitPlacement(ctx, ts.tenant, e, move, sent)
}

// awaitSiblings waits until every live instance of this shard reports ready at the fence and
// epoch of ready (this one counts as ready), or ctx ends (the placement moved on).
func (mv *mover) awaitSiblings(ctx context.Context, tenant string, ready schema.TenantSignal) bool {
	tick := time.NewTicker(time.Second) // heartbeats age without a change to wake on
	defer tick.Stop()
	read := true // the siblings' signals, from the bucket: at the start and every tick
	reads, rctx := readsBeside(ctx)
	defer reads.stop()
	for {
		live, dirChanged := mv.s.peers.liveNames(mv.s.cfg.ID.Shard)
		if read {
			reads.Go(func() { mv.s.signals.refresh(rctx, tenant, mv.s.cfg.ID.Shard, live) })
			read = false
		}
		sigs, sigChanged := mv.s.signals.shard(tenant, mv.s.cfg.ID.Shard)
		all := true
		for _, n := range live {
			if n == mv.s.cfg.ID.Instance {
				continue
			}
			sig, ok := sigs[n]
			if !ok || sig.Phase != schema.SignalReady || sig.Epoch != ready.Epoch || sig.Fence != ready.Fence || sig.Applied < ready.Fence {
				all = false
				break
			}
		}
		if all {
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-tick.C:
			read = true
		case <-dirChanged:
		case <-sigChanged:
		}
	}
}

// commitPlacement writes handoff(source -> this shard) -> draining(this shard, epoch + 1) by
// compare-and-set on the handoff's revision (the rebalancer audits it as move.commit). It
// reads nothing first: the watcher's entry and the handoff's move are the whole of what the
// commit carries on, and a record that changed since it was seen makes the write a conflict.
// Any other outcome (already committed by a sibling or the rebalancer, aborted, rolled back)
// is left to whoever wrote it. sent gets the time the write went out.
func (mv *mover) commitPlacement(ctx context.Context, tenant string, e placement.Entry, move string, sent chan<- time.Time) {
	if ctx.Err() != nil {
		return // moved on meanwhile: whoever moved it goes on
	}
	prev := schema.Placement{Kind: mv.s.kind, Tenant: tenant, Shard: e.Shard, Epoch: e.Epoch, Phase: e.Phase, Target: e.Target,
		Move: move, Pinned: e.Pinned, Revision: e.Revision}
	next := schema.Placement{Kind: prev.Kind, Tenant: tenant, Shard: e.Target, Epoch: e.Epoch + 1, Phase: schema.PhaseDraining,
		Source: e.Shard, Move: move, Pinned: e.Pinned, UpdatedBy: "shard/" + mv.s.cfg.ID.Key()}
	// Not cancelled with the task: the watcher seeing this very write cancels the task, and
	// the write's answer would read as a failure.
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	sent <- time.Now()
	got, err := mv.s.st.Placements(next.Kind).Update(wctx, prev, next)
	if err != nil {
		if !errors.As(err, new(*schema.ConflictError)) {
			mv.s.cfg.Logger.Warn("committing the move; the rebalancer will", "tenant", tenant, "err", err)
		}
		return
	}
	mv.s.cfg.Logger.Info("move.commit", "tenant", tenant, "from", e.Shard, "to", got.Shard, "epoch", got.Epoch)
}

// awaitFence watches the source shard's signals for the tenant until every live source
// instance (at least one) reports drained at epoch, and returns the highest fence reported
// and the source's steps of the handoff (never nil).
func (mv *mover) awaitFence(ctx context.Context, tenant, source string, epoch uint64) (uint64, *schema.HandoffSteps, bool) {
	for ctx.Err() == nil {
		fence, steps, err := mv.watchFence(ctx, tenant, source, epoch)
		if err == nil {
			return fence, steps, true
		}
		if ctx.Err() == nil {
			mv.s.cfg.Logger.Warn("waiting for the source's fence", "tenant", tenant, "source", source, "err", err)
			ctxtime.Sleep(ctx, mv.s.cfg.WarmRetry)
		}
	}
	return 0, nil, false
}

func (mv *mover) watchFence(ctx context.Context, tenant, source string, epoch uint64) (uint64, *schema.HandoffSteps, error) {
	// Instances die while we wait: heartbeats age, so look again every second even without a
	// change. A source with no live instance left never drains: the target does not guess that
	// nothing is in flight there (a frozen or cut-off instance may wake with requests in flight
	// and appends unsent); the rebalancer turns the move into a takeover, which fences the
	// source in the store, or aborts it.
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	read := true // the source's signals, from the bucket: at the start and every tick
	reads, rctx := readsBeside(ctx)
	defer reads.stop()
	for {
		live, dirChanged := mv.s.peers.liveNames(source)
		if read {
			reads.Go(func() { mv.s.signals.refresh(rctx, tenant, source, live) })
			read = false
		}
		sigs, sigChanged := mv.s.signals.shard(tenant, source)
		if fence, ok := fenceOf(sigs, live, epoch); ok {
			return fence, sourceSteps(sigs, epoch), nil
		}
		select {
		case <-ctx.Done():
			return 0, nil, ctx.Err()
		case <-tick.C:
			read = true
		case <-dirChanged:
		case <-sigChanged:
		}
	}
}

// besideReads are the bucket reads a wait for signals runs beside it (a note may never come).
type besideReads struct {
	sync.WaitGroup
	cancel context.CancelFunc
}

// readsBeside returns the reads' group and the context to run them with.
func readsBeside(ctx context.Context) (*besideReads, context.Context) {
	rctx, cancel := context.WithCancel(ctx)
	return &besideReads{cancel: cancel}, rctx
}

// stop ends the reads still in flight and waits for them: a wait that is over (a note brought
// what it waited for) does not wait out a slow read, up to its 2 s bound (a direct get a busy
// replica is slow to answer).
func (r *besideReads) stop() {
	r.cancel()
	r.Wait()
}

// fenceOf decides whether the source is drained: every live instance reported drained at epoch
// (instances not in the directory are not waited for), and at least one did.
func fenceOf(sigs map[string]schema.TenantSignal, live []string, epoch uint64) (uint64, bool) {
	var fence uint64
	n := 0
	for _, sig := range sigs {
		if sig.Phase == schema.SignalDrained && sig.Epoch == epoch {
			n++
			fence = max(fence, sig.Fence)
		}
	}
	if n == 0 {
		return 0, false
	}
	for _, inst := range live {
		if sig, ok := sigs[inst]; !ok || sig.Phase != schema.SignalDrained || sig.Epoch != epoch {
			return 0, false
		}
	}
	return fence, true
}

// sourceSteps is a copy of the handoff steps of the source instance that drained last at epoch
// (an empty set if none carried them: an older release).
func sourceSteps(sigs map[string]schema.TenantSignal, epoch uint64) *schema.HandoffSteps {
	var last schema.HandoffSteps
	for _, sig := range sigs {
		if sig.Phase == schema.SignalDrained && sig.Epoch == epoch && sig.Steps != nil && sig.Steps.SourceFenced.After(last.SourceFenced) {
			last = *sig.Steps
		}
	}
	return &schema.HandoffSteps{SourceSaw: last.SourceSaw, SourceIdle: last.SourceIdle, SourceFenced: last.SourceFenced}
}

// handoffTask runs on a move's source at handoff: stop accepting, wait for in-flight requests
// within DrainTimeout, then report drained with the fence (the service's last applied sequence)
// at the handoff epoch, with its steps' times (seen: when the watcher applied the handoff).
func (mv *mover) handoffTask(ctx context.Context, ts *tenantState, e placement.Entry, seen time.Time) {
	ts.setDraining(true)
	// Report draining while in-flight requests finish, and only if there are any: the
	// handoff pause is the time to drained, this write is for people watching, and drained
	// must wait for it (one key per instance: the last write is what stays).
	var reported chan struct{}
	if ts.inflight.Load() > 0 {
		reported = make(chan struct{})
		go func() {
			defer close(reported)
			mv.putSignal(ctx, ts, schema.TenantSignal{Phase: schema.SignalDraining, Epoch: e.Epoch})
		}()
		defer func() { <-reported }()
	}
	if !mv.quiesce(ctx, ts) {
		return
	}
	idle := time.Now()
	fence := mv.s.cfg.Hooks.fence(ts.tenant)
	drained := schema.TenantSignal{Phase: schema.SignalDrained, Epoch: e.Epoch, Applied: fence, Fence: fence,
		Steps: &schema.HandoffSteps{SourceSaw: seen, SourceIdle: idle, SourceFenced: time.Now()}}
	// The move's target waits for this: it hears it before the write, not after (a write's
	// round trip less in the pause). The write is for the rebalancer, and for a target that
	// missed the note. Drained is final, so the target may act on it before it is stored.
	mv.noteSignal(mv.stamp(ts, drained))
	if reported != nil {
		<-reported
	}
	mv.putSignal(ctx, ts, drained)
}

// commitTask runs on the former owner once the move committed: make sure nothing is in flight,
// release the tenant's state and report drained at the new epoch.
func (mv *mover) commitTask(ctx context.Context, ts *tenantState, e placement.Entry) {
	ts.setDraining(true)
	if !mv.quiesce(ctx, ts) {
		return
	}
	mv.release(ctx, ts)
	ts.mu.Lock()
	fence := ts.fence
	ts.mu.Unlock()
	mv.putSignal(ctx, ts, schema.TenantSignal{Phase: schema.SignalDrained, Epoch: e.Epoch, Applied: mv.s.cfg.Hooks.applied(ts.tenant), Fence: fence})
}

// resumeTask runs when this shard owns the tenant again or still (a move aborted, a move to it
// committed): accept requests again and, once the placement is active, clear the signal.
func (mv *mover) resumeTask(ctx context.Context, ts *tenantState, e placement.Entry) {
	ts.mu.Lock()
	manual := ts.manual
	ts.released = false
	ts.mu.Unlock()
	if !manual {
		ts.setDraining(false)
	}
	mv.s.metrics.clearLag(ts.tenant)
	if e.Phase == schema.PhaseActive && !manual {
		mv.clearSignal(ctx, ts)
	}
}

// leaveTask runs when this shard no longer has anything to do with the tenant: a move to it was
// aborted, the tenant was moved away without a move workflow or deleted, or a move from it
// finished. In-flight requests finish (within the bound), the state is released if it was not
// yet, and the signal is removed.
func (mv *mover) leaveTask(ctx context.Context, ts *tenantState, old placement.Entry) {
	ts.setDraining(true)
	mv.quiesce(ctx, ts)
	if ctx.Err() != nil {
		return
	}
	mv.release(ctx, ts)
	mv.s.metrics.clearLag(ts.tenant)
	mv.clearSignal(ctx, ts)
	ts.mu.Lock()
	ts.manual, ts.released = false, false
	ts.mu.Unlock()
	ts.setDraining(false) // the gate refuses by placement now; let the state be forgotten
}

// quiesce waits up to DrainTimeout for the tenant's in-flight requests to finish (its draining
// flag must be set). It reports false if ctx ended first.
func (mv *mover) quiesce(ctx context.Context, ts *tenantState) bool {
	t := time.NewTimer(mv.s.cfg.DrainTimeout)
	defer t.Stop()
	for ts.inflight.Load() > 0 {
		select {
		case <-ts.idle:
		case <-t.C:
			mv.s.metrics.drains.WithLabelValues("timeout").Inc()
			mv.s.cfg.Logger.Warn("drain bound reached with requests in flight", "tenant", ts.tenant, "in_flight", ts.inflight.Load())
			return true
		case <-ctx.Done():
			return false
		}
	}
	mv.s.metrics.drains.WithLabelValues("drained").Inc()
	return true
}

// release calls the Release hook once per stint of hosting.
func (mv *mover) release(ctx context.Context, ts *tenantState) {
	ts.mu.Lock()
	done := ts.released
	ts.released = true
	ts.mu.Unlock()
	if done || mv.s.cfg.Hooks.Release == nil {
		return
	}
	if err := mv.s.cfg.Hooks.Release(ctx, ts.tenant); err != nil {
		mv.s.cfg.Logger.Warn("release hook failed", "tenant", ts.tenant, "err", err)
	}
}

// putSignal writes this instance's signal for the tenant, retrying a few times.
func (mv *mover) putSignal(ctx context.Context, ts *tenantState, sig schema.TenantSignal) {
	sig = mv.stamp(ts, sig)
	ts.mu.Lock()
	ts.phase, ts.fence, ts.epoch, ts.applied, ts.lag = sig.Phase, sig.Fence, sig.Epoch, sig.Applied, sig.Lag
	ts.mu.Unlock()
	attempt := 0
	logErr := func(err error, _ time.Duration) {
		mv.s.cfg.Logger.Warn("writing tenant signal", "tenant", ts.tenant, "phase", sig.Phase, "attempt", attempt, "err", err)
	}
	err := backoff.Retry(ctx, backoff.Policy{Initial: 200 * time.Millisecond, Max: time.Second, Tries: 5, OnRetry: logErr}, func(ctx context.Context) error {
		attempt++
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		got, err := mv.s.st.Signals().Put(ctx, sig)
		if err == nil {
			mv.noteSignal(got)
		}
		return err
	})
	if err != nil && ctx.Err() == nil {
		logErr(err, 0) // the last try's failure
	}
}

// stamp fills in who writes sig, and the tenant's requests in flight.
func (mv *mover) stamp(ts *tenantState, sig schema.TenantSignal) schema.TenantSignal {
	sig.Kind, sig.Tenant, sig.Shard, sig.Instance = mv.s.kind, ts.tenant, mv.s.cfg.ID.Shard, mv.s.cfg.ID.Instance
	sig.InFlight = int(ts.inflight.Load())
	return sig
}

// noteSignal tells the shard that waits for sig (the one the tenant moves to, else its owner)
// that it was written: a core NATS note carrying the signal as stored.
func (mv *mover) noteSignal(sig schema.TenantSignal) {
	e, ok := mv.s.watcher.Lookup(mv.s.kind, sig.Tenant)
	if !ok {
		return
	}
	to := e.Target
	if to == "" {
		to = e.Shard
	}
	if to == "" {
		return
	}
	if err := mv.s.st.Signals().Note(to, sig); err != nil {
		mv.s.cfg.Logger.Debug("noting tenant signal", "tenant", sig.Tenant, "err", err)
	}
}

// clearSignal removes this instance's signal for the tenant, if it wrote one.
func (mv *mover) clearSignal(ctx context.Context, ts *tenantState) {
	ts.mu.Lock()
	had := ts.phase != ""
	ts.phase, ts.fence, ts.epoch, ts.applied, ts.lag = "", 0, 0, 0, 0
	ts.mu.Unlock()
	if !had {
		return
	}
	dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := mv.s.st.Signals().Delete(dctx, mv.s.kind, ts.tenant, mv.s.cfg.ID); err != nil {
		mv.s.cfg.Logger.Warn("removing tenant signal", "tenant", ts.tenant, "err", err)
	}
}

// Drain stops accepting the tenant's requests on this instance, waits (within DrainTimeout) for
// those in flight, calls the Release hook and reports drained. The tenant stays drained here
// until Undrain or until a placement change gives it back. It reports how many requests were
// still in flight when the bound ran out.
func (s *Shard) Drain(ctx context.Context, tenant string) (int, error) {
	if err := schema.CheckTenant(tenant); err != nil {
		return 0, err
	}
	ts := s.states.getOrCreate(tenant)
	ts.mu.Lock()
	ts.manual = true
	ts.mu.Unlock()
	ts.setDraining(true)
	e, _ := s.watcher.Lookup(s.kind, tenant)
	s.moves.putSignal(ctx, ts, schema.TenantSignal{Phase: schema.SignalDraining, Epoch: e.Epoch})
	if !s.moves.quiesce(ctx, ts) {
		return int(ts.inflight.Load()), ctx.Err()
	}
	left := int(ts.inflight.Load())
	s.moves.release(ctx, ts)
	fence := s.cfg.Hooks.fence(tenant)
	s.moves.putSignal(ctx, ts, schema.TenantSignal{Phase: schema.SignalDrained, Epoch: e.Epoch, Applied: fence, Fence: fence})
	return left, nil
}

// Undrain accepts the tenant's requests again after Drain, and removes its signal.
func (s *Shard) Undrain(ctx context.Context, tenant string) error {
	ts := s.states.get(tenant)
	if ts == nil {
		return nil
	}
	ts.mu.Lock()
	ts.manual, ts.released = false, false
	ts.mu.Unlock()
	ts.setDraining(false)
	s.moves.clearSignal(ctx, ts)
	return nil
}

// ErrNotAffinity is returned by Release for kinds whose placement is not the affinity policy's.
var ErrNotAffinity = errors.New("shardkit: Release is for affinity kinds; managed and load tenants move through the rebalancer")

// Release gives up this instance's hold on an affinity tenant (the prerender manager: a server disposing a
// realm): it removes the instance from the placement's owners by compare-and-set, deleting the
// placement when no owner is left, and forgets the tenant here. Releasing a tenant this
// instance does not hold is not an error.
func (s *Shard) Release(ctx context.Context, tenant string) error {
	if err := schema.CheckTenant(tenant); err != nil {
		return err
	}
	if kc := s.kindCfg.Load(); kc != nil && kc.Policy != schema.PolicyAffinity {
		return ErrNotAffinity
	}
	for try := range 16 {
		err := s.moves.releaseOnce(ctx, tenant, try > 0)
		if !errors.Is(err, schema.ErrConflict) {
			if err == nil {
				if ts := s.states.get(tenant); ts != nil {
					s.moves.clearSignal(ctx, ts)
				}
			}
			return err
		}
	}
	return fmt.Errorf("shardkit: release %s: too many concurrent placement writers", tenant)
}

// releaseOnce is one try of Release. The first reads the placement with a direct get (any
// replica); after a lost compare-and-set, from the stream leader (latest): a replica that stays
// behind would answer the same old revision to every try.
func (mv *mover) releaseOnce(ctx context.Context, tenant string, latest bool) error {
	read := mv.s.st.Placements(mv.s.kind).Get
	if latest {
		read = mv.s.st.Placements(mv.s.kind).Latest
	}
	p, err := read(ctx, tenant)
	if errors.Is(err, schema.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	owners := slices.DeleteFunc(slices.Clone(p.Owners), func(o string) bool {
		return o == mv.s.self || o == mv.s.cfg.ID.Instance
	})
	switch {
	case len(owners) == len(p.Owners) && (len(p.Owners) > 0 || p.Shard != mv.s.cfg.ID.Shard):
		return nil // not ours
	case len(owners) == 0:
		return mv.s.st.Placements(mv.s.kind).Delete(ctx, tenant, p.Revision)
	}
	next := p
	next.Owners = owners
	next.UpdatedBy = mv.s.self
	_, err = mv.s.st.Placements(next.Kind).Update(ctx, p, next)
	return err
}
