package runner

import (
	"context"
	"errors"
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
	// work counts the tenant's runs, saga batches and outbox flushes in flight (not under
	// mu); Run waits for it at shutdown. Release waits only for the runs (inflight).
	work sync.WaitGroup
	// ctx is cancelled when a release gives up waiting for the tenant's runs.
	ctx    context.Context
	cancel context.CancelFunc
	// idle is signalled whenever inflight drops.
	idle chan struct{}
	// claiming counts the claims under way (a claim, and the give-back of a claim that found
	// the tenant released); settled, if not nil, is closed when it drops to 0. A move's
	// source reads its digest once they settled (settledClaims).
	claiming int
	settled  chan struct{}
	// awaiting is the handoff epoch whose digests acquisition waits for (a verified move to
	// this shard); digested the last one recorded or waited out (awaitDigests).
	awaiting, digested uint64
}

func (s *Service) subjects(tenant string) [2]string {
	return [2]string{pinSubject(tenant, s.cfg.ID.Instance), anySubject(tenant)}
}

// owns says whether this shard acquires a tenant at placement e: it is the owner, and the
// tenant is not in handoff or takeover (the source stops acquiring then; the target starts at
// commit).
func (s *Service) owns(e placement.Entry, ok bool) bool {
	return ok && e.Shard == s.cfg.ID.Shard && !e.Phase.Moving()
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
	if own && !was && s.awaitDigests(ctx, e, tq) {
		own = false // not yet: the move's digests are being read (reconciled again once recorded)
	}
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
		s.wakes.subscribe(tq)
	}
	if own && !was {
		s.outbox.goFlush(tq)
		s.markReady(tq)
		s.sagas.markReady(tq)
		s.sched.acquired()
		s.cfg.Logger.Debug("acquiring tenant", "tenant", tenant, "epoch", e.Epoch, "phase", e.Phase)
	}
	if !own && was {
		// Stop acquiring now; runs in flight finish, Release (shardkit) waits for them.
		s.wakes.unsubscribe(tq)
		s.cfg.Logger.Debug("stopped acquiring tenant", "tenant", tenant, "phase", e.Phase, "owner", e.Shard)
	}
}

// goFlush queues the tenant for an outbox flush: what a former owner (or an earlier turn
// here) left in its outbox is delivered. A few workers (flushLoop) do the flushes, so
// acquiring 10,000 tenants at once does not fire 10,000 reads together.
func (o *outbox) goFlush(tq *tenantQ) {
	o.s.mu.Lock()
	if tq.released || !tq.acquired {
		o.s.mu.Unlock()
		return
	}
	tq.work.Add(1)
	o.flushq = append(o.flushq, tq)
	o.s.mu.Unlock()
	nudge(o.flushWake)
}

// flushWorkers is how many outbox flushes run at once.
const flushWorkers = 4

func (o *outbox) flushLoop(ctx context.Context) {
	var wg sync.WaitGroup
	for range flushWorkers {
		wg.Go(func() {
			for {
				o.s.mu.Lock()
				var tq *tenantQ
				if len(o.flushq) > 0 {
					tq = o.flushq[0]
					o.flushq = o.flushq[1:]
				}
				var tctx context.Context
				if tq != nil {
					tctx = tq.ctx
				}
				o.s.mu.Unlock()
				if tq == nil {
					select {
					case <-o.flushWake:
						continue
					case <-ctx.Done():
						return
					}
				}
				nudge(o.flushWake) // more may be queued: let another worker look too
				if n, err := o.flush(tctx, tq.tenant); err != nil && tctx.Err() == nil {
					o.s.cfg.Logger.Warn("flushing the outbox of an acquired tenant", "tenant", tq.tenant, "err", err)
				} else if n > 0 {
					o.s.cfg.Logger.Info("delivered effects left in the outbox", "tenant", tq.tenant, "effects", n)
				}
				tq.work.Done()
			}
		})
	}
	wg.Wait()
	// Flushes still queued will not run: let their tenants' waiters go.
	o.s.mu.Lock()
	left := o.flushq
	o.flushq = nil
	o.s.mu.Unlock()
	for _, tq := range left {
		tq.work.Done()
	}
}

// wakeups hold a core NATS interest in each acquired tenant's queue and event subjects, and
// turn what arrives on them into wake-ups of the tenant's queue and sagas.
type wakeups struct {
	s      *Service
	wakeCh chan *nats.Msg // every wake-up subscription delivers here
}

// subscribe registers core NATS interest in the tenant's queue and event subjects: every
// enqueue or event is also delivered here and wakes the tenant. Lossy by design; Sweep covers.
// All subscriptions share one channel and one goroutine (wakeLoop), so 10,000 tenants cost
// 20,000-30,000 subscriptions but no goroutine each.
func (w *wakeups) subscribe(tq *tenantQ) {
	nc := w.s.st.JS().Conn()
	subjects := w.s.subjects(tq.tenant)
	all := subjects[:]
	if len(w.s.cfg.Sagas) > 0 {
		all = append(all, schema.TenantEvents(tq.tenant))
	}
	var subs []*nats.Subscription
	for _, subj := range all {
		sub, err := nc.ChanSubscribe(subj, w.wakeCh)
		if err != nil {
			w.s.cfg.Logger.Warn("wake-up subscription", "subject", subj, "err", err)
			continue
		}
		subs = append(subs, sub)
	}
	w.s.mu.Lock()
	tq.subs = subs
	w.s.mu.Unlock()
}

// wakeLoop turns wake-up messages into ready tenants.
func (w *wakeups) wakeLoop(ctx context.Context) {
	for {
		select {
		case m := <-w.wakeCh:
			w.wake1(m.Subject)
		case <-ctx.Done():
			return
		}
	}
}

// wake1 handles one wake-up: jobs.<tenant>.pin.<instance>, jobs.<tenant>.any or
// events.<tenant>.<...>.
func (w *wakeups) wake1(subject string) {
	prefix, rest, _ := strings.Cut(subject, ".")
	tenant, rest, _ := strings.Cut(rest, ".")
	w.s.mu.Lock()
	tq := w.s.tenants[tenant]
	w.s.mu.Unlock()
	if tq == nil {
		return
	}
	switch {
	case prefix == "events":
		w.s.mu.Lock()
		tq.sagaWokeAt = time.Now()
		w.s.mu.Unlock()
		w.s.sagas.markReady(tq)
	case rest == "any":
		w.s.markDirty(tq, 1)
	case strings.HasPrefix(rest, "pin."):
		w.s.markDirty(tq, 0)
	}
}

// unsubscribe drops the tenant's wake-up subscriptions.
func (w *wakeups) unsubscribe(tq *tenantQ) {
	w.s.mu.Lock()
	subs := tq.subs
	tq.subs = nil
	w.s.mu.Unlock()
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
			s.sagas.markReady(tq)
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
		tq.claiming++
		tq.work.Add(1)
		rctx := tq.ctx
		// Back to the end of the ring: the tenant may have more, after every other ready one.
		s.requeue(tq)
		s.mu.Unlock()
		go s.exec.claimAndRun(rctx, tq, msg)
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
