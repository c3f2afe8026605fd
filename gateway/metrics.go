package gateway

import (
	"strconv"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/gateway/breaker"
	"github.com/tenantmesh/tenantmesh/internal/promreg"
)

// gwMetrics are the gateway's Prometheus metrics. No metric has a tenant label; instance labels
// are bounded by the directory.
type gwMetrics struct {
	requests      *prometheus.CounterVec   // kind, code
	duration      *prometheus.HistogramVec // kind
	holds         *prometheus.CounterVec   // kind, outcome
	holdWait      *prometheus.HistogramVec // kind
	holdQueued    prometheus.Gauge
	retries       *prometheus.CounterVec // kind, reason
	assigned      *prometheus.CounterVec // kind
	assignJoined  *prometheus.CounterVec // kind: requests that waited on an assignment under way
	loadDecisions *prometheus.CounterVec // kind, decision (load policy)
	producer      *prometheus.CounterVec // kind, decision (producer routes)
	affinity      *prometheus.CounterVec // kind, result (affinity policy: affinitymetrics.go)
	corrupt       *prometheus.CounterVec // bucket
	// Refusals of the hardening bounds (docs/security.md): connections over MaxConns or
	// MaxConnsPerIP (reason total, per_ip), requests cut for a body or a reader too slow
	// (phase body, write, tunnel), assignments refused (reason client, kind, cap), tokens
	// not checked because the client failed too many (edge identity).
	connsRefused  *prometheus.CounterVec // reason
	slow          *prometheus.CounterVec // phase
	assignRefused *prometheus.CounterVec // kind, reason
	tokensShed    prometheus.Counter
	// routeConflicts counts snapshots built while two kinds publish the same route.
	routeConflicts prometheus.Counter
	// grpcCalls counts gRPC calls by the status their client got (the HTTP status of a gRPC
	// answer is 200 whatever its outcome).
	grpcCalls *prometheus.CounterVec // kind, code
}

func newMetrics(g *Gateway, reg prometheus.Registerer) *gwMetrics {
	m := &gwMetrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tm_gateway_requests_total", Help: "Requests answered, by kind and status code (kind \"-\" before one is known).",
		}, []string{"kind", "code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "tm_gateway_request_duration_seconds", Help: "Time to the response headers, by kind.",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
		}, []string{"kind"}),
		holds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tm_gateway_hold_total", Help: "Requests held during a handoff, by outcome (released, aborted, expired, overflow, canceled).",
		}, []string{"kind", "outcome"}),
		holdWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "tm_gateway_hold_wait_seconds", Help: "How long released requests were held.",
			Buckets: []float64{.001, .005, .01, .05, .1, .25, .5, 1, 2, 5, 10},
		}, []string{"kind"}),
		holdQueued: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tm_gateway_hold_queued", Help: "Requests held now.",
		}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tm_gateway_retries_total", Help: "Upstream attempts retried, by reason (misdirected, unreachable, failed, read, idempotent, instance_stopping).",
		}, []string{"kind", "reason"}),
		assigned: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tm_gateway_assignments_total", Help: "Unplaced tenants this gateway assigned to a shard.",
		}, []string{"kind"}),
		loadDecisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tm_gateway_load_decisions_total", Help: "Load policy choices, by decision (local, forward, respect, migrate, break).",
		}, []string{"kind", "decision"}),
		producer: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tm_gateway_producer_decisions_total", Help: "Producer route choices (load policy), by decision: local (the usual pick has consumers for the key), consumer (sent to an instance that has), none (no instance has).",
		}, []string{"kind", "decision"}),
		corrupt: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tm_gateway_corrupt_total", Help: "Registry, directory or kind values skipped because they could not be decoded.",
		}, []string{"bucket"}),
	}
	m.connsRefused = promreg.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tm_gateway_connections_refused_total", Help: "Client connections closed on accept because MaxConns (reason total) or MaxConnsPerIP (per_ip) was reached.",
	}, []string{"reason"}))
	m.slow = promreg.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tm_gateway_slow_clients_total", Help: "Client connections cut because a body arrived too slowly (phase body), the client did not take the answer within WriteTimeout (write), or an upgraded connection sat idle (tunnel).",
	}, []string{"phase"}))
	m.assignRefused = promreg.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tm_gateway_assignments_refused_total", Help: "Unplaced tenants not assigned: the client (reason client) or the kind (kind) was over its assignment rate, or the kind holds its cap of placements (cap).",
	}, []string{"kind", "reason"}))
	m.assignJoined = promreg.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tm_gateway_assignments_joined_total", Help: "Requests for an unplaced tenant that waited on its assignment already under way on this gateway (and took none of the assignment budget).",
	}, []string{"kind"}))
	m.routeConflicts = promreg.Register(reg, prometheus.NewCounter(prometheus.CounterOpts{
		Name: "tm_gateway_route_conflicts_total", Help: "Routing snapshots built while two kinds publish the same method and prefix (neither is routed); nonzero means a misconfiguration or a shard publishing another kind's route.",
	}))
	m.tokensShed = promreg.Register(reg, prometheus.NewCounter(prometheus.CounterOpts{
		Name: "tm_gateway_tokens_shed_total", Help: "Bearer tokens answered 429 without a signature check: their client had too many refused tokens.",
	}))
	promreg.Register(reg, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "tm_gateway_edge_identity", Help: "1 when tenant requests need a verified bearer JWT, 0 when x-tenant-id is believed as sent (--trust-tenant-header).",
	}, func() float64 {
		if g.cfg.Auth != nil {
			return 1
		}
		return 0
	}))
	promreg.Register(reg, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "tm_gateway_connections", Help: "Client connections open (counted against MaxConns).",
	}, func() float64 { return float64(g.conns.open()) }))
	m.requests = promreg.Register(reg, m.requests)
	m.duration = promreg.Register(reg, m.duration)
	m.holds = promreg.Register(reg, m.holds)
	m.holdWait = promreg.Register(reg, m.holdWait)
	m.holdQueued = promreg.Register(reg, m.holdQueued)
	m.retries = promreg.Register(reg, m.retries)
	m.assigned = promreg.Register(reg, m.assigned)
	m.loadDecisions = promreg.Register(reg, m.loadDecisions)
	m.producer = promreg.Register(reg, m.producer)
	m.corrupt = promreg.Register(reg, m.corrupt)
	m.grpcCalls = promreg.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tm_gateway_grpc_calls_total", Help: "gRPC calls by kind and the gRPC status their client got (code: OK, UNAVAILABLE, ...; kind - when refused before its route was known).",
	}, []string{"kind", "code"}))
	promreg.Register(reg, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "tm_gateway_snapshot_staleness_seconds",
		Help: "How long the gateway's routing state has been cut off from NATS (0 while following). It keeps routing from it.",
	}, func() float64 { return g.Staleness().Seconds() }))
	promreg.Register[prometheus.Collector](reg, &breakerCollector{g: g})
	m.affinity = newAffinityRequests(reg)
	promreg.Register[prometheus.Collector](reg, &affinityCollector{g: g})
	return m
}

