package shardkit

import (
	"context"
	"slices"
	"syscall"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// heartbeatLoop refreshes the directory entry and publishes load telemetry every Heartbeat,
// recomputes the labelled top N every TopNEvery, and forgets idle tenants it no longer serves.
func (s *Shard) heartbeatLoop(ctx context.Context) {
	defer close(s.hbStopped)
	t := time.NewTicker(s.cfg.Heartbeat)
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
		states := s.states.all()
		report := tel.sample(s, states)
		report.Consumers = s.consumers.report()
		if s.cfg.Hooks.Report != nil {
			s.cfg.Hooks.Report(&report)
		}
		if time.Since(lastTop) >= s.cfg.TopNEvery {
			s.metrics.setTop(states, s.cfg.TopN)
			lastTop = time.Now()
		}
		s.heartbeat(ctx, report)
		if tick++; tick%routeEvery == 0 || s.routesStale.Swap(false) {
			s.republish(ctx)
		}
		if err := s.st.PublishLoad(report); err != nil {
			s.cfg.Logger.Debug("publishing load", "err", err)
		}
		s.forgetIdle(states)
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
func (s *Shard) republish(ctx context.Context) {
	for _, r := range s.routes() {
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, err := s.st.Routes().AddInstance(rctx, r, s.cfg.ID)
		cancel()
		if err != nil && ctx.Err() == nil {
			s.cfg.Logger.Warn("re-publishing route", "method", r.Method, "prefix", r.Prefix, "err", err)
		}
	}
}

// heartbeat writes the directory entry with the latest figures.
func (s *Shard) heartbeat(ctx context.Context, r schema.LoadReport) {
	s.instMu.Lock()
	inst := s.inst
	inst.Metrics = &schema.InstanceMetrics{InFlight: r.InFlight, RatePerSec: r.RatePerSec, LatencyMS: r.LatencyMS,
		CPU: r.CPU, Tenants: r.Tenants, ErrorRate: r.ErrorRate}
	s.instMu.Unlock()
	inst.Reported = s.reportedStatus(r)
	hctx, cancel := context.WithTimeout(ctx, s.cfg.Heartbeat*3)
	defer cancel()
	got, err := s.st.Directory().Heartbeat(hctx, inst)
	if err != nil {
		if ctx.Err() == nil {
			s.cfg.Logger.Warn("heartbeat failed", "instance", s.self, "err", err)
		}
		return
	}
	s.instMu.Lock()
	s.inst = got
	s.instMu.Unlock()
	s.syncMember(hctx, got)
}

// syncMember writes the instance's membership entry when what it holds changed since the last
// write (status, URL, capacity, labels, version), or when the sweeper marked it offline or
// removed it; a heartbeat that changes none of it writes nothing there.
func (s *Shard) syncMember(ctx context.Context, inst schema.Instance) {
	s.memberMu.Lock()
	defer s.memberMu.Unlock()
	stale := s.memberStale.Swap(false)
	if !stale && s.member.SameMember(inst) {
		return
	}
	if _, err := s.st.Directory().PutMember(ctx, inst); err != nil {
		s.memberStale.Store(true)
		if ctx.Err() == nil {
			s.cfg.Logger.Warn("writing membership failed", "instance", s.self, "err", err)
		}
		return
	}
	s.member = inst
}

// reportedStatus is what the instance says of itself: draining once it stops taking traffic,
// degraded while its error rate is at least the kind's DegradedErrorRate, else online.
func (s *Shard) reportedStatus(r schema.LoadReport) schema.Status {
	if !s.ready.Load() {
		return schema.StatusDraining
	}
	kc := s.kindCfg.Load()
	requests := r.RatePerSec * s.cfg.Heartbeat.Seconds()
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
		Capacity:   s.capacity(),
		Tenants:    s.watcher.ShardCounts(s.kind)[s.cfg.ID.Shard],
		Top:        top,
	}
	if dreq > 0 {
		r.ErrorRate = float64(derr) / float64(dreq)
	}
	s.topSizes(&r)
	t.at, t.requests, t.errors, t.latency, t.cpu = now, reqs, errs, lat, cpu
	return r
}

func (s *Shard) capacity() int {
	s.instMu.Lock()
	defer s.instMu.Unlock()
	return s.inst.Capacity
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
