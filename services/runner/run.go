package runner

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/tenantmesh/tenantmesh/internal/backoff"
	"github.com/tenantmesh/tenantmesh/internal/tracing"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// executor claims a tenant's next job, runs the attempt with its effects, and records the
// outcome; the dispatcher (sched.go) decides which tenant goes next.
type executor struct{ s *Service }

// claimAndRun claims the entry's job and runs it, or gives the slot and the tokens back.
func (x *executor) claimAndRun(ctx context.Context, tq *tenantQ, msg *jetstream.RawStreamMsg) {
	claimed := false
	defer func() {
		if !claimed {
			x.claimSettled(tq)
		}
	}()
	r, err := x.claim(ctx, tq, msg)
	if err != nil && ctx.Err() == nil {
		x.s.cfg.Logger.Warn("claiming job", "tenant", tq.tenant, "seq", msg.Sequence, "err", err)
		x.s.rescanAt(tq, msg.Sequence, time.Now().Add(time.Second))
	}
	if r == nil {
		x.s.mu.Lock()
		if x.s.instRate != nil {
			x.s.instRate.refund()
		}
		if tq.rate != nil {
			tq.rate.refund()
		}
		x.s.mu.Unlock()
		x.done(tq)
		return
	}
	x.s.mu.Lock()
	released := tq.released || !tq.acquired
	if !released {
		x.s.totals.Started++
	}
	x.s.mu.Unlock()
	if released {
		// Released while we claimed: give the job back untouched for the next owner.
		x.unclaim(r)
		x.done(tq)
		return
	}
	claimed = true
	x.claimSettled(tq)
	x.s.recent.note(r)
	if h := nats.Header(msg.Header); tracing.Traced(h) {
		var span trace.Span
		ctx, span = tracer.Start(tracing.Extract(ctx, h), "job.run", trace.WithAttributes(
			attribute.String("tm.tenant", r.Tenant), attribute.String("tm.job", r.ID), attribute.String("tm.job.type", r.Type)))
		defer span.End()
	}
	x.execute(ctx, tq, r, msg.Sequence)
}

// tracer makes the runner's spans: job.run for a job created in a sampled trace, and
// effect.deliver for each of its effects.
var tracer = tracing.NewTracer("github.com/tenantmesh/tenantmesh/services/runner")

// claimSettled ends one of tq's claims under way: it ran, or it gave its job back.
func (x *executor) claimSettled(tq *tenantQ) {
	x.s.mu.Lock()
	defer x.s.mu.Unlock()
	if tq.claiming--; tq.claiming == 0 && tq.settled != nil {
		close(tq.settled)
		tq.settled = nil
	}
}

// settledClaims returns a channel closed once tenant's claims under way have settled (closed
// already if there are none). Called under s.mu.
func (s *Service) settledClaims(tq *tenantQ) <-chan struct{} {
	if tq == nil || tq.claiming == 0 {
		return closedChan
	}
	if tq.settled == nil {
		tq.settled = make(chan struct{})
	}
	return tq.settled
}

// closedChan is a closed channel: nothing to wait for.
var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// done frees a slot of tenant tq.
func (x *executor) done(tq *tenantQ) {
	x.s.mu.Lock()
	x.s.running--
	tq.inflight--
	x.s.mu.Unlock()
	tq.work.Done()
	select {
	case tq.idle <- struct{}{}:
	default:
	}
	nudge(x.s.wake)
}

// claim takes the job of a queue entry if it can run now: pending and due, or running on a
// lease that ran out. The compare-and-set on the run record makes one claimant win.
//
// The run is read with a direct get first (claimRead), which any replica answers without a
// JetStream API request (a claim per job: at a few hundred jobs a second they queued on the
// server beside the requests a move's handoff waits for). A replica may be a moment behind, so
// only a run it shows pending and due is taken from it: the compare-and-set refuses a stale
// revision, and the claim then reads the leader and decides once more. Anything else is read
// again from the leader: no run (a missing run drops the entry), a finished one (so does that,
// and a keyed job's id comes back once its run expired), one running (a claim would wait out
// its lease) or one waiting for a retry.
func (x *executor) claim(ctx context.Context, tq *tenantQ, msg *jetstream.RawStreamMsg) (*Run, error) {
	var qe queueEntry
	if err := json.Unmarshal(msg.Data, &qe); err != nil || !validID(qe.ID) {
		x.dropEntry(msg.Sequence)
		return nil, fmt.Errorf("corrupt queue entry %d dropped", msg.Sequence)
	}
	r, err := x.claimOnce(ctx, tq, msg, qe, false)
	if errors.Is(err, errStaleRead) {
		r, err = x.claimOnce(ctx, tq, msg, qe, true)
	}
	return r, err
}

