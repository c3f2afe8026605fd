package runner

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// tenantQ is one tenant's acquisition state on this instance. Fields are guarded by
// Service.mu unless noted.
type tenantQ struct {
	tenant string
	// acquired: the shard owns the tenant now; released: Release stopped acquisition until the
	// placement changes again (or Reload).
	acquired, released bool
	// ready: the tenant is in the ring (it may have a job we can take).
	ready bool
	// cursor[i] is the first stream sequence not yet looked at on subjects()[i].
	cursor [2]uint64
	// dirty[i]: subjects()[i] may hold an entry at or after its cursor.
	dirty [2]bool
	// wokeAt is the last wake-up; rechecking is set while a recheck is scheduled (see
	// recheckAfterWake). sagaWokeAt is the same for events.
	wokeAt, sagaWokeAt time.Time
	rechecking         bool
	inflight           int
	rate               *limiter
	// parked: waiting for the tenant's rate; a timer puts it back in the ring.
	parked bool
	subs   []*nats.Subscription
	// sagaReady: the tenant is in the saga ring (it may have events its sagas have not seen).
	sagaReady bool
	// work counts runs and outbox deliveries in flight for the tenant (not under mu).
	work sync.WaitGroup
	// ctx is cancelled when a release gives up waiting for the tenant's runs.
	ctx    context.Context
	cancel context.CancelFunc
	// idle is signalled whenever inflight drops.
	idle chan struct{}
}

func (s *Service) subjects(tenant string) [2]string {
	return [2]string{pinSubject(tenant, s.cfg.ID.Instance), anySubject(tenant)}
}

// owns says whether this shard acquires a tenant at placement e: it is the owner, and the
// tenant is not in handoff (the source stops acquiring then; the target starts at commit).
func (s *Service) owns(e placement.Entry, ok bool) bool {
	return ok && e.Shard == s.cfg.ID.Shard && e.Phase != schema.PhaseHandoff
}

// onChange runs on the watcher's apply goroutine: it only notes the tenants that concern
// this shard, for the reconciler.
func (s *Service) onChange(c placement.Change) {
	me := s.cfg.ID.Shard
	if !(c.OldOK && (c.Old.Shard == me || c.Old.Target == me)) && !(c.NewOK && (c.New.Shard == me || c.New.Target == me)) {
		return
	}
	s.mu.Lock()
	s.changed[c.Tenant] = struct{}{}
	s.mu.Unlock()
	nudge(s.recon)
}

func (s *Service) reconcileLoop(ctx context.Context) {
	for {
		select {
		case <-s.recon:
		case <-ctx.Done():
			return
		}
		s.mu.Lock()
		changed := s.changed
		s.changed = map[string]struct{}{}
		s.mu.Unlock()
		for t := range changed {
			s.reconcile(ctx, t)
		}
	}
}

// reconcile starts or stops acquiring tenant after its placement changed.
func (s *Service) reconcile(ctx context.Context, tenant string) {
	e, ok := s.watcher.Lookup(Kind, tenant)
	own := s.owns(e, ok)
	s.mu.Lock()
	tq := s.tenants[tenant]
	if own && tq == nil {
		tq = &tenantQ{tenant: tenant, idle: make(chan struct{}, 1)}
		tq.ctx, tq.cancel = context.WithCancel(ctx)
		if s.cfg.TenantJobsPerMinute > 0 {
			tq.rate = newLimiter(s.tenantRate())
		}
		s.tenants[tenant] = tq
	}
	if tq == nil {
		s.mu.Unlock()
		return
	}
	was := tq.acquired && !tq.released
	tq.acquired = own
	if own && !was {
		// A new turn of ownership: forget an earlier release, look at the whole queue.
		tq.released = false
		tq.cursor, tq.dirty = [2]uint64{}, [2]bool{true, true}
		if tq.ctx.Err() != nil {
			tq.ctx, tq.cancel = context.WithCancel(ctx)
		}
	}
	subscribe := own && tq.subs == nil
	s.mu.Unlock()
	if subscribe {
		s.subscribe(tq)
	}
	if own && !was {
		s.goFlush(tq)
		s.markReady(tq)
		s.markSagaReady(tq)
		s.cfg.Logger.Debug("acquiring tenant", "tenant", tenant, "epoch", e.Epoch, "phase", e.Phase)
	}
	if !own && was {
		// Stop acquiring now; runs in flight finish, Release (shardkit) waits for them.
		s.unsubscribe(tq)
		s.cfg.Logger.Debug("stopped acquiring tenant", "tenant", tenant, "phase", e.Phase, "owner", e.Shard)
	}
}

