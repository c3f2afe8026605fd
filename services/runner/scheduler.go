package runner

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/robfig/cron/v3"

	"github.com/tenantmesh/tenantmesh/internal/promreg"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Scheduler fires the recurring schedules of the tenants its Service acquires. It keeps the
// acquired tenants' schedules in memory, loaded when a tenant is acquired and checked against
// the bucket every Sweep, and sleeps until the earliest due time. Before firing it reads the
// schedule from the bucket's leader, so a sibling's firing, a delete or an edit is seen.
type Scheduler struct {
	s   *Service
	kv  jetstream.KeyValue
	now func() time.Time

	mu      sync.Mutex
	tenants map[string]map[string]*Schedule // acquired tenant -> id -> schedule
	wake    chan struct{}

	fired prometheus.Counter
	lag   prometheus.Histogram
	due   *prometheus.GaugeVec
}

// maxCatchUp is how many due times of one schedule one pass fires; a schedule further behind
// (its owner was gone for long) goes on at the next pass, so no due time is skipped.
const maxCatchUp = 100

// dueTopN is how many tenants get their own label on tm_runner_schedules_due; the rest are
// summed as tenant="other".
const dueTopN = 10

func newScheduler(ctx context.Context, s *Service) (*Scheduler, error) {
	kv, err := s.st.JS().EnsureKV(ctx, jsx.KVSpec{Bucket: schema.BucketRunnerSchedules,
		Description: "runner: recurring schedules, <tenant>.<schedule id>"})
	if err != nil {
		return nil, err
	}
	sc := &Scheduler{s: s, kv: kv, now: time.Now, tenants: map[string]map[string]*Schedule{}, wake: make(chan struct{}, 1),
		fired: prometheus.NewCounter(prometheus.CounterOpts{Name: "tm_runner_schedule_fired_total",
			Help: "Due times of schedules that created their job here."}),
		lag: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "tm_runner_schedule_lag_seconds",
			Help: "From a schedule's due time to the creation of its job.", Buckets: prometheus.ExponentialBuckets(0.01, 4, 10)}),
		due: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "tm_runner_schedules_due",
			Help: "Schedules whose due time has come and whose job is not created yet, by tenant (the top 10, the rest as other)."},
			[]string{"tenant"}),
	}
	if reg := s.cfg.Registerer; reg != nil {
		sc.fired = promreg.Register(reg, sc.fired)
		sc.lag = promreg.Register(reg, sc.lag)
		sc.due = promreg.Register(reg, sc.due)
	}
	return sc, nil
}

// acquired is called when the Service starts acquiring a tenant.
func (sc *Scheduler) acquired() { nudge(sc.wake) }

// acquiring reports whether the Service acquires tenant's work now.
func (sc *Scheduler) acquiring(tenant string) bool {
	sc.s.mu.Lock()
	defer sc.s.mu.Unlock()
	tq := sc.s.tenants[tenant]
	return tq != nil && tq.acquired && !tq.released
}

func (sc *Scheduler) remember(sch Schedule) {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	if m := sc.tenants[sch.Tenant]; m != nil {
		m[sch.ID] = &sch
	}
}

func (sc *Scheduler) forget(tenant, id string) {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	delete(sc.tenants[tenant], id)
}

// run fires due schedules until ctx ends.
func (sc *Scheduler) run(ctx context.Context) {
	timer := time.NewTimer(0)
	defer timer.Stop()
	var synced time.Time
	for {
		select {
		case <-sc.wake:
		case <-timer.C:
		case <-ctx.Done():
			return
		}
		full := time.Since(synced) >= sc.s.cfg.Sweep
		if full {
			synced = time.Now()
		}
		sc.sync(ctx, full)
		failed := sc.fireDue(ctx)
		wait := sc.s.cfg.Sweep - time.Since(synced)
		if next := sc.earliest(); !next.IsZero() {
			wait = min(wait, sc.until(next))
		}
		if failed {
			wait = max(wait, time.Second) // NATS trouble or a full queue: try again shortly
		}
		timer.Reset(max(wait, time.Millisecond))
	}
}

