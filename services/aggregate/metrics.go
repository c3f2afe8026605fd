package aggregate

import (
	"context"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/promreg"
)

// The event log's own metrics (tm_aggregate_append_conflicts_total, _append_retries_total,
// _rehydrate_seconds, _snapshot_loads_total, _last_snapshot_bytes) are shardkit/events'.
type metrics struct {
	commands *prometheus.CounterVec
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
	if reg != nil {
		m.commands = promreg.Register(reg, m.commands)
		promreg.Register(reg, storage)
	}
	return m
}
