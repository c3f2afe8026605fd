package gateway

import (
	"net/http"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// AssignLimits bound the assignment of unplaced tenants (the kind's unplaced rule "assign"):
// how fast one client and one kind may have new tenants placed, and how many placements a kind
// may hold before the gateway stops assigning (the rebalancer still places beyond it). A
// refused assignment is answered 429 (a rate) or 503 (the cap), counted in
// tm_gateway_assignments_refused_total. With identity at the edge, only a verified tenant is
// ever assigned (admit refuses the rest first). Zero fields take the defaults; a negative rate
// or cap turns that bound off.
type AssignLimits struct {
	// PerClient is new tenants a second one client address may have assigned, with bursts of
	// PerClientBurst. Defaults 5 and 50.
	PerClient      float64
	PerClientBurst int
	// PerKind is new tenants a second for one kind, all clients together (each gateway
	// counts its own), with bursts of PerKindBurst. Defaults 100 and 1,000.
	PerKind      float64
	PerKindBurst int
	// MaxPlacements is the most placements a kind may hold for the gateway to assign one more.
	// Default 1,000,000 (docs/design.md's scale target per kind).
	MaxPlacements int
}

func (l AssignLimits) withDefaults() AssignLimits {
	if l.PerClient == 0 {
		l.PerClient = 5
	}
	if l.PerClientBurst <= 0 {
		l.PerClientBurst = 50
	}
	if l.PerKind == 0 {
		l.PerKind = 100
	}
	if l.PerKindBurst <= 0 {
		l.PerKindBurst = 1000
	}
	if l.MaxPlacements == 0 {
		l.MaxPlacements = 1_000_000
	}
	return l
}

// assignLimiter keeps the buckets of AssignLimits: one per client address, one per kind.
type assignLimiter struct {
	lim              AssignLimits
	byClient, byKind *tenantLimiter // nil: that rate is off
}

func newAssignLimiter(l AssignLimits) *assignLimiter {
	a := &assignLimiter{lim: l}
	if l.PerClient > 0 {
		a.byClient = newTenantLimiter(l.PerClient, l.PerClientBurst)
	}
	if l.PerKind > 0 {
		a.byKind = newTenantLimiter(l.PerKind, l.PerKindBurst)
	}
	return a
}

// allow takes an assignment for a client of kind at now, or says why not.
func (a *assignLimiter) allow(m *gwMetrics, kind, client string, now time.Time) error {
	if a.byClient != nil {
		if ok, wait := a.byClient.allow(client, now); !ok {
			m.assignRefused.WithLabelValues(kind, "client").Inc()
			return &tmhttp.Error{Status: http.StatusTooManyRequests, Type: "assign-rate-limited", Title: "Too many new tenants",
				Detail: "this client has had too many new tenants placed for now; retry later", RetryAfter: max(wait, time.Second)}
		}
	}
	if a.byKind != nil {
		if ok, wait := a.byKind.allow(kind, now); !ok {
			m.assignRefused.WithLabelValues(kind, "kind").Inc()
			return &tmhttp.Error{Status: http.StatusTooManyRequests, Type: "assign-rate-limited", Title: "Too many new tenants",
				Detail: "kind " + kind + " is placing too many new tenants for now; retry later", RetryAfter: max(wait, time.Second)}
		}
	}
	return nil
}

// sweep drops idle client buckets.
func (a *assignLimiter) sweep(now time.Time) {
	if a.byClient != nil {
		a.byClient.sweep(now, time.Minute)
	}
}