func (sc *Scheduler) until(t time.Time) time.Duration { return t.Sub(sc.now()) }

// sync makes the in-memory set follow the acquired tenants: a tenant newly acquired has its
// schedules loaded; one no longer acquired is dropped. full also loads, for every acquired
// tenant, the schedules made through a sibling, in one key listing of the bucket.
func (sc *Scheduler) sync(ctx context.Context, full bool) {
	owned := sc.s.Owned()
	set := make(map[string]bool, len(owned))
	for _, t := range owned {
		set[t] = true
	}
	sc.mu.Lock()
	var fresh []string
	for t := range sc.tenants {
		if !set[t] {
			delete(sc.tenants, t)
		}
	}
	for _, t := range owned {
		if _, ok := sc.tenants[t]; !ok {
			sc.tenants[t] = map[string]*Schedule{}
			fresh = append(fresh, t)
		}
	}
	sc.mu.Unlock()
	if full {
		sc.reconcileAll(ctx, set)
		return
	}
	for _, t := range fresh {
		lctx, cancel := context.WithTimeout(ctx, 2*sc.s.cfg.OpTimeout)
		ids, err := sc.keys(lctx, t)
		cancel()
		if err != nil {
			sc.s.cfg.Logger.Warn("listing schedules", "tenant", t, "err", err)
			continue
		}
		sc.load(ctx, t, ids)
	}
}

// reconcileAll lists the bucket's keys once and loads or drops schedules of acquired tenants.
func (sc *Scheduler) reconcileAll(ctx context.Context, owned map[string]bool) {
	lctx, cancel := context.WithTimeout(ctx, 4*sc.s.cfg.OpTimeout)
	defer cancel()
	keys, err := sc.s.st.JS().Records(sc.kv).Keys(lctx, ">")
	if err != nil {
		if ctx.Err() == nil {
			sc.s.cfg.Logger.Warn("listing schedules", "err", err)
		}
		return
	}
	byTenant := map[string][]string{}
	for _, k := range keys {
		t, id, _ := strings.Cut(k, ".")
		if owned[t] {
			byTenant[t] = append(byTenant[t], id)
		}
	}
	for t := range owned {
		sc.load(ctx, t, byTenant[t])
	}
}

// load reads the schedules of ids that tenant's in-memory set lacks. It never drops one the
// listing did not show: the listing may predate a create that remembered it meanwhile. A
// schedule deleted through a sibling is dropped when its due time comes (fire reads it).
func (sc *Scheduler) load(ctx context.Context, tenant string, ids []string) {
	sc.mu.Lock()
	m := sc.tenants[tenant]
	if m == nil {
		sc.mu.Unlock()
		return
	}
	var missing []string
	for _, id := range ids {
		if m[id] == nil {
			missing = append(missing, id)
		}
	}
	sc.mu.Unlock()
	for _, id := range missing {
		gctx, cancel := context.WithTimeout(ctx, sc.s.cfg.OpTimeout)
		sch, err := sc.Get(gctx, tenant, id)
		cancel()
		if err != nil {
			if !errors.Is(err, ErrNoSchedule) && ctx.Err() == nil {
				sc.s.cfg.Logger.Warn("reading a schedule", "tenant", tenant, "schedule", id, "err", err)
			}
			continue
		}
		sc.remember(sch)
	}
}

// earliest is the soonest due time held (zero: none).
func (sc *Scheduler) earliest() time.Time {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	var next time.Time
	for _, m := range sc.tenants {
		for _, sch := range m {
			if next.IsZero() || sch.Next.Before(next) {
				next = sch.Next
			}
		}
	}
	return next
}

