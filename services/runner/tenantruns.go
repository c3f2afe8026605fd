package runner

import (
	"cmp"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/promreg"
)

// The Cloudlysis PRD's Runner 4, "work processing latency and retries by tenant", and shardkit's
// Lag hook: per tenant, this instance's attempts, retries and failures and the latency of its
// recent attempts, in /admin/runner/tenant; and the same as metrics whose tenant label is one
// of the tenantTopN tenants with the most attempts (recomputed every tenantTopEvery), the rest
// summed as "other", so the labels stay bounded.

const (
	tenantTopN     = 10
	tenantTopEvery = 15 * time.Second
	// latencyWindow is how many recent attempts a tenant's latency figures cover.
	latencyWindow = 128
)

// tenantRuns is one tenant's attempts on this instance.
type tenantRuns struct {
	attempts, retries, failed uint64
	recent                    []time.Duration // ring of the last latencyWindow attempt durations
	next                      int
}

// RunFigures are a tenant's attempts on this instance since it started: how many, how many
// ended in a retry or failed for good, and the latency of the recent ones.
type RunFigures struct {
	Attempts     uint64  `json:"attempts"`
	Retries      uint64  `json:"retries"`
	Failed       uint64  `json:"failed"`
	LatencyP50MS float64 `json:"latency_p50_ms"`
	LatencyP99MS float64 `json:"latency_p99_ms"`
}

// runStats keeps every tenant's tenantRuns and the bounded metrics.
type runStats struct {
	mu      sync.Mutex
	by      map[string]*tenantRuns
	top     map[string]bool
	topAt   time.Time
	seconds *prometheus.HistogramVec
	retries *prometheus.CounterVec
}

func newRunStats(reg prometheus.Registerer) *runStats {
	r := &runStats{by: map[string]*tenantRuns{}, top: map[string]bool{},
		seconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "tm_runner_tenant_attempt_seconds",
			Help:    "Duration of job attempts, effects included, by tenant (the 10 with the most attempts, the rest as other).",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 10)}, []string{"tenant"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "tm_runner_tenant_retries_total",
			Help: "Job attempts that failed and will be tried again, by tenant (the 10 with the most attempts, the rest as other)."}, []string{"tenant"}),
	}
	r.seconds = promreg.Register(reg, r.seconds)
	r.retries = promreg.Register(reg, r.retries)
	return r
}

// note records one finished attempt of tenant.
func (r *runStats) note(tenant string, took time.Duration, status Status) {
	r.mu.Lock()
	defer r.mu.Unlock()
	tr := r.by[tenant]
	if tr == nil {
		tr = &tenantRuns{}
		r.by[tenant] = tr
	}
	tr.attempts++
	switch status {
	case StatusPending:
		tr.retries++
	case StatusFailed:
		tr.failed++
	}
	if len(tr.recent) < latencyWindow {
		tr.recent = append(tr.recent, took)
	} else {
		tr.recent[tr.next] = took
		tr.next = (tr.next + 1) % latencyWindow
	}
	if time.Since(r.topAt) > tenantTopEvery {
		r.retop()
	}
	label := "other"
	if r.top[tenant] {
		label = tenant
	}
	r.seconds.WithLabelValues(label).Observe(took.Seconds())
	if status == StatusPending {
		r.retries.WithLabelValues(label).Inc()
	}
}

// retop recomputes the labelled tenants. Caller holds mu.
func (r *runStats) retop() {
	names := make([]string, 0, len(r.by))
	for t := range r.by {
		names = append(names, t)
	}
	slices.SortFunc(names, func(a, b string) int {
		if c := cmp.Compare(r.by[b].attempts, r.by[a].attempts); c != 0 {
			return c
		}
		return cmp.Compare(a, b)
	})
	clear(r.top)
	for _, t := range names[:min(len(names), tenantTopN)] {
		r.top[t] = true
	}
	r.topAt = time.Now()
}

// figures are tenant's RunFigures.
func (r *runStats) figures(tenant string) RunFigures {
	r.mu.Lock()
	defer r.mu.Unlock()
	tr := r.by[tenant]
	if tr == nil {
		return RunFigures{}
	}
	f := RunFigures{Attempts: tr.attempts, Retries: tr.retries, Failed: tr.failed}
	if n := len(tr.recent); n > 0 {
		d := slices.Clone(tr.recent)
		slices.Sort(d)
		ms := func(q float64) float64 { return float64(d[int(q*float64(n-1))]) / float64(time.Millisecond) }
		f.LatencyP50MS, f.LatencyP99MS = ms(0.5), ms(0.99)
	}
	return f
}

// Lag is the tenant's work waiting here: its unfinished jobs as of the last count (SizeEvery),
// no NATS round trip. shardkit's Lag hook (the tenant's entries not yet applied: for the
// runner, jobs not yet run).
func (s *Service) Lag(tenant string) uint64 {
	s.sizes.mu.Lock()
	defer s.sizes.mu.Unlock()
	return uint64(s.sizes.by[tenant].Queued)
}
