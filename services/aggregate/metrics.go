package aggregate

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/promreg"
)

type metrics struct {
	commands      *prometheus.CounterVec
	conflicts     prometheus.Counter
	appendRetries prometheus.Counter
	rehydrate     *prometheus.HistogramVec
	snapshotHits  *prometheus.CounterVec
	snapshotBytes prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer, es *eventStore) *metrics {
	m := &metrics{
		commands: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tm_aggregate_commands_total", Help: "Commands by name and outcome (applied, replayed, rejected, error).",
		}, []string{"command", "result"}),
		conflicts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tm_aggregate_append_conflicts_total", Help: "Appends rejected because another writer appended first.",
		}),
		appendRetries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tm_aggregate_append_retries_total", Help: "Append tries made again because NATS was unavailable (a leader election, a reconnect).",
		}),
		rehydrate: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "tm_aggregate_rehydrate_seconds", Help: "Time to load a tenant's state, by strategy.",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 10),
		}, []string{"strategy"}),
		snapshotHits: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tm_aggregate_snapshot_loads_total", Help: "Tenant loads that found a snapshot (hit) or not (miss).",
		}, []string{"result"}),
		snapshotBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tm_aggregate_last_snapshot_bytes", Help: "Size of the last snapshot written.",
		}),
	}
	storage := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "tm_aggregate_event_store_bytes", Help: "Bytes held by the event stream (all tenants), read at scrape time.",
	}, func() float64 {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		info, err := es.stream.Info(ctx)
		if err != nil {
			return 0
		}
		return float64(info.State.Bytes)
	})
	if reg != nil {
		m.commands = promreg.Register(reg, m.commands)
		m.conflicts = promreg.Register(reg, m.conflicts)
		m.appendRetries = promreg.Register(reg, m.appendRetries)
		m.rehydrate = promreg.Register(reg, m.rehydrate)
		m.snapshotHits = promreg.Register(reg, m.snapshotHits)
		m.snapshotBytes = promreg.Register(reg, m.snapshotBytes)
		promreg.Register(reg, storage)
	}
	return m
}

func (m *metrics) observeLoad(r loadReport) {
	m.rehydrate.WithLabelValues(string(r.Strategy)).Observe(r.Took.Seconds())
	if r.Strategy == StrategySnapshot {
		res := "miss"
		if r.SnapshotHit {
			res = "hit"
		}
		m.snapshotHits.WithLabelValues(res).Inc()
	}
}
