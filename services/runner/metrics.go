package runner

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/promreg"
)

// metrics have bounded labels: status, effect provider and outcome. Per-tenant figures are in
// shardkit's top-N and in the run records, not here.
type metrics struct {
	created    prometheus.Counter
	rejected   prometheus.Counter
	finished   *prometheus.CounterVec
	effects    *prometheus.CounterVec
	runSeconds prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer, s *Service) *metrics {
	m := &metrics{
		created: prometheus.NewCounter(prometheus.CounterOpts{Name: "tm_runner_jobs_created_total",
			Help: "Jobs enqueued."}),
		rejected: prometheus.NewCounter(prometheus.CounterOpts{Name: "tm_runner_jobs_rejected_total",
			Help: "Job creates refused because the tenant's queue was at its cap (429)."}),
		finished: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "tm_runner_attempts_finished_total",
			Help: "Job attempts finished, by outcome (succeeded, failed, pending = will retry)."}, []string{"status"}),
		effects: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "tm_runner_effects_total",
			Help: "Effect deliveries by provider and outcome (delivered, deduped, failed)."}, []string{"effect", "outcome"}),
		runSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "tm_runner_attempt_seconds",
			Help: "Duration of job attempts, effects included.", Buckets: prometheus.ExponentialBuckets(0.001, 4, 10)}),
	}
	if reg == nil {
		return m
	}
	running := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "tm_runner_running",
		Help: "Jobs running on this instance now."}, func() float64 { return float64(s.Status().Running) })
	tenants := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "tm_runner_tenants",
		Help: "Tenants this instance acquires jobs for."}, func() float64 { return float64(s.Status().Tenants) })
	m.created = promreg.Register(reg, m.created)
	m.rejected = promreg.Register(reg, m.rejected)
	m.finished = promreg.Register(reg, m.finished)
	m.effects = promreg.Register(reg, m.effects)
	m.runSeconds = promreg.Register(reg, m.runSeconds)
	promreg.Register(reg, running)
	promreg.Register(reg, tenants)
	return m
}