// goFlush queues the tenant for an outbox flush: what a former owner (or an earlier turn
// here) left in its outbox is delivered. A few workers (flushLoop) do the flushes, so
// acquiring 10,000 tenants at once does not fire 10,000 reads together.
func (s *Service) goFlush(tq *tenantQ) {
	s.mu.Lock()
	if tq.released || !tq.acquired {
		s.mu.Unlock()
		return
	}
	tq.work.Add(1)
	s.flushq = append(s.flushq, tq)
	s.mu.Unlock()
	nudge(s.flushWake)
}

// flushWorkers is how many outbox flushes run at once.
const flushWorkers = 4

func (s *Service) flushLoop(ctx context.Context) {
	var wg sync.WaitGroup
	for range flushWorkers {
		wg.Go(func() {
			for {
				s.mu.Lock()
				var tq *tenantQ
				if len(s.flushq) > 0 {
					tq = s.flushq[0]
					s.flushq = s.flushq[1:]
				}
				var tctx context.Context
				if tq != nil {
					tctx = tq.ctx
				}
				s.mu.Unlock()
				if tq == nil {
					select {
					case <-s.flushWake:
						continue
					case <-ctx.Done():
						return
					}
				}
				nudge(s.flushWake) // more may be queued: let another worker look too
				if n, err := s.flushOutbox(tctx, tq.tenant); err != nil && tctx.Err() == nil {
					s.cfg.Logger.Warn("flushing the outbox of an acquired tenant", "tenant", tq.tenant, "err", err)
				} else if n > 0 {
					s.cfg.Logger.Info("delivered effects left in the outbox", "tenant", tq.tenant, "effects", n)
				}
				tq.work.Done()
			}
		})
	}
	wg.Wait()
	// Flushes still queued will not run: let their tenants' waiters go.
	s.mu.Lock()
	left := s.flushq
	s.flushq = nil
	s.mu.Unlock()
	for _, tq := range left {
		tq.work.Done()
	}
}

// subscribe registers core NATS interest in the tenant's queue and event subjects: every
// enqueue or event is also delivered here and wakes the tenant. Lossy by design; Sweep covers.
// All subscriptions share one channel and one goroutine (wakeLoop), so 10,000 tenants cost
// 20,000-30,000 subscriptions but no goroutine each.
func (s *Service) subscribe(tq *tenantQ) {
	nc := s.st.Conn()
	subjects := s.subjects(tq.tenant)
	all := subjects[:]
	if len(s.cfg.Sagas) > 0 {
		all = append(all, schema.TenantEvents(tq.tenant))
	}
	var subs []*nats.Subscription
	for _, subj := range all {
		sub, err := nc.ChanSubscribe(subj, s.wakeCh)
		if err != nil {
			s.cfg.Logger.Warn("wake-up subscription", "subject", subj, "err", err)
			continue
		}
		subs = append(subs, sub)
	}
	s.mu.Lock()
	tq.subs = subs
	s.mu.Unlock()
}

// wakeLoop turns wake-up messages into ready tenants.
func (s *Service) wakeLoop(ctx context.Context) {
	for {
		select {
		case m := <-s.wakeCh:
			s.wake1(m.Subject)
		case <-ctx.Done():
			return
		}
	}
}

// wake1 handles one wake-up: jobs.<tenant>.pin.<instance>, jobs.<tenant>.any or
// events.<tenant>.<...>.
func (s *Service) wake1(subject string) {
	prefix, rest, _ := strings.Cut(subject, ".")
	tenant, rest, _ := strings.Cut(rest, ".")
	s.mu.Lock()
	tq := s.tenants[tenant]
	s.mu.Unlock()
	if tq == nil {
		return
	}
	switch {
	case prefix == "events":
		s.mu.Lock()
		tq.sagaWokeAt = time.Now()
		s.mu.Unlock()
		s.markSagaReady(tq)
	case rest == "any":
		s.markDirty(tq, 1)
	case strings.HasPrefix(rest, "pin."):
		s.markDirty(tq, 0)
	}
}