// errStaleRead is claimOnce's answer when a compare-and-set refused a run read from a replica.
var errStaleRead = errors.New("runner: the run read from a replica was not the latest")

// claimRead reads a run for a claim: from the leader if leader is set, else with a direct get,
// and from the leader after all unless that finds the run pending and due (the claim's
// compare-and-set checks it). It reports whether the run came from the leader.
func (x *executor) claimRead(ctx context.Context, tenant, id string, leader bool) (Run, bool, error) {
	ctx, cancel := context.WithTimeout(ctx, x.s.cfg.OpTimeout)
	defer cancel()
	if !leader {
		r, err := x.s.store.getDirect(ctx, tenant, id)
		if err == nil && r.Status == StatusPending && (r.NotBefore == nil || !r.NotBefore.After(time.Now())) {
			return r, false, nil
		}
	}
	r, err := x.s.store.getLatest(ctx, tenant, id)
	return r, true, err
}

// claimOnce is one read and decision of claim (see there).
func (x *executor) claimOnce(ctx context.Context, tq *tenantQ, msg *jetstream.RawStreamMsg, qe queueEntry, leader bool) (*Run, error) {
	r, leader, err := x.claimRead(ctx, tq.tenant, qe.ID, leader)
	if errors.Is(err, ErrNoJob) {
		x.dropEntry(msg.Sequence)
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if r.Instance != "" && r.Instance != x.s.cfg.ID.Instance {
		return nil, nil // pinned elsewhere (never on our subjects, but be sure)
	}
	now := time.Now().UTC()
	switch r.Status {
	case StatusSucceeded, StatusFailed:
		x.dropEntry(msg.Sequence) // finished; its owner died before removing the entry
		return nil, nil
	case StatusPending:
		if r.NotBefore != nil && r.NotBefore.After(now) {
			x.s.rescanAt(tq, msg.Sequence, *r.NotBefore)
			return nil, nil
		}
	case StatusRunning:
		if r.LeaseUntil != nil && r.LeaseUntil.After(now) {
			x.s.rescanAt(tq, msg.Sequence, *r.LeaseUntil)
			return nil, nil
		}
		x.s.cfg.Logger.Info("taking over a job whose lease ran out", "tenant", r.Tenant, "job", r.ID, "ran_on", r.RanOn)
	}
	if !x.s.servingNow(tq.tenant) {
		// The shard does not serve the tenant now (a takeover gave it to another shard, or the
		// lease ran out): leave the job to whoever does; the placement change releases it here,
		// and a lease that comes back looks at the entry again in a second.
		x.s.rescanAt(tq, msg.Sequence, now.Add(time.Second))
		return nil, nil
	}
	lease := now.Add(x.s.cfg.RunTimeout + 5*time.Second)
	r.Status, r.Attempts, r.RanOn = StatusRunning, r.Attempts+1, x.s.cfg.ID.Instance
	r.StartedAt, r.LeaseUntil, r.NotBefore, r.Seq = &now, &lease, nil, msg.Sequence
	cctx, cancel := context.WithDeadline(ctx, lease)
	defer cancel()
	if err := x.putRunRetrying(cctx, &r, "claiming a job"); err != nil {
		switch {
		case schema.IsConflict(err) && !leader:
			return nil, errStaleRead
		case schema.IsConflict(err):
			return nil, nil // a sibling claimed it first
		}
		return nil, err
	}
	return &r, nil
}

// putRunRetrying writes r (putRun), trying again while NATS is unavailable, until ctx ends. A
// write stored by a try whose answer was lost (its stream leader died answering) makes the
// next try conflict; that must not be taken for another instance's write (a claim nobody runs
// would wait out its lease, an outcome would leave its queue entry), so a conflict reads the
// run back: the same attempt by us in the same status is our write.
func (x *executor) putRunRetrying(ctx context.Context, r *Run, what string) error {
	return x.s.cfg.whileUnavailable(ctx, func(octx context.Context) error {
		err := x.s.store.putRun(octx, r)
		if schema.IsConflict(err) {
			cur, gerr := x.s.store.getLatest(octx, r.Tenant, r.ID)
			if schema.IsUnavailable(gerr) {
				return gerr // read it back on the next try
			}
			if gerr == nil && cur.Status == r.Status && cur.RanOn == r.RanOn && cur.Attempts == r.Attempts &&
				cur.StartedAt != nil && r.StartedAt != nil && cur.StartedAt.Equal(*r.StartedAt) {
				r.rev = cur.rev
				return nil
			}
		}
		return err
	}, what, "tenant", r.Tenant, "job", r.ID)
}

// unclaim returns a claimed, not started job to pending.
func (x *executor) unclaim(r *Run) {
	ctx, cancel := context.WithTimeout(context.Background(), x.s.cfg.OpTimeout)
	defer cancel()
	r.Status, r.Attempts, r.LeaseUntil, r.StartedAt = StatusPending, r.Attempts-1, nil, nil
	if err := x.s.store.putRun(ctx, r); err != nil {
		x.s.cfg.Logger.Warn("giving back a job", "tenant", r.Tenant, "job", r.ID, "err", err)
	}
}

func (x *executor) dropEntry(seq uint64) {
	// Bounded like a try: a run waits for it (and a drain waits for the run). An entry left
	// behind is dropped by the next claim, which finds its run finished.
	ctx, cancel := context.WithTimeout(context.Background(), min(x.s.cfg.OpTimeout, 4*firstTry))
	defer cancel()
	// Removing an entry twice (a flush and the run racing) fails harmlessly: log at debug.
	if err := x.s.jobs.DeleteMsg(ctx, seq); err != nil {
		x.s.cfg.Logger.Debug("removing queue entry", "seq", seq, "err", err)
	}
}

// execute runs one attempt and records its outcome.
func (x *executor) execute(ctx context.Context, tq *tenantQ, r *Run, seq uint64) {
	start := time.Now()
	rctx, cancel := context.WithTimeout(ctx, x.s.cfg.RunTimeout)
	out, err := x.attempt(rctx, r)
	cancel()
	took := time.Since(start)
	x.s.m.runSeconds.Observe(took.Seconds())
	x.finish(ctx, tq, r, seq, out, err)
	x.s.runs.note(r.Tenant, took, r.Status)
	x.done(tq)
}

// attempt runs the job's handler, records its effects in the outbox and delivers them.
func (x *executor) attempt(ctx context.Context, r *Run) (Output, error) {
	h := x.s.handlers[r.Type]
	if h == nil {
		return Output{}, fmt.Errorf("%w %q", ErrUnknownType, r.Type)
	}
	out, err := h(ctx, *r)
	if err != nil {
		return out, err
	}
	reqs := make([]Request, len(out.Effects))
	for i, e := range out.Effects {
		e.Key = fmt.Sprintf("%s.job.%s.%d", r.Tenant, r.ID, i)
		e.Tenant = r.Tenant
		reqs[i] = e
	}
	if err := x.s.outbox.deliverAll(ctx, reqs, r.Attempts >= x.s.cfg.MaxAttempts); err != nil {
		return out, err
	}
	for _, e := range reqs {
		r.Effects = append(r.Effects, e.Key)
	}
	return out, nil
}

// recordOutcome writes r, trying again while NATS is unavailable (a leader election), until
// until (the end of our lease) or ctx ends: a run left "running" would wait for its lease to run
// out before anyone took it up again. The first try is made even if ctx has ended (a drain
// cancelled the run). A conflict means the lease ran out and another instance took the job
// over: its outcome wins.
func (x *executor) recordOutcome(ctx context.Context, r *Run, until time.Time) error {
	ctx, cancel := context.WithDeadline(ctx, until)
	defer cancel()
	return x.putRunRetrying(ctx, r, "recording job outcome")
}

// whileUnavailable runs op, and again after a short wait while it fails because NATS is
// unavailable (a stream or meta leader election, a reconnect), until ctx ends. Each try gets
// its own short timeout (firstTry, doubling) and is made even if ctx has ended: a request
// whose answer was lost in an election would otherwise hold the caller for all of ctx's time
// (a run's 30 s; and a drain at handoff waits for its runs). op must be safe to repeat: its first try may
// have been stored though its answer was lost.
func (c Config) whileUnavailable(ctx context.Context, op func(context.Context) error, what string, attrs ...any) error {
	return backoff.Retry(ctx, backoff.Policy{
		Initial: 100 * time.Millisecond, Max: time.Second,
		TryTimeout: firstTry, Detach: true, // each try bounded to OpTimeout too, in op
		RetryIf: schema.IsUnavailable,
		OnRetry: func(err error, _ time.Duration) {
			c.Logger.Info(what+": NATS unavailable, trying again", append(attrs, "err", err)...)
		},
	}, func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, c.OpTimeout)
		defer cancel()
		return op(ctx)
	})
}

