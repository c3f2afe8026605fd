package events

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/promreg"
)

type metrics struct {
	conflicts     prometheus.Counter
	appendRetries prometheus.Counter
	rehydrate     *prometheus.HistogramVec
	snapshotHits  *prometheus.CounterVec
	snapshotBytes prometheus.Gauge
}

// newMetrics makes the Log's metrics, named tm_<kind>_*.
func newMetrics(reg prometheus.Registerer, kind string) *metrics {
	p := "tm_" + kind + "_"
	m := &metrics{
		conflicts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: p + "append_conflicts_total", Help: "Appends rejected because another writer appended first.",
		}),
		appendRetries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: p + "append_retries_total", Help: "Append tries made again because NATS was unavailable (a leader election, a reconnect).",
		}),
		rehydrate: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: p + "rehydrate_seconds", Help: "Time to load a tenant's state, by strategy.",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 10),
		}, []string{"strategy"}),
		snapshotHits: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: p + "snapshot_loads_total", Help: "Tenant loads that found a snapshot (hit) or not (miss).",
		}, []string{"result"}),
		snapshotBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: p + "last_snapshot_bytes", Help: "Size of the last snapshot written.",
		}),
	}
	if reg != nil {
		m.conflicts = promreg.Register(reg, m.conflicts)
		m.appendRetries = promreg.Register(reg, m.appendRetries)
		m.rehydrate = promreg.Register(reg, m.rehydrate)
		m.snapshotHits = promreg.Register(reg, m.snapshotHits)
		m.snapshotBytes = promreg.Register(reg, m.snapshotBytes)
	}
	return m
}

func (m *metrics) observeLoad(r LoadReport) {
	m.rehydrate.WithLabelValues(string(r.Strategy)).Observe(r.Took.Seconds())
	if r.Strategy == StrategySnapshot {
		res := "miss"
		if r.SnapshotHit {
			res = "hit"
		}
		m.snapshotHits.WithLabelValues(res).Inc()
	}
}
