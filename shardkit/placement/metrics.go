package placement

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	corrupt *prometheus.CounterVec
}

func newMetrics(w *Watcher, reg prometheus.Registerer) *metrics {
	m := &metrics{
		corrupt: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tm_placement_corrupt_total",
			Help: "Placement values skipped because they could not be decoded.",
		}, []string{"kind"}),
	}
	if reg == nil {
		return m
	}
	if are, ok := register(reg, m.corrupt).(*prometheus.CounterVec); ok {
		m.corrupt = are // another watcher in this process registered it first
	}
	for kind := range w.kinds {
		labels := prometheus.Labels{"kind": kind}
		register(reg, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "tm_placement_staleness_seconds", ConstLabels: labels,
			Help: "How long the placement watcher of the kind has been cut off from NATS (0 while following).",
		}, func() float64 { return w.Staleness().Seconds() }))
		register(reg, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "tm_placement_entries", Help: "Placements held in memory.", ConstLabels: labels,
		}, func() float64 { st, _ := w.Stats(kind); return float64(st.Placements) }))
		register(reg, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "tm_placement_revision", Help: "Last placement revision applied.", ConstLabels: labels,
		}, func() float64 { return float64(w.Revision(kind)) }))
		register(reg, prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "tm_placement_watch_resumes_total", Help: "Placement watches replaced after a failure.", ConstLabels: labels,
		}, func() float64 { st, _ := w.Stats(kind); return float64(st.Resumes) }))
	}
	return m
}

// register tolerates a collector that is already registered (several watchers in one
// process) and returns the registered one.
func register(reg prometheus.Registerer, c prometheus.Collector) prometheus.Collector {
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if !errors.As(err, &are) {
			panic(err)
		}
		return are.ExistingCollector
	}
	return c
}
