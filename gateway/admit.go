package gateway

import (
	"errors"
	"math/rand/v2"
	"net/http"
	"strings"
	"time"

	"github.com/tenantmesh/tenantmesh/gateway/edgeauth"
	"github.com/tenantmesh/tenantmesh/gateway/h1"
	"github.com/tenantmesh/tenantmesh/internal/gatesig"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// admit is the first stage: the tenant (from x-tenant-id, or the bearer token when identity at
// the edge is on), the route (longest prefix, method), the kind and its policy, the request id
// and the kind's per-tenant rate limit. A refused request costs no placement work.
func (g *Gateway) admit(x *exchange) error {
	tb, n := h1.Get(x.fields, tmhttp.HeaderTenant)
	if n > 1 {
		return tmhttp.Errorf(http.StatusBadRequest, "invalid-tenant", "Invalid tenant", "x-tenant-id appears more than once; send it once")
	}
	if x.connNames && namedInConnection(x.fields, hdrTenant) {
		// Connection would make the gateway drop x-tenant-id on the way: the instance would
		// get a request without the tenant the gateway admitted it for.
		return tmhttp.Errorf(http.StatusBadRequest, "invalid-tenant", "Invalid tenant", "the Connection field names x-tenant-id; it is not a hop-by-hop field")
	}
	// Validated before anything keeps it: an id that is not one costs nothing but this answer.
	if len(tb) > 0 && !validTenant(tb) {
		return invalidTenant(schema.CheckTenant(str(tb)))
	}
	tenant := ""
	if len(tb) > 0 {
		tenant = g.tenants.get(tb)
	}
	if g.cfg.Auth != nil {
		if err := g.identify(x, &tenant); err != nil {
			return err
		}
	}
	if !schema.ValidTenant(tenant) {
		return invalidTenant(schema.CheckTenant(tenant))
	}
	x.tenant = tenant
	snap := g.reg.snap.Load()
	rt := snap.match(x.method, x.path)
	if rt == nil {
		if !g.routesSynced() {
			return errStarting
		}
		if k := affinityKindOf(snap, x.path); k != "" {
			return &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "no-live-instance", Title: "No live instance",
				Detail: "no server of kind " + k + " is registered", RetryAfter: time.Second}
		}
		return tmhttp.Errorf(http.StatusNotFound, "no-route", "No route",
			"no route in the registry matches "+x.method+" "+truncate(x.path, 80))
	}
	ke := snap.kinds[rt.kind]
	if ke == nil || ke.config() == nil {
		if !g.routesSynced() {
			return errStarting
		}
		return tmhttp.Errorf(http.StatusNotFound, "unknown-kind", "Unknown kind", "the route's kind "+rt.kind+" is not registered")
	}
	x.rt, x.ke, x.policy = rt, ke, ke.policy()
	x.dropAuthz = g.cfg.Auth != nil && !g.forwardAuthz[rt.kind]
	if g.cfg.ShardKey != nil {
		x.proof = g.signer(rt.kind)
	}
	if id, _ := h1.Get(x.fields, tmhttp.HeaderRequestID); !validRequestID(id) {
		x.reqID = newRequestID(&x.reqIDb)
	}
	if lim := ke.limiter.Load(); lim != nil {
		if ok, wait := lim.allow(tenant, x.start); !ok {
			return &tmhttp.Error{Status: http.StatusTooManyRequests, Type: "rate-limited", Title: "Too many requests",
				Detail: "the tenant is over its rate limit for kind " + rt.kind, RetryAfter: max(wait, time.Second)}
		}
	}
	return nil
}

var hdrTenant = []byte(tmhttp.HeaderTenant)

// affinityKindOf returns the affinity kind whose default route (/<kind>) path falls under, for
// a path no route matches: with no server registered, the prerender manager answers 503, not 404.
func affinityKindOf(snap *snapshot, path string) string {
	name, _, _ := strings.Cut(strings.TrimPrefix(path, "/"), "/")
	if ke := snap.kinds[name]; ke != nil {
		if c := ke.config(); c != nil && c.Policy == schema.PolicyAffinity {
			return name
		}
	}
	return ""
}

func invalidTenant(err error) error {
	return &tmhttp.Error{Status: http.StatusBadRequest, Type: "invalid-tenant", Title: "Invalid tenant id", Detail: err.Error(), Err: err}
}