// unsubscribe drops the tenant's wake-up subscriptions.
func (s *Service) unsubscribe(tq *tenantQ) {
	s.mu.Lock()
	subs := tq.subs
	tq.subs = nil
	s.mu.Unlock()
	for _, sub := range subs {
		_ = sub.Unsubscribe()
	}
}

// markDirty notes that subjects()[i] of the tenant got an entry, and readies the tenant.
func (s *Service) markDirty(tq *tenantQ, i int) {
	s.mu.Lock()
	tq.dirty[i] = true
	tq.wokeAt = time.Now()
	s.mu.Unlock()
	s.markReady(tq)
}

// markReady puts the tenant in the ring if it is acquired and not already there.
func (s *Service) markReady(tq *tenantQ) {
	s.mu.Lock()
	if tq.acquired && !tq.released && !tq.ready && !tq.parked {
		tq.ready = true
		s.ring = append(s.ring, tq)
	}
	s.mu.Unlock()
	nudge(s.wake)
}

// wakeWindow is how long after a wake-up an empty read is retried. A core NATS subscriber may
// get a JetStream publish before the stream stored it (the stream ingests asynchronously), so
// a read right after the wake-up can miss the entry that caused it; without a retry the entry
// would wait for the sweep.
const wakeWindow = time.Second

// recheckAfterWake schedules one more read of the tenant's subjects shortly, if it was woken
// within wakeWindow and no recheck is pending.
func (s *Service) recheckAfterWake(tq *tenantQ) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if tq.rechecking || time.Since(tq.wokeAt) > wakeWindow {
		return
	}
	tq.rechecking = true
	time.AfterFunc(20*time.Millisecond, func() {
		s.mu.Lock()
		tq.rechecking = false
		tq.dirty = [2]bool{true, true}
		s.mu.Unlock()
		s.markReady(tq)
	})
}

// rescan makes the tenant look again from seq (a retry's backoff or a lease ended).
func (s *Service) rescanAt(tq *tenantQ, seq uint64, at time.Time) {
	time.AfterFunc(time.Until(at), func() {
		s.mu.Lock()
		for i := range tq.cursor {
			tq.cursor[i] = min(tq.cursor[i], seq)
			tq.dirty[i] = true
		}
		s.mu.Unlock()
		s.markReady(tq)
	})
}

func (s *Service) sweepLoop(ctx context.Context) {
	t := time.NewTicker(s.cfg.Sweep)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-ctx.Done():
			return
		}
		s.mu.Lock()
		var all []*tenantQ
		for _, tq := range s.tenants {
			tq.cursor, tq.dirty = [2]uint64{}, [2]bool{true, true}
			all = append(all, tq)
		}
		s.mu.Unlock()
		for _, tq := range all {
			s.markReady(tq)
			s.markSagaReady(tq)
		}
	}
}

// dispatchLoop starts jobs: one per ready tenant in turn, within the limits.
func (s *Service) dispatchLoop(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		if wait := s.dispatch(ctx); wait > 0 {
			timer.Reset(wait)
		}
		select {
		case <-s.wake:
		case <-timer.C:
		case <-ctx.Done():
			return
		}
	}
}

