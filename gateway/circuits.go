package gateway

import (
	"slices"
	"strings"
	"time"

	"github.com/tenantmesh/tenantmesh/gateway/breaker"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// circuitEvery is how many housekeeping ticks (1s) pass between circuit reports.
const circuitEvery = 2

// circuitReport lists the instances whose circuit gateway does not hold closed, for the
// rebalancer's instance view (schema.CircuitReport).
func (reg *registry) circuitReport(gateway string) schema.CircuitReport {
	r := schema.CircuitReport{Gateway: gateway}
	for _, in := range reg.instances() {
		if in.breaker.State() == breaker.Closed {
			continue
		}
		s := in.breaker.Snapshot()
		r.Circuits = append(r.Circuits, schema.CircuitState{Instance: in.key, State: s.State, Failures: s.Failures, OpenUntil: s.RetryAt})
	}
	slices.SortFunc(r.Circuits, func(a, b schema.CircuitState) int { return strings.Compare(a.Instance, b.Instance) })
	return r
}

// publishCircuits sends the circuit report; telemetry is lossy, so a failure is only logged.
func (g *Gateway) publishCircuits() {
	r := g.reg.circuitReport(g.telemetryName)
	r.Time = time.Now().UTC()
	if err := g.store.PublishCircuits(r); err != nil {
		g.log.Debug("publishing circuits", "err", err)
	}
}

// tokenName turns a free-form id (a hostname-pid) into a subject token: [A-Za-z0-9_-], at most
// 64 characters.
func tokenName(id string) string {
	b := []byte(id)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			b[i] = '-'
		}
	}
	if len(b) > 64 {
		b = b[len(b)-64:]
	}
	if len(b) == 0 {
		return "gateway"
	}
	return string(b)
}
