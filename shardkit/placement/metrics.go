package placement

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/promreg"
)

type metrics struct {
	corrupt         *prometheus.CounterVec
	confirmFailures *prometheus.CounterVec
	delay           *prometheus.HistogramVec
}

func newMetrics(w *Watcher, reg prometheus.Registerer) *metrics {
	m := &metrics{
		corrupt: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tm_placement_corrupt_total",
			Help: "Placement values skipped because they could not be decoded.",
		}, []string{"kind"}),
		confirmFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tm_placement_confirm_failures_total",
			Help: "Confirmations of the placement view with its stream leader that failed (a shard whose view stays unconfirmed for its lease stops serving).",
		}, []string{"kind"}),
		delay: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "tm_placement_change_delay_seconds",
			Help:    "From a placement change's write (the NATS server's stamp) to this process applying it, by the phase it put the tenant in (a gateway holds a moving tenant's requests from its handoff and releases them at its draining).",
			Buckets: []float64{.00025, .0005, .001, .002, .004, .008, .016, .032, .064, .128, .256, .512, 1.024},
		}, []string{"kind", "phase"}),
	}
	if reg == nil {
		return m
	}
	m.corrupt = promreg.Register(reg, m.corrupt) // another watcher in this process may have registered it first
	m.delay = promreg.Register(reg, m.delay)
	if w.cfg.Confirm > 0 {
		m.confirmFailures = promreg.Register(reg, m.confirmFailures)
	}
	for kind := range w.kinds {
		labels := prometheus.Labels{"kind": kind}
		promreg.Register(reg, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "tm_placement_staleness_seconds", ConstLabels: labels,
			Help: "How long the placement watcher of the kind has been cut off from NATS (0 while following).",
		}, func() float64 { return w.Staleness().Seconds() }))
		promreg.Register(reg, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "tm_placement_entries", Help: "Placements held in memory.", ConstLabels: labels,
		}, func() float64 { st, _ := w.Stats(kind); return float64(st.Placements) }))
		promreg.Register(reg, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "tm_placement_revision", Help: "Last placement revision applied.", ConstLabels: labels,
		}, func() float64 { return float64(w.Revision(kind)) }))
		promreg.Register(reg, prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "tm_placement_watch_resumes_total", Help: "Placement watches replaced after a failure.", ConstLabels: labels,
		}, func() float64 { st, _ := w.Stats(kind); return float64(st.Resumes) }))
		if w.cfg.Confirm > 0 {
			promreg.Register(reg, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "tm_placement_confirmed_age_seconds", ConstLabels: labels,
				Help: "How long ago the placement view was last confirmed with its stream leader (a shard serves while it is under its lease); -1 before the first.",
			}, func() float64 {
				if d, ok := w.Confirmed(kind); ok {
					return d.Seconds()
				}
				return -1
			}))
		}
	}
	return m
}
