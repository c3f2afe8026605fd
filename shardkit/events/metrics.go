package events

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/promreg"
)

// Metrics are a Log's collectors. Without Config.Metrics, the Log makes them with NewMetrics; a
// service that names its metrics in its own code (so dashboards can be checked against it)
// passes its own.
type Metrics struct {
	// Conflicts counts appends lost to another writer; AppendRetries append tries made again
	// because NATS was unavailable.
	Conflicts, AppendRetries prometheus.Counter
	// Rehydrate observes the seconds a tenant's load took, by label strategy.
	Rehydrate *prometheus.HistogramVec
	// SnapshotLoads counts loads that found a snapshot or not, by label result (hit, miss).
	SnapshotLoads *prometheus.CounterVec
	// SnapshotBytes is the size of the last snapshot written.
	SnapshotBytes prometheus.Gauge
}

// NewMetrics makes a Log's metrics named tm_<kind>_append_conflicts_total,
// _append_retries_total, _rehydrate_seconds, _snapshot_loads_total and _last_snapshot_bytes,
// and registers them on reg (nil: nowhere).
func NewMetrics(reg prometheus.Registerer, kind string) *Metrics {
	p := "tm_" + kind + "_"
	m := &Metrics{
		Conflicts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: p + "append_conflicts_total", Help: "Appends rejected because another writer appended first.",
		}),
		AppendRetries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: p + "append_retries_total", Help: "Append tries made again because NATS was unavailable (a leader election, a reconnect).",
		}),
		Rehydrate: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: p + "rehydrate_seconds", Help: "Time to load a tenant's state, by strategy.",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 10),
		}, []string{"strategy"}),
		SnapshotLoads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: p + "snapshot_loads_total", Help: "Tenant loads that found a snapshot (hit) or not (miss).",
		}, []string{"result"}),
		SnapshotBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: p + "last_snapshot_bytes", Help: "Size of the last snapshot written.",
		}),
	}
	return m.Register(reg)
}

// Register registers m's collectors on reg (nil: none), keeping the ones already there (a
// second Log on one registry counts into the same series), and returns m.
func (m *Metrics) Register(reg prometheus.Registerer) *Metrics {
	if reg != nil {
		m.Conflicts = promreg.Register(reg, m.Conflicts)
		m.AppendRetries = promreg.Register(reg, m.AppendRetries)
		m.Rehydrate = promreg.Register(reg, m.Rehydrate)
		m.SnapshotLoads = promreg.Register(reg, m.SnapshotLoads)
		m.SnapshotBytes = promreg.Register(reg, m.SnapshotBytes)
	}
	return m
}

func (m *Metrics) observeLoad(r LoadReport) {
	m.Rehydrate.WithLabelValues(string(r.Strategy)).Observe(r.Took.Seconds())
	if r.Strategy == StrategySnapshot {
		res := "miss"
		if r.SnapshotHit {
			res = "hit"
		}
		m.SnapshotLoads.WithLabelValues(res).Inc()
	}
}