// firstTry bounds the first try of a NATS call made through whileUnavailable, each later one
// twice the one before (at most 4x), as jsx bounds the store's. A healthy write takes
// milliseconds and a leader election well under a second; a try whose answer was lost with a
// stream leader that stopped costs this much before the next. (Tries of 1.5 s each held a job
// create in flight that long after a NATS node stopped, and with it the source's drain of a
// moving tenant: chaos timelines, runner handoff -> commit 1.1-1.35 s after the stop.)
const firstTry = 500 * time.Millisecond

// finish writes the attempt's outcome: succeeded, failed, or pending again after a backoff.
func (x *executor) finish(ctx context.Context, tq *tenantQ, r *Run, seq uint64, out Output, err error) {
	now := time.Now().UTC()
	until := now.Add(x.s.cfg.OpTimeout) // how long to keep trying: while the lease is ours
	if r.LeaseUntil != nil && r.LeaseUntil.After(until) {
		until = *r.LeaseUntil
	}
	r.LeaseUntil = nil
	var retryAt time.Time
	switch {
	case err == nil:
		r.Status, r.Result, r.Error, r.FinishedAt = StatusSucceeded, out.Result, "", &now
	case errors.Is(err, ErrPermanent) || r.Attempts >= x.s.cfg.MaxAttempts:
		r.Status, r.Error, r.FinishedAt = StatusFailed, err.Error(), &now
	default:
		retryAt = now.Add(min(x.s.cfg.RetryBackoff<<(r.Attempts-1), time.Minute))
		r.Status, r.Error, r.NotBefore = StatusPending, err.Error(), &retryAt
	}
	if perr := x.recordOutcome(ctx, r, until); perr != nil {
		x.s.cfg.Logger.Warn("recording job outcome", "tenant", r.Tenant, "job", r.ID, "err", perr)
		return
	}
	x.s.mu.Lock()
	switch r.Status {
	case StatusSucceeded:
		x.s.totals.Succeeded++
	case StatusFailed:
		x.s.totals.Failed++
	default:
		x.s.totals.Retried++
	}
	x.s.mu.Unlock()
	x.s.m.finished.WithLabelValues(string(r.Status)).Inc()
	x.s.recent.note(r)
	x.s.announce(schema.JobRunDone, r)
	if r.Status.done() {
		x.dropEntry(seq)
		return
	}
	x.s.rescanAt(tq, seq, retryAt)
}