// dispatch starts as many jobs as the limits allow and returns how long until the instance
// rate allows the next (0: wait for a wake-up). Its serial part is one read of the tenant's
// next queue entry (usually one round trip); claiming and running happen in the job's own
// goroutine, which holds a reserved slot and the rate tokens and gives them back if the claim
// loses (a sibling instance took the job, or it is not due).
func (s *Service) dispatch(ctx context.Context) time.Duration {
	for ctx.Err() == nil {
		s.mu.Lock()
		if s.running >= s.cfg.MaxConcurrent {
			s.mu.Unlock()
			return 0
		}
		if s.instRate != nil {
			if wait := s.instRate.wait(time.Now()); wait > 0 {
				s.mu.Unlock()
				return wait
			}
		}
		tq := s.popReady()
		if tq == nil {
			s.mu.Unlock()
			return 0
		}
		if tq.rate != nil {
			if wait := tq.rate.wait(time.Now()); wait > 0 {
				tq.parked = true
				s.mu.Unlock()
				time.AfterFunc(wait, func() {
					s.mu.Lock()
					tq.parked = false
					s.mu.Unlock()
					s.markReady(tq)
				})
				continue
			}
		}
		s.mu.Unlock()
		msg, i, err := s.next(ctx, tq)
		if err != nil {
			if !errors.Is(err, jetstream.ErrMsgNotFound) && ctx.Err() == nil {
				s.cfg.Logger.Warn("reading queue", "tenant", tq.tenant, "err", err)
				s.rescanAt(tq, 0, time.Now().Add(time.Second))
			}
			s.recheckAfterWake(tq)
			continue // nothing to take: the tenant leaves the ring until a wake-up
		}
		s.mu.Lock()
		tq.cursor[i] = msg.Sequence + 1
		if !tq.acquired || tq.released {
			s.mu.Unlock()
			continue
		}
		now := time.Now()
		if s.instRate != nil {
			s.instRate.take(now)
		}
		if tq.rate != nil {
			tq.rate.take(now)
		}
		s.running++
		tq.inflight++
		tq.work.Add(1)
		rctx := tq.ctx
		// Back to the end of the ring: the tenant may have more, after every other ready one.
		s.requeue(tq)
		s.mu.Unlock()
		go s.claimAndRun(rctx, tq, msg)
	}
	return 0
}

func (s *Service) requeue(tq *tenantQ) {
	if !tq.ready && !tq.parked {
		tq.ready = true
		s.ring = append(s.ring, tq)
	}
}

func (s *Service) popReady() *tenantQ {
	for len(s.ring) > 0 {
		tq := s.ring[0]
		s.ring[0] = nil
		s.ring = s.ring[1:]
		tq.ready = false
		if tq.acquired && !tq.released {
			return tq
		}
	}
	s.ring = nil
	return nil
}

// claimAndRun claims the entry's job and runs it, or gives the slot and the tokens back.
func (s *Service) claimAndRun(ctx context.Context, tq *tenantQ, msg *jetstream.RawStreamMsg) {
	r, err := s.claim(ctx, tq, msg)
	if err != nil && ctx.Err() == nil {
		s.cfg.Logger.Warn("claiming job", "tenant", tq.tenant, "seq", msg.Sequence, "err", err)
	}
	if r == nil {
		s.mu.Lock()
		if s.instRate != nil {
			s.instRate.refund()
		}
		if tq.rate != nil {
			tq.rate.refund()
		}
		s.mu.Unlock()
		s.done(tq)
		return
	}
	s.mu.Lock()
	released := tq.released || !tq.acquired
	if !released {
		s.totals.Started++
	}
	s.mu.Unlock()
	if released {
		// Released while we claimed: give the job back untouched for the next owner.
		s.unclaim(r)
		s.done(tq)
		return
	}
	s.execute(ctx, tq, r, msg.Sequence)
}

// done frees a slot of tenant tq.
func (s *Service) done(tq *tenantQ) {
	s.mu.Lock()
	s.running--
	tq.inflight--
	s.mu.Unlock()
	tq.work.Done()
	select {
	case tq.idle <- struct{}{}:
	default:
	}
	nudge(s.wake)
}

// next reads the first entry at or after the cursors, the lower sequence of both subjects. A
// subject is read only while it may hold something (dirty): a wake-up, a sweep or a rescan
// sets the flag, an empty read clears it.
func (s *Service) next(ctx context.Context, tq *tenantQ) (*jetstream.RawStreamMsg, int, error) {
	subjects := s.subjects(tq.tenant)
	var best *jetstream.RawStreamMsg
	bi := -1
	for i, subj := range subjects {
		s.mu.Lock()
		dirty, cur := tq.dirty[i], tq.cursor[i]
		tq.dirty[i] = false // cleared before the read, so a wake-up during it is not lost
		s.mu.Unlock()
		if !dirty {
			continue
		}
		gctx, cancel := context.WithTimeout(ctx, s.cfg.OpTimeout)
		m, err := s.jobs.GetMsg(gctx, max(cur, 1), jetstream.WithGetMsgSubject(subj))
		cancel()
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		s.mu.Lock()
		tq.dirty[i] = true
		s.mu.Unlock()
		if err != nil {
			return nil, 0, err
		}
		if best == nil || m.Sequence < best.Sequence {
			best, bi = m, i
		}
	}
	if best == nil {
		return nil, 0, jetstream.ErrMsgNotFound
	}
	return best, bi, nil
}

