package shardkit

import (
	"slices"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/promreg"
)

// otherTenant is the label of every tenant outside the top N.
const otherTenant = "other"

var codeClasses = [...]string{"1xx", "2xx", "3xx", "4xx", "5xx"}

// tenantSeries are the counters a tenant's requests increment: its own when it is in the top N,
// else the shared "other" ones. Swapped by pointer when the top N changes.
type tenantSeries struct {
	label    string
	requests [len(codeClasses)]prometheus.Counter
}

type metrics struct {
	requests *prometheus.CounterVec
	latency  prometheus.Histogram
	refused  *prometheus.CounterVec
	forwards *prometheus.CounterVec
	drains   *prometheus.CounterVec
	lag      *prometheus.GaugeVec

	mu       sync.Mutex
	top      map[string]*tenantSeries // labelled tenants
	other    *tenantSeries
	lagNames map[string]bool
}

func newMetrics(reg prometheus.Registerer, s *Shard) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tm_shard_requests_total",
			Help: "Requests served through the gate, by tenant (top N, the rest as other) and status class.",
		}, []string{"tenant", "code_class"}),
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "tm_shard_request_duration_seconds",
			Help:    "Time the service took to answer requests the gate let through.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tm_shard_refused_total",
			Help: "Requests the gate refused, by reason.",
		}, []string{"reason"}),
		forwards: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tm_shard_forwarded_total",
			Help: "Requests forwarded to the owner (forward mode), by result.",
		}, []string{"result"}),
		drains: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tm_shard_drains_total",
			Help: "Tenant drains, by result (drained, timeout).",
		}, []string{"result"}),
		lag: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "tm_shard_tenant_lag",
			Help: "Entries a warming tenant has yet to apply to reach its fence (only tenants warming here).",
		}, []string{"tenant"}),
		top:      map[string]*tenantSeries{},
		lagNames: map[string]bool{},
	}
	m.requests = promreg.Register(reg, m.requests)
	m.latency = promreg.Register(reg, m.latency)
	m.refused = promreg.Register(reg, m.refused)
	m.forwards = promreg.Register(reg, m.forwards)
	m.drains = promreg.Register(reg, m.drains)
	m.lag = promreg.Register(reg, m.lag)
	m.other = m.series(otherTenant)
	for _, c := range []prometheus.Collector{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "tm_shard_in_flight", Help: "Requests being served now.",
		}, func() float64 { return float64(s.inflight.Load()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "tm_shard_ready", Help: "1 while the instance is ready for traffic.",
		}, func() float64 {
			if s.ready.Load() {
				return 1
			}
			return 0
		}),
	} {
		promreg.Register(reg, c)
	}
	return m
}

func (m *metrics) series(label string) *tenantSeries {
	ts := &tenantSeries{label: label}
	for i, c := range codeClasses {
		ts.requests[i] = m.requests.WithLabelValues(label, c)
	}
	return ts
}

// seriesFor is the series a tenant uses now.
func (m *metrics) seriesFor(tenant string) *tenantSeries {
	m.mu.Lock()
	defer m.mu.Unlock()
	if ts := m.top[tenant]; ts != nil {
		return ts
	}
	return m.other
}

// setTop makes the n tenants with the most requests since the previous call the labelled set
// and repoints every state's series. Tenants leaving the set lose their series, so label
// cardinality stays at n+1. Called from the heartbeat goroutine only.
func (m *metrics) setTop(states []*tenantState, n int) {
	type ranked struct {
		ts    *tenantState
		delta uint64
	}
	sorted := make([]ranked, 0, len(states))
	for _, ts := range states {
		r := ts.requests.Load()
		sorted = append(sorted, ranked{ts, r - ts.topMark})
		ts.topMark = r
	}
	slices.SortFunc(sorted, func(a, b ranked) int {
		switch {
		case a.delta > b.delta:
			return -1
		case a.delta < b.delta:
			return 1
		}
		return strings.Compare(a.ts.tenant, b.ts.tenant)
	})
	want := map[string]bool{}
	for _, r := range sorted {
		if len(want) >= n || r.delta == 0 {
			break
		}
		if r.ts.tenant != otherTenant {
			want[r.ts.tenant] = true
		}
	}
	m.mu.Lock()
	for t := range m.top {
		if !want[t] {
			delete(m.top, t)
			for _, c := range codeClasses {
				m.requests.DeleteLabelValues(t, c)
			}
		}
	}
	for t := range want {
		if m.top[t] == nil {
			m.top[t] = m.series(t)
		}
	}
	m.mu.Unlock()
	for _, ts := range states {
		ts.labels.Store(m.seriesFor(ts.tenant))
	}
}

func (m *metrics) setLag(tenant string, lag uint64) {
	m.mu.Lock()
	m.lagNames[tenant] = true
	m.mu.Unlock()
	m.lag.WithLabelValues(tenant).Set(float64(lag))
}

func (m *metrics) clearLag(tenant string) {
	m.mu.Lock()
	had := m.lagNames[tenant]
	delete(m.lagNames, tenant)
	m.mu.Unlock()
	if had {
		m.lag.DeleteLabelValues(tenant)
	}
}

// classIndex maps a status code to its class's index.
func classIndex(code int) int {
	i := code/100 - 1
	if i < 0 || i >= len(codeClasses) {
		return len(codeClasses) - 1
	}
	return i
}