// validTenant is schema.ValidTenant on the header's bytes.
func validTenant(b []byte) bool {
	if len(b) > schema.MaxTenantLen {
		return false
	}
	for _, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

// signer is the proof signer of kind (Config.ShardKey).
func (g *Gateway) signer(kind string) *gatesig.Signer {
	if v, ok := g.proofs.Load(kind); ok {
		return v.(*gatesig.Signer)
	}
	v, _ := g.proofs.LoadOrStore(kind, gatesig.NewSigner(gatesig.KindKey(g.cfg.ShardKey, kind)))
	return v.(*gatesig.Signer)
}

// identify checks the bearer token (401 without a valid one, 403 when x-tenant-id names another
// tenant); the token's tenant fills x-tenant-id when the client sent none, and its subject goes
// to the shard as x-tm-subject.
func (g *Gateway) identify(x *exchange, tenant *string) error {
	authz, _ := h1.Get(x.fields, "Authorization")
	tok := ""
	if len(authz) > 7 && h1.EqualFold(authz[:7], "bearer ") {
		tok = string(authz[7:])
	}
	var id edgeauth.Identity
	err := error(&edgeauth.Error{Reason: "missing", Err: edgeauth.ErrNoToken})
	if tok != "" {
		var ok bool
		if id, ok = g.cfg.Auth.Cached(tok); !ok {
			// A token seen for the first time costs a signature check: a client whose tokens
			// keep failing gets no more of them for a while.
			if g.tokenFails != nil && g.tokenFails.empty(x.remoteIP, x.start) {
				g.metrics.tokensShed.Inc()
				return &tmhttp.Error{Status: http.StatusTooManyRequests, Type: "too-many-bad-tokens", Title: "Too many invalid tokens",
					Detail: "this client sent too many tokens that did not verify; retry later", RetryAfter: 10 * time.Second}
			}
			if id, err = g.cfg.Auth.VerifyToken(tok); err != nil && g.tokenFails != nil {
				g.tokenFails.allow(x.remoteIP, x.start)
			}
		} else {
			err = nil
		}
	}
	if err != nil {
		return tokenRefused(err)
	}
	switch {
	case *tenant == "":
		*tenant = id.Tenant
		x.fields = append(x.fields, h1.Field{Name: []byte(tmhttp.HeaderTenant), Value: []byte(id.Tenant)})
	case *tenant != id.Tenant:
		return tmhttp.Errorf(http.StatusForbidden, "tenant-mismatch", "Tenant mismatch",
			"x-tenant-id names a tenant the bearer token is not for; send the token's tenant or leave x-tenant-id out")
	}
	x.subject = id.Subject
	return nil
}

// tokenRefusal is a missing or invalid bearer token: 401 with WWW-Authenticate (RFC 6750).
type tokenRefusal struct {
	problem   *tmhttp.Error
	challenge string
}

func (t *tokenRefusal) Error() string { return t.problem.Error() }

func tokenRefused(err error) error {
	ae := &edgeauth.Error{Reason: "invalid", Err: err}
	errors.As(err, &ae)
	desc := "the bearer token is " + ae.Reason
	hdr := `Bearer realm="tenantmesh"`
	if errors.Is(err, edgeauth.ErrNoToken) {
		desc = "send Authorization: Bearer <token> from your identity provider"
	} else {
		hdr += `, error="invalid_token", error_description="` + desc + `"`
	}
	return &tokenRefusal{problem: &tmhttp.Error{Status: http.StatusUnauthorized, Type: "unauthenticated", Title: "Unauthenticated", Detail: desc, Err: err},
		challenge: hdr}
}

func validRequestID(id []byte) bool {
	if len(id) == 0 || len(id) > 128 {
		return false
	}
	for _, c := range id {
		if c <= ' ' || c > '~' {
			return false
		}
	}
	return true
}

// newRequestID writes a random id into b and returns a view of it (valid while b is).
func newRequestID(b *[16]byte) string {
	const hex = "0123456789abcdef"
	v := rand.Uint64()
	for i := range b {
		b[i] = hex[v&15]
		v >>= 4
	}
	return str(b[:])
}

// isAdminPath: the gateway's own endpoints, for requests without x-tenant-id.
func isAdminPath(p string) bool {
	return p == "/" || strings.HasPrefix(p, "/prerender-servers") || p == "/healthz" || p == "/readyz" || p == "/metrics" ||
		strings.HasPrefix(p, "/admin/") || strings.HasPrefix(p, "/debug/pprof/")
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// Unwrap exposes the problem, for the answer stage's mapping.
func (t *tokenRefusal) Unwrap() error { return t.problem }

// errStarting answers a request that found no route while the route registry has not been
// read yet (a gateway just started, or restarted): the route may well exist, so the answer
// is a 503 to come back shortly, never a 404 the client would take for final. The netfault
// upgrade test found it: a gateway replaced under load answered 404 no-route for about 100 ms
// between listening and its first registry read.
var errStarting = &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "starting", Title: "Gateway starting",
	Detail: "the gateway has not read the route registry yet; retry shortly", RetryAfter: time.Second}

// routesSynced reports whether the route registry's first read is in (off the hot path: only
// a request that found no route asks).
func (g *Gateway) routesSynced() bool {
	select {
	case <-g.synced:
		return true
	default:
		return false
	}
}