// code counts a request answered before its kind was known.
func (m *gwMetrics) code(code int) { m.requests.WithLabelValues("-", strconv.Itoa(code)).Inc() }

// kindMetrics caches one kind's children so the request path does no label lookups.
type kindMetrics struct {
	m        *gwMetrics
	kind     string
	duration prometheus.Observer
	holdWait prometheus.Observer
	codes    [600]atomic.Pointer[prometheus.Counter]
	// producer counts producer-route decisions: local, consumer, none.
	producer [3]prometheus.Counter
}

// Producer-route decisions, indexes of kindMetrics.producer.
const (
	producerLocal = iota
	producerConsumer
	producerNone
)

func (m *gwMetrics) forKind(kind string) *kindMetrics {
	return &kindMetrics{m: m, kind: kind,
		duration: m.duration.WithLabelValues(kind), holdWait: m.holdWait.WithLabelValues(kind),
		producer: [3]prometheus.Counter{m.producer.WithLabelValues(kind, "local"), m.producer.WithLabelValues(kind, "consumer"),
			m.producer.WithLabelValues(kind, "none")}}
}

func (k *kindMetrics) code(code int) {
	if code < 100 || code >= len(k.codes) {
		code = 599
	}
	if c := k.codes[code].Load(); c != nil {
		(*c).Inc()
		return
	}
	c := k.m.requests.WithLabelValues(k.kind, strconv.Itoa(code))
	k.codes[code].Store(&c)
	c.Inc()
}

func (k *kindMetrics) hold(outcome string) { k.m.holds.WithLabelValues(k.kind, outcome).Inc() }

// grpcCodeNames are gRPC's status codes by number, the values of grpc_calls_total's code.
var grpcCodeNames = [...]string{"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
	"PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
	"UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"}

// grpcCall counts a gRPC call of kind ("-": not known) by its status (bounded: an unknown
// code counts as UNKNOWN).
func (m *gwMetrics) grpcCall(kind string, code int) {
	if code < 0 || code >= len(grpcCodeNames) {
		code = 2
	}
	m.grpcCalls.WithLabelValues(kind, grpcCodeNames[code]).Inc()
}

func (k *kindMetrics) retry(reason string) { k.m.retries.WithLabelValues(k.kind, reason).Inc() }

// breakerCollector exports each known instance's circuit state and load figures at scrape time.
type breakerCollector struct{ g *Gateway }

var (
	breakerDesc = prometheus.NewDesc("tm_gateway_circuit_state",
		"Circuit breaker state per instance: 0 closed, 1 open, 2 half-open.", []string{"instance"}, nil)
	inflightDesc = prometheus.NewDesc("tm_gateway_upstream_in_flight",
		"Requests in flight to each instance.", []string{"instance"}, nil)
)

func (c *breakerCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- breakerDesc
	ch <- inflightDesc
}

func (c *breakerCollector) Collect(ch chan<- prometheus.Metric) {
	for _, in := range c.g.reg.instances() {
		st := in.breaker.State()
		v := 0.0
		switch st {
		case breaker.Open:
			v = 1
		case breaker.HalfOpen:
			v = 2
		}
		ch <- prometheus.MustNewConstMetric(breakerDesc, prometheus.GaugeValue, v, in.key)
		ch <- prometheus.MustNewConstMetric(inflightDesc, prometheus.GaugeValue, float64(in.inflight.Load()), in.key)
	}
}