// fireDue fires every held schedule whose due time has come; it reports whether one failed.
func (sc *Scheduler) fireDue(ctx context.Context) (failed bool) {
	now := sc.now()
	sc.mu.Lock()
	var due []Schedule
	for _, m := range sc.tenants {
		for _, sch := range m {
			if !sch.Next.After(now) {
				due = append(due, *sch)
			}
		}
	}
	sc.mu.Unlock()
	slices.SortFunc(due, func(a, b Schedule) int { return a.Next.Compare(b.Next) })
	for _, sch := range due {
		if err := sc.fire(ctx, sch); err != nil {
			failed = true
			if ctx.Err() == nil {
				sc.s.cfg.Logger.Warn("firing a schedule", "tenant", sch.Tenant, "schedule", sch.ID, "due", sch.Next, "err", err)
			}
		}
	}
	sc.setDue()
	return failed
}

// fire creates the jobs of sch's due times up to now (at most maxCatchUp), each by creating the
// job under the due time's idempotency key and then advancing Next by compare-and-set.
func (sc *Scheduler) fire(ctx context.Context, sch Schedule) error {
	for range maxCatchUp {
		if sch.Next.After(sc.now()) || !sc.acquiring(sch.Tenant) {
			break
		}
		gctx, cancel := context.WithTimeout(ctx, sc.s.cfg.OpTimeout)
		cur, err := sc.latest(gctx, sch.Tenant, sch.ID)
		cancel()
		if errors.Is(err, ErrNoSchedule) {
			sc.forget(sch.Tenant, sch.ID)
			return nil
		}
		if err != nil {
			return err
		}
		sch = cur
		if sch.Next.After(sc.now()) {
			break // a sibling or the former owner fired it
		}
		cs, err := cron.ParseStandard(sch.Cron)
		if err != nil {
			sc.forget(sch.Tenant, sch.ID)
			return fmt.Errorf("schedule %s is corrupt, skipped until it is replaced: %w", sch.ID, err)
		}
		due := sch.Next
		nj := sch.Job
		nj.IdempotencyKey, nj.schedule, nj.due = dueKey(sch.ID, due), sch.ID, due
		if _, created, err := sc.s.Create(ctx, sch.Tenant, nj); err != nil {
			return fmt.Errorf("creating the job due at %s: %w", due.Format(time.RFC3339), err)
		} else if created {
			sc.fired.Inc()
			sc.lag.Observe(sc.now().Sub(due).Seconds())
		}
		sch.Last, sch.Fired, sch.Next = &due, sch.Fired+1, cs.Next(due).UTC()
		b, _ := json.Marshal(sch)
		uctx, cancel := context.WithTimeout(ctx, sc.s.cfg.OpTimeout)
		rev, err := sc.s.st.JS().UpdateKV(uctx, sc.kv.Bucket(), runKey(sch.Tenant, sch.ID), b, sch.rev, 0)
		cancel()
		if schema.IsConflict(err) {
			continue // advanced meanwhile (or our write's answer was lost): read it again
		}
		if err != nil {
			return fmt.Errorf("advancing past %s: %w", due.Format(time.RFC3339), err)
		}
		sch.rev = rev
	}
	sc.remember(sch)
	return nil
}

// dueCounts is, per acquired tenant, how many schedules are due and not fired yet.
func (sc *Scheduler) dueCounts() map[string]int {
	now := sc.now()
	sc.mu.Lock()
	defer sc.mu.Unlock()
	out := map[string]int{}
	for t, m := range sc.tenants {
		for _, sch := range m {
			if !sch.Next.After(now) {
				out[t]++
			}
		}
	}
	return out
}

// setDue publishes the due counts with bounded labels: the dueTopN tenants with most, the
// rest summed as "other".
func (sc *Scheduler) setDue() {
	counts := sc.dueCounts()
	type td struct {
		t string
		n int
	}
	all := make([]td, 0, len(counts))
	for t, n := range counts {
		all = append(all, td{t, n})
	}
	slices.SortFunc(all, func(a, b td) int {
		if c := cmp.Compare(b.n, a.n); c != 0 {
			return c
		}
		return strings.Compare(a.t, b.t)
	})
	sc.due.Reset()
	other := 0
	for i, x := range all {
		if i < dueTopN {
			sc.due.WithLabelValues(x.t).Set(float64(x.n))
		} else {
			other += x.n
		}
	}
	sc.due.WithLabelValues("other").Set(float64(other))
}
