package projection

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/promreg"
)

type metrics struct {
	applied     prometheus.Counter
	received    prometheus.Counter
	corrupt     prometheus.Counter
	flushes     prometheus.Counter
	flushBytes  prometheus.Histogram
	catchUps    prometheus.Histogram
	rebuilds    prometheus.Histogram
	hosted      prometheus.Gauge
	liveTenants prometheus.Gauge
	passes      prometheus.Counter // the placement watch's passes over the tenants queued for it
	queries     *prometheus.CounterVec
	// Per view type (the Cloudlysis PRD's "query latency and scan counts", "lag per
	// tenant/view_type"): each query's latency, the rows it scanned, and the lag of the view
	// it read (per tenant, the lag is in /admin/projection/tenant).
	queryTime *prometheus.HistogramVec
	scanned   *prometheus.HistogramVec
	viewLag   *prometheus.HistogramVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		applied: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tm_projection_events_applied_total", Help: "Events applied to views (catch-up and tail).",
		}),
		received: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tm_projection_tail_messages_total", Help: "Messages the tail consumers received, applied or dropped (another tenant's, or already applied).",
		}),
		corrupt: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tm_projection_corrupt_events_total", Help: "Events that could not be decoded and were skipped.",
		}),
		flushes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tm_projection_checkpoints_total", Help: "Views stored with their checkpoint.",
		}),
		flushBytes: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "tm_projection_checkpoint_bytes", Help: "Bytes one store of a tenant's views wrote (its head and the pages of transactions that became full).",
			Buckets: prometheus.ExponentialBuckets(256, 4, 10),
		}),
		catchUps: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "tm_projection_catchup_seconds", Help: "Time for a tenant's catch-up (load stored views, replay to the stream's end).",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 10),
		}),
		rebuilds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "tm_projection_tail_rebuild_seconds", Help: "Time to (re)create the shared tail consumer after the live set changed.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 4, 10),
		}),
		hosted: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tm_projection_tenants", Help: "Tenants hosted or warming on this instance.",
		}),
		liveTenants: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tm_projection_tail_tenants", Help: "Tenants the shared tail consumer applies.",
		}),
		passes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tm_projection_placement_passes_total", Help: "Passes of the placement watch over the tenants whose placement changed: each hosts or releases them.",
		}),
		queries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tm_projection_queries_total", Help: "Queries by view type and result (ok, bad, error).",
		}, []string{"view", "result"}),
		queryTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "tm_projection_query_duration_seconds", Help: "Time to answer a query (ok), by view type.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 4, 10),
		}, []string{"view"}),
		scanned: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "tm_projection_query_rows_scanned", Help: "Rows a query scanned (views have no secondary indexes: every row of the tenant's view), by view type.",
			Buckets: prometheus.ExponentialBuckets(1, 4, 12),
		}, []string{"view"}),
		viewLag: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "tm_projection_view_lag", Help: "Lag of the view a query read, by view type: the tenant's newest event's stream sequence minus the view's applied sequence (0: current).",
			Buckets: append([]float64{0}, prometheus.ExponentialBuckets(1, 4, 12)...),
		}, []string{"view"}),
	}
	if reg != nil {
		m.applied = promreg.Register(reg, m.applied)
		m.received = promreg.Register(reg, m.received)
		m.corrupt = promreg.Register(reg, m.corrupt)
		m.flushes = promreg.Register(reg, m.flushes)
		m.flushBytes = promreg.Register(reg, m.flushBytes)
		m.catchUps = promreg.Register(reg, m.catchUps)
		m.rebuilds = promreg.Register(reg, m.rebuilds)
		m.hosted = promreg.Register(reg, m.hosted)
		m.liveTenants = promreg.Register(reg, m.liveTenants)
		m.passes = promreg.Register(reg, m.passes)
		m.queries = promreg.Register(reg, m.queries)
		m.queryTime = promreg.Register(reg, m.queryTime)
		m.scanned = promreg.Register(reg, m.scanned)
		m.viewLag = promreg.Register(reg, m.viewLag)
	}
	return m
}