// Release stops acquiring the tenant; shardkit calls it when this shard stops serving the
// tenant, and reports the tenant released (drained) when it returns. Its runs in flight are
// not waited for: a claim is a compare-and-set on the run record and a run holds a lease, so
// the next owner never runs an attempt that is still running here, and every effect is
// delivered once by its marker. They finish in the background (within DrainTimeout, then they
// are cancelled: their next attempt is the new owner's; Run waits for them), followed by the
// outbox flush and the drain record, housekeeping that the next owner's flush and the markers
// make safe to race. So a move's finish waits neither for a job's run time nor for the NATS
// round trips of its last steps, each of which can wait out a stream leader's election after a
// NATS node stops (a run in flight then held the runner's finish 1.3-1.4 s in chaos runs).
func (s *Service) Release(ctx context.Context, tenant string) error {
	s.mu.Lock()
	tq := s.tenants[tenant]
	if tq == nil {
		s.mu.Unlock()
		return nil
	}
	tq.released = true
	cancelRuns := tq.cancel
	delete(s.fenced, tenant)
	s.mu.Unlock()
	s.wakes.unsubscribe(tq)
	s.housekeeping.Go(func() {
		bound, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.DrainTimeout)
		left := s.exec.waitIdle(bound, tq)
		cancel()
		s.mu.Lock()
		again := tq.acquired && !tq.released // a new turn (the move rolled back): its runs are ours
		s.mu.Unlock()
		cancelled := 0
		if left > 0 && !again {
			cancelled = left
			s.cfg.Logger.Warn("drain bound reached: cancelling runs", "tenant", tenant, "in_flight", left)
			cancelRuns()
			// Cancelled runs end at once, but an effect delivery under way completes (bounded
			// by RunTimeout) so that it is never half done.
			ended, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.RunTimeout)
			s.exec.waitIdle(ended, tq)
			cancel()
		}
		// A saga batch or an outbox flush of the tenant may still be going: it is not waited
		// for. Checkpoints are written by compare-and-set and effects are delivered once by
		// their markers, so the next owner doing the same at the same time is safe; the batch
		// stops at its next event, seeing the tenant released.
		hctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.DrainTimeout)
		defer cancel()
		flushed, err := s.outbox.flush(hctx, tenant)
		if err != nil {
			s.cfg.Logger.Warn("flushing a released tenant's outbox; its next owner flushes it", "tenant", tenant, "err", err)
		}
		if err := s.sagas.writeDrainRecord(hctx, tenant, cancelled, flushed); err != nil {
			s.cfg.Logger.Warn("writing a drain record", "tenant", tenant, "err", err)
		}
		s.cfg.Logger.Info("tenant released", "tenant", tenant, "cancelled", cancelled, "outbox_flushed", flushed)
	})
	return nil
}

// waitIdle waits until the tenant has no run in flight or ctx ends; it returns the runs left.
func (x *executor) waitIdle(ctx context.Context, tq *tenantQ) int {
	for {
		x.s.mu.Lock()
		n := tq.inflight
		x.s.mu.Unlock()
		if n == 0 {
			return 0
		}
		select {
		case <-tq.idle:
		case <-ctx.Done():
			return n
		}
	}
}