// claim takes the job of a queue entry if it can run now: pending and due, or running on a
// lease that ran out. The compare-and-set on the run record makes one claimant win.
func (s *Service) claim(ctx context.Context, tq *tenantQ, msg *jetstream.RawStreamMsg) (*Run, error) {
	var qe queueEntry
	if err := json.Unmarshal(msg.Data, &qe); err != nil || !validID(qe.ID) {
		s.dropEntry(msg.Sequence)
		return nil, fmt.Errorf("corrupt queue entry %d dropped", msg.Sequence)
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.OpTimeout)
	defer cancel()
	r, err := s.Get(ctx, tq.tenant, qe.ID)
	if errors.Is(err, ErrNoJob) {
		s.dropEntry(msg.Sequence)
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if r.Instance != "" && r.Instance != s.cfg.ID.Instance {
		return nil, nil // pinned elsewhere (never on our subjects, but be sure)
	}
	now := time.Now().UTC()
	switch r.Status {
	case StatusSucceeded, StatusFailed:
		s.dropEntry(msg.Sequence) // finished; its owner died before removing the entry
		return nil, nil
	case StatusPending:
		if r.NotBefore != nil && r.NotBefore.After(now) {
			s.rescanAt(tq, msg.Sequence, *r.NotBefore)
			return nil, nil
		}
	case StatusRunning:
		if r.LeaseUntil != nil && r.LeaseUntil.After(now) {
			s.rescanAt(tq, msg.Sequence, *r.LeaseUntil)
			return nil, nil
		}
		s.cfg.Logger.Info("taking over a job whose lease ran out", "tenant", r.Tenant, "job", r.ID, "ran_on", r.RanOn)
	}
	lease := now.Add(s.cfg.RunTimeout + 5*time.Second)
	r.Status, r.Attempts, r.RanOn = StatusRunning, r.Attempts+1, s.cfg.ID.Instance
	r.StartedAt, r.LeaseUntil, r.NotBefore, r.Seq = &now, &lease, nil, msg.Sequence
	if err := s.putRun(ctx, &r); err != nil {
		if isConflict(err) {
			return nil, nil // a sibling claimed it first
		}
		return nil, err
	}
	return &r, nil
}

// unclaim returns a claimed, not started job to pending.
func (s *Service) unclaim(r *Run) {
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.OpTimeout)
	defer cancel()
	r.Status, r.Attempts, r.LeaseUntil, r.StartedAt = StatusPending, r.Attempts-1, nil, nil
	if err := s.putRun(ctx, r); err != nil {
		s.cfg.Logger.Warn("giving back a job", "tenant", r.Tenant, "job", r.ID, "err", err)
	}
}

func isConflict(err error) bool {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) && (apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
		apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant) {
		return true
	}
	return errors.Is(err, jetstream.ErrKeyExists)
}

func (s *Service) dropEntry(seq uint64) {
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.OpTimeout)
	defer cancel()
	// Removing an entry twice (a flush and the run racing) fails harmlessly: log at debug.
	if err := s.jobs.DeleteMsg(ctx, seq); err != nil {
		s.cfg.Logger.Debug("removing queue entry", "seq", seq, "err", err)
	}
}

// execute runs one attempt and records its outcome.
func (s *Service) execute(ctx context.Context, tq *tenantQ, r *Run, seq uint64) {
	start := time.Now()
	rctx, cancel := context.WithTimeout(ctx, s.cfg.RunTimeout)
	out, err := s.attempt(rctx, r)
	cancel()
	s.m.runSeconds.Observe(time.Since(start).Seconds())
	s.finish(tq, r, seq, out, err)
	s.done(tq)
}

// attempt runs the job's handler, records its effects in the outbox and delivers them.
func (s *Service) attempt(ctx context.Context, r *Run) (Output, error) {
	h := s.handlers[r.Type]
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
	if err := s.deliverAll(ctx, reqs, r.Attempts >= s.cfg.MaxAttempts); err != nil {
		return out, err
	}
	for _, e := range reqs {
		r.Effects = append(r.Effects, e.Key)
	}
	return out, nil
}

