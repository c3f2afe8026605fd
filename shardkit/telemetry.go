package shardkit

import (
	"context"
	"math/rand/v2"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// reporter keeps the instance known: a load report every interval (the heartbeat gateways and
// the rebalancer hear), the directory entry when it changes or every DirectoryRefresh, the
// membership entry when what others follow changes, and the tenants' sizes.
type reporter struct {
	s *Shard
	// What was last written to the directory, and when the heartbeat loop writes again if
	// nothing changes (a registration writes too: Reload).
	mu        sync.Mutex
	written   schema.Instance
	nextWrite time.Time
}

// wrote notes a directory write. The next refresh is due DirectoryRefresh later less up to a
// fifth of it at random, so a fleet started together does not refresh in step.
func (rp *reporter) wrote(inst schema.Instance) {
	d := rp.s.cfg.DirectoryRefresh
	rp.mu.Lock()
	rp.written, rp.nextWrite = inst, rp.s.cfg.Now().Add(d-rand.N(d/5+1))
	rp.mu.Unlock()
}

// registered notes the registration's write: the first heartbeat writes the entry again, with
// the instance's first metrics (the directory's "last metrics" of a host), and from then on
// every DirectoryRefresh.
func (rp *reporter) registered(inst schema.Instance) {
	rp.mu.Lock()
	rp.written, rp.nextWrite = inst, time.Time{}
	rp.mu.Unlock()
}

// due reports whether the heartbeat loop writes inst to the directory now.
func (rp *reporter) due(inst schema.Instance) bool {
	rp.mu.Lock()
	defer rp.mu.Unlock()
	return inst.Reported != rp.written.Reported || inst.RefreshMS != rp.written.RefreshMS ||
		rp.s.memberStale.Load() || !rp.s.cfg.Now().Before(rp.nextWrite)
}

// heartbeatLoop publishes load telemetry every Heartbeat and writes the directory entry when it
// is due, recomputes the labelled top N every TopNEvery, and forgets idle tenants it no longer
// serves.
func (rp *reporter) heartbeatLoop(ctx context.Context) {
	defer close(rp.s.hbStopped)
	t := time.NewTicker(rp.s.cfg.Heartbeat)
	defer t.Stop()
	lastTop := time.Now()
	tel := newTelemetry()
	tick := 0
	for {
		select {
		case <-t.C:
		case <-ctx.Done():
			return
		}
		states := rp.s.states.all()
		report := tel.sample(rp.s, states)
		report.Consumers = rp.s.consumers.report()
		if rp.s.cfg.Hooks.Report != nil {
			rp.s.cfg.Hooks.Report(&report)
		}
		if time.Since(lastTop) >= rp.s.cfg.TopNEvery {
			rp.s.metrics.setTop(states, rp.s.cfg.TopN)
			lastTop = time.Now()
		}
		rp.heartbeat(ctx, report)
		if tick++; tick%routeEvery == 0 || rp.s.routesStale.Swap(false) {
			rp.republish(ctx)
		}
		if err := rp.s.st.PublishLoad(report); err != nil {
			rp.s.cfg.Logger.Debug("publishing load", "err", err)
		}
		rp.s.forgetIdle(states)
	}
}

// routeEvery is how many heartbeats pass between re-assertions of the instance's routes. Each
// is a read of every route through the JetStream API: at 10 (the old value) a thousand
// instances made 100 API requests a second, enough to starve consumer creation on a busy
// cluster. The sweeper removes an instance from routes when it marks it offline, which the
// instance sees in its membership and answers at once (routesStale); the slow round covers
// the rest (a route cleanup at a rebalancer's start).
const routeEvery = 60

// republish re-adds the instance to its routes, in case a sweeper removed it while it was
// cut off (Aether routing's stale-route cleanup must not unpublish a live instance for good).
func (rp *reporter) republish(ctx context.Context) {
	for _, r := range rp.s.routes() {
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, err := rp.s.st.Routes().AddInstance(rctx, r, rp.s.cfg.ID)
		cancel()
		if err != nil && ctx.Err() == nil {
			rp.s.cfg.Logger.Warn("re-publishing route", "method", r.Method, "prefix", r.Prefix, "err", err)
		}
	}
}

// heartbeat writes the directory entry when it is due: when what it says changed (the
// reported status; the sweeper marked the instance offline or removed it) or DirectoryRefresh
// has passed. In between, the load report published beside it is the instance's heartbeat for
// those that follow it; a replicated write per instance per second is what stopped a fleet of
// 1,000 instances from coming up (docs/scale.md).
func (rp *reporter) heartbeat(ctx context.Context, r schema.LoadReport) {
	rp.s.instMu.Lock()
	inst := rp.s.inst
	inst.Metrics = &schema.InstanceMetrics{InFlight: r.InFlight, RatePerSec: r.RatePerSec, LatencyMS: r.LatencyMS,
		CPU: r.CPU, Tenants: r.Tenants, ErrorRate: r.ErrorRate,
		MemBytes: r.MemBytes, MemPercent: r.MemPercent, DiskPercent: r.DiskPercent, DiskFreeBytes: r.DiskFreeBytes}
	rp.s.instMu.Unlock()
	inst.Reported = rp.reportedStatus(r)
	inst.RefreshMS = rp.s.cfg.DirectoryRefresh.Milliseconds()
	if !rp.due(inst) {
		return
	}
	hctx, cancel := context.WithTimeout(ctx, rp.s.cfg.Heartbeat*3)
	defer cancel()
	got, err := rp.s.st.Directory().Heartbeat(hctx, inst)
	if err != nil {
		if ctx.Err() == nil {
			rp.s.cfg.Logger.Warn("heartbeat failed", "instance", rp.s.self, "err", err)
		}
		return
	}
	rp.wrote(got)
	rp.s.instMu.Lock()
	rp.s.inst = got
	rp.s.instMu.Unlock()
	rp.syncMember(hctx, got)
}

// syncMember writes the instance's membership entry when what it holds changed since the last
// write (status, URL, capacity, labels, version), or when the sweeper marked it offline or
// removed it; a heartbeat that changes none of it writes nothing there.
func (rp *reporter) syncMember(ctx context.Context, inst schema.Instance) {
	rp.s.memberMu.Lock()
	defer rp.s.memberMu.Unlock()
	stale := rp.s.memberStale.Swap(false)
	if !stale && rp.s.member.SameMember(inst) {
		return
	}
	if _, err := rp.s.st.Directory().PutMember(ctx, inst); err != nil {
		rp.s.memberStale.Store(true)
		if ctx.Err() == nil {
			rp.s.cfg.Logger.Warn("writing membership failed", "instance", rp.s.self, "err", err)
		}
		return
	}
	rp.s.member = inst
}

// reportedStatus is what the instance says of itself: draining once it stops taking traffic,
// degraded while its error rate is at least the kind's DegradedErrorRate, else online.
func (rp *reporter) reportedStatus(r schema.LoadReport) schema.Status {
	if !rp.s.ready.Load() {
		return schema.StatusDraining
	}
	kc := rp.s.kindCfg.Load()
	requests := r.RatePerSec * rp.s.cfg.Heartbeat.Seconds()
	if kc != nil && kc.DegradedErrorRate > 0 && requests+0.5 >= schema.DegradedMinRequests && r.ErrorRate >= kc.DegradedErrorRate {
		return schema.StatusDegraded
	}
	return schema.StatusOnline
}

// forgetIdle drops the state of tenants that are idle, not draining or moving, and no longer
// served here.
func (s *Shard) forgetIdle(states []*tenantState) {
	for _, ts := range states {
		if ts.inflight.Load() != 0 || ts.draining.Load() {
			continue
		}
		e, ok := s.watcher.Lookup(s.kind, ts.tenant)
		if ok && (s.gk.owns(e) || e.Target == s.cfg.ID.Shard || e.Source == s.cfg.ID.Shard) {
			continue
		}
		s.states.removeIf(ts.tenant, func(ts *tenantState) bool {
			ts.mu.Lock()
			defer ts.mu.Unlock()
			return ts.phase == "" && ts.task == nil && ts.inflight.Load() == 0 && !ts.draining.Load()
		})
	}
}

// telemetry turns counters into per-interval figures.
type telemetry struct {
	at       time.Time
	requests uint64
	errors   uint64
	latency  uint64 // nanoseconds
	cpu      time.Duration
}

func newTelemetry() *telemetry { return &telemetry{at: time.Now(), cpu: cpuTime()} }

// sample computes the load report for the interval since the last sample.
func (t *telemetry) sample(s *Shard, states []*tenantState) schema.LoadReport {
	now := time.Now()
	dt := now.Sub(t.at).Seconds()
	if dt <= 0 {
		dt = 1
	}
	var reqs, errs, lat uint64
	top := make([]schema.TenantLoad, 0, len(states))
	for _, ts := range states {
		r, e := ts.requests.Load(), ts.errors.Load()
		dr, de := r-ts.lastRequests, e-ts.lastErrors
		ts.lastRequests, ts.lastErrors = r, e
		ts.rate = float64(dr) / dt
		reqs += r
		errs += e
		lat += ts.latency.Load()
		if dr > 0 || ts.inflight.Load() > 0 {
			top = append(top, schema.TenantLoad{Tenant: ts.tenant, RatePerSec: ts.rate, InFlight: int(ts.inflight.Load()), Errors: de})
		}
	}
	slices.SortFunc(top, func(a, b schema.TenantLoad) int {
		switch {
		case a.RatePerSec > b.RatePerSec:
			return -1
		case a.RatePerSec < b.RatePerSec:
			return 1
		}
		return 0
	})
	if len(top) > s.cfg.TopN {
		top = top[:s.cfg.TopN]
	}
	dreq, derr, dlat := reqs-t.requests, errs-t.errors, lat-t.latency
	if reqs < t.requests || errs < t.errors || lat < t.latency { // a tenant state was forgotten
		dreq, derr, dlat = 0, 0, 0
	}
	cpu := cpuTime()
	r := schema.LoadReport{
		InstanceID: s.cfg.ID,
		Time:       now.UTC(),
		InFlight:   int(s.inflight.Load()),
		RatePerSec: float64(dreq) / dt,
		LatencyMS:  meanMS(dlat, dreq),
		CPU:        100 * (cpu - t.cpu).Seconds() / dt,
		Capacity:   s.rep.capacity(),
		Tenants:    s.watcher.ShardCounts(s.kind)[s.cfg.ID.Shard],
		Top:        top,
	}
	if dreq > 0 {
		r.ErrorRate = float64(derr) / float64(dreq)
	}
	h := readHostStats(s.cfg.DiskPath)
	r.MemBytes, r.MemPercent, r.DiskPercent, r.DiskFreeBytes = h.MemBytes, h.MemPercent, h.DiskPercent, h.DiskFreeBytes
	s.rep.topSizes(&r)
	t.at, t.requests, t.errors, t.latency, t.cpu = now, reqs, errs, lat, cpu
	return r
}

func (rp *reporter) capacity() int {
	rp.s.instMu.Lock()
	defer rp.s.instMu.Unlock()
	return rp.s.inst.Capacity
}

func meanMS(nanos, n uint64) float64 {
	if n == 0 {
		return 0
	}
	return float64(nanos) / float64(n) / 1e6
}

// cpuTime is the process's user and system CPU time.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
