package aggregate

import (
	"context"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/promreg"
	"github.com/tenantmesh/tenantmesh/shardkit/events"
)

type metrics struct {
	commands *prometheus.CounterVec
	// log are the event log's metrics (shardkit/events counts them), named here so dashboards
	// and alerts can be checked against this code.
	log *events.Metrics
}

// streamInfo reads the event stream's state.
type streamInfo interface {
	Info(ctx context.Context, opts ...jetstream.StreamInfoOpt) (*jetstream.StreamInfo, error)
}

func newMetrics(reg prometheus.Registerer, stream streamInfo) *metrics {
	m := &metrics{
		commands: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tm_aggregate_commands_total", Help: "Commands by name and outcome (applied, replayed, rejected, error).",
		}, []string{"command", "result"}),
		log: &events.Metrics{
			Conflicts: prometheus.NewCounter(prometheus.CounterOpts{
				Name: "tm_aggregate_append_conflicts_total", Help: "Appends rejected because another writer appended first.",
			}),
			AppendRetries: prometheus.NewCounter(prometheus.CounterOpts{
				Name: "tm_aggregate_append_retries_total", Help: "Append tries made again because NATS was unavailable (a leader election, a reconnect).",
			}),
			Rehydrate: prometheus.NewHistogramVec(prometheus.HistogramOpts{
				Name: "tm_aggregate_rehydrate_seconds", Help: "Time to load a tenant's state, by strategy.",
				Buckets: prometheus.ExponentialBuckets(0.001, 4, 10),
			}, []string{"strategy"}),
			SnapshotLoads: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "tm_aggregate_snapshot_loads_total", Help: "Tenant loads that found a snapshot (hit) or not (miss).",
			}, []string{"result"}),
			SnapshotBytes: prometheus.NewGauge(prometheus.GaugeOpts{
				Name: "tm_aggregate_last_snapshot_bytes", Help: "Size of the last snapshot written.",
			}),
		},
	}
	storage := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "tm_aggregate_event_store_bytes", Help: "Bytes held by the event stream (all tenants), read at scrape time.",
	}, func() float64 {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		info, err := stream.Info(ctx)
		if err != nil {
			return 0
		}
		return float64(info.State.Bytes)
	})
	m.log.Register(reg)
	if reg != nil {
		m.commands = promreg.Register(reg, m.commands)
		promreg.Register(reg, storage)
	}
	return m
}

// commandLabel is the command label of tm_aggregate_commands_total: the command's name when it
// is one the ledger knows, else "other". The name comes from the tenant's request, so a label
// taken as it came would let a tenant make a new series per request (each costs the
// process and every Prometheus that scrapes it memory until restart).
func commandLabel(name string) string {
	switch name {
	case CmdOpen, CmdDeposit, CmdWithdraw, CmdClose:
		return name
	}
	return "other"
}