// finish writes the attempt's outcome: succeeded, failed, or pending again after a backoff.
func (s *Service) finish(tq *tenantQ, r *Run, seq uint64, out Output, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.OpTimeout)
	defer cancel()
	now := time.Now().UTC()
	r.LeaseUntil = nil
	var retryAt time.Time
	switch {
	case err == nil:
		r.Status, r.Result, r.Error, r.FinishedAt = StatusSucceeded, out.Result, "", &now
	case errors.Is(err, ErrPermanent) || r.Attempts >= s.cfg.MaxAttempts:
		r.Status, r.Error, r.FinishedAt = StatusFailed, err.Error(), &now
	default:
		retryAt = now.Add(min(s.cfg.RetryBackoff<<(r.Attempts-1), time.Minute))
		r.Status, r.Error, r.NotBefore = StatusPending, err.Error(), &retryAt
	}
	if perr := s.putRun(ctx, r); perr != nil {
		// Our lease ran out and another instance took the job over: its outcome wins.
		s.cfg.Logger.Warn("recording job outcome", "tenant", r.Tenant, "job", r.ID, "err", perr)
		return
	}
	s.mu.Lock()
	switch r.Status {
	case StatusSucceeded:
		s.totals.Succeeded++
	case StatusFailed:
		s.totals.Failed++
	default:
		s.totals.Retried++
	}
	s.mu.Unlock()
	s.m.finished.WithLabelValues(string(r.Status)).Inc()
	if r.Status.done() {
		s.dropEntry(seq)
		return
	}
	s.rescanAt(tq, seq, retryAt)
}

// Release stops acquiring the tenant, waits for its runs in flight (within DrainTimeout, then
// cancels them: their next attempt is the new owner's), flushes its outbox and writes its
// checkpoint and a drain record. shardkit calls it when this shard stops serving the tenant.
func (s *Service) Release(ctx context.Context, tenant string) error {
	s.mu.Lock()
	tq := s.tenants[tenant]
	if tq == nil {
		s.mu.Unlock()
		return nil
	}
	tq.released = true
	cancelRuns := tq.cancel
	s.mu.Unlock()
	s.unsubscribe(tq)
	bound, cancel := context.WithTimeout(ctx, s.cfg.DrainTimeout)
	defer cancel()
	left := s.waitIdle(bound, tq)
	if left > 0 {
		s.cfg.Logger.Warn("drain bound reached: cancelling runs", "tenant", tenant, "in_flight", left)
		cancelRuns()
	}
	tq.work.Wait()
	flushed, err := s.flushOutbox(ctx, tenant)
	if err != nil {
		return fmt.Errorf("runner: release %s: flush outbox: %w", tenant, err)
	}
	if err := s.writeDrainRecord(ctx, tenant, left, flushed); err != nil {
		return err
	}
	s.cfg.Logger.Info("tenant released", "tenant", tenant, "cancelled", left, "outbox_flushed", flushed)
	return nil
}

// waitIdle waits until the tenant has no run in flight or ctx ends; it returns the runs left.
func (s *Service) waitIdle(ctx context.Context, tq *tenantQ) int {
	for {
		s.mu.Lock()
		n := tq.inflight
		s.mu.Unlock()
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

// limiter spaces starts evenly at perMinute, with a burst of one second's worth (GCRA).
type limiter struct {
	interval time.Duration
	burst    time.Duration // tolerance: (burst-1) intervals
	tat      time.Time     // theoretical arrival time of the next start
}

func newLimiter(perMinute int) *limiter {
	l := &limiter{}
	l.setRate(perMinute)
	return l
}

// setRate changes the rate, keeping the starts already taken.
func (l *limiter) setRate(perMinute int) {
	perMinute = max(perMinute, 1)
	l.interval = time.Minute / time.Duration(perMinute)
	l.burst = time.Duration(max(perMinute/60, 1)-1) * l.interval
}

// wait is how long until a start is allowed (0: now).
func (l *limiter) wait(now time.Time) time.Duration {
	if !l.tat.After(now) {
		return 0
	}
	if d := l.tat.Sub(now) - l.burst; d > 0 {
		return d
	}
	return 0
}

// refund gives back the last start taken.
func (l *limiter) refund() { l.tat = l.tat.Add(-l.interval) }

func (l *limiter) take(now time.Time) {
	if l.tat.Before(now) {
		l.tat = now
	}
	l.tat = l.tat.Add(l.interval)
}
