package autopilot

import (
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/promreg"
)

// metrics are the autopilot's tm_autopilot_* series. Labels are bounded: detectors, outcomes
// and guardrails are fixed sets, kinds are few.
type metrics struct {
	decisions *prometheus.CounterVec
	blocked   *prometheus.CounterVec
	failovers *prometheus.CounterVec
	recovery  *prometheus.HistogramVec
	imbalance *prometheus.GaugeVec

	usedMoves atomic.Int64
	usedBytes atomic.Uint64
}

func newMetrics(reg prometheus.Registerer, a *Autopilot) *metrics {
	m := &metrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "tm_autopilot_decisions_total",
			Help: "The autopilot's decisions by detector (failover, retake, evacuate, fill, balance) and outcome (applied, proposed, blocked, done, partial, failed, yielded, resumed)."},
			[]string{"detector", "outcome"}),
		blocked: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "tm_autopilot_blocked_total",
			Help: "Plans a detector wanted that a guardrail stopped, by detector and guardrail (operator first, freeze, maintenance window, move budget, byte budget, no plan, no room)."},
			[]string{"detector", "guardrail"}),
		failovers: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "tm_autopilot_failovers_total",
			Help: "Failover plans that ended (a shard with no live instance had its tenants taken over), by kind."}, []string{"kind"}),
		recovery: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "tm_autopilot_recovery_seconds",
			Help:    "From a shard's last live instance dying (as presence saw it) to the last of its tenants committed elsewhere.",
			Buckets: []float64{0.5, 1, 2, 3, 5, 8, 13, 21, 34, 60, 120}}, []string{"detector"}),
		imbalance: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "tm_autopilot_imbalance",
			Help: "Each kind's max/mean utilisation as the balance detector last measured it."}, []string{"kind"}),
	}
	if reg == nil {
		return m
	}
	m.decisions = promreg.Register(reg, m.decisions)
	m.blocked = promreg.Register(reg, m.blocked)
	m.failovers = promreg.Register(reg, m.failovers)
	m.recovery = promreg.Register(reg, m.recovery)
	m.imbalance = promreg.Register(reg, m.imbalance)
	for _, mode := range []Mode{Off, DryRun, On} {
		promreg.Register(reg, prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "tm_autopilot_mode",
			Help: "1 for the autopilot's mode (off, dry-run, on).", ConstLabels: prometheus.Labels{"mode": string(mode)}},
			func() float64 {
				if a.cfg.Mode == mode {
					return 1
				}
				return 0
			}))
	}
	promreg.Register(reg, prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "tm_autopilot_moves_in_window",
		Help: "Moves the autopilot made within its budget window (as of its last look)."}, func() float64 { return float64(m.usedMoves.Load()) }))
	promreg.Register(reg, prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "tm_autopilot_bytes_in_window",
		Help: "Bytes the autopilot's moves carried within its budget window (as of its last look)."}, func() float64 { return float64(m.usedBytes.Load()) }))
	promreg.Register(reg, prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "tm_autopilot_budget_moves",
		Help: "The autopilot's move budget per window."}, func() float64 { return float64(a.cfg.MaxMoves) }))
	promreg.Register(reg, &downCollector{a: a,
		down: prometheus.NewDesc("tm_autopilot_tenants_without_live_shard",
			"Tenants placed on a shard that has no live instance, by kind (the leader's last look; 0 elsewhere).", []string{"kind"}, nil),
		stuck: prometheus.NewDesc("tm_autopilot_tenants_held_in_takeover",
			"Tenants held in a takeover that no move drives any more, whose source has a live instance, by kind (the leader's last look; 0 elsewhere): the retake detector takes them over again.", []string{"kind"}, nil)})
	return m
}

func (m *metrics) used(moves int, bytes uint64) {
	m.usedMoves.Store(int64(moves))
	m.usedBytes.Store(bytes)
}

// downCollector reports, per kind, the tenants on dead shards and those held in a takeover
// no move drives.
type downCollector struct {
	a           *Autopilot
	down, stuck *prometheus.Desc
}

func (c *downCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.down; ch <- c.stuck }

func (c *downCollector) Collect(ch chan<- prometheus.Metric) {
	c.a.mu.Lock()
	defer c.a.mu.Unlock()
	for kind, n := range c.a.down {
		ch <- prometheus.MustNewConstMetric(c.down, prometheus.GaugeValue, float64(n), kind)
	}
	for kind, n := range c.a.stuck {
		ch <- prometheus.MustNewConstMetric(c.stuck, prometheus.GaugeValue, float64(n), kind)
	}
}
