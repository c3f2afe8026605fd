package gateway

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/tenantmesh/tenantmesh/gateway/policy/affinity"
	"github.com/tenantmesh/tenantmesh/internal/backoff"
	"github.com/tenantmesh/tenantmesh/internal/ctxtime"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// affinityPolicy is the affinity policy's request path (the prerender manager): the selector's
// plan, in order (the tenant's owners rotating, organic growth, round-robin with room, pressure
// mode), failing over to the next attempt on a transport failure or a 5xx, with assignments
// written to the placement by CAS. A new owner chosen with room is recorded before the request
// (so every gateway counts it against the instance's capacity at once); one chosen in pressure
// mode or as the fallback only after the request succeeded (the prerender manager), except on
// instances that embed shardkit, whose gate serves only tenants placed on them: there it is
// recorded first and undone if the request fails. Each attempt is bounded by the kind's
// ServerTimeout.
type affinityPolicy struct{}

// affinityAttempts is the affinity policy's state for one request.
type affinityAttempts struct {
	plan    []affinity.Attempt
	byKey   map[string]*instance
	m       int
	next    int // the plan's next attempt
	cur     affinity.Attempt
	first   bool // cur's owner was recorded before the request
	gated   bool // cur's instance embeds shardkit (its gate answers 421 until it sees the placement)
	last    bool
	same    bool // send cur again (a 421 while the instance catches up)
	pauses  backoff.Pauses
	until   time.Time // 421s are asked again until then
	timeout time.Duration
	cancel  context.CancelFunc
}

func (affinityPolicy) placesTenants() bool { return true }
func (affinityPolicy) holds() bool         { return false }

// timeout leaves room for every attempt of the plan at ServerTimeout each (the multiplex owners
// and the fallback), so that a timed-out attempt can fail over ("5xx/timeout: try next").
func (affinityPolicy) timeout(cfg *schema.KindConfig) time.Duration {
	d := cfg.UpstreamTimeout.D()
	if a := cfg.Affinity; a != nil {
		d = max(d, a.ServerTimeout.D()*time.Duration(a.Multiplex+2))
	}
	return d
}

func (affinityPolicy) pick(env *policyEnv, x *exchange, n int) (*instance, error) {
	s := &x.aff
	if n == 0 {
		cfg := x.ke.config()
		s.m, s.timeout = 1, 30*time.Second
		if cfg.Affinity != nil {
			s.m, s.timeout = cfg.Affinity.Multiplex, cfg.Affinity.ServerTimeout.D()
		}
		var servers []affinity.Server
		servers, s.byKey = affinityServers(x.rt, cfg.Capacity)
		s.plan = x.ke.aff.Plan(x.tenant, servers, s.m)
		if env.log.Enabled(x.ctx, slog.LevelDebug) {
			env.log.Debug("affinity: selection", "kind", x.ke.name, "tenant", x.tenant, "owners", x.ke.aff.Owners(x.tenant),
				"plan", planString(s.plan), "servers", len(servers))
		}
		if len(s.plan) == 0 {
			return nil, &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "no-live-instance", Title: "No live instance",
				Detail: "kind " + x.ke.name + " has no healthy server for this route", RetryAfter: time.Second}
		}
	}
	if s.same {
		s.same = false
		return x.inst, nil
	}
	for ; s.next < len(s.plan); s.next++ {
		a := s.plan[s.next]
		in := s.byKey[a.Key]
		if in == nil || !in.breaker.Allow() {
			continue
		}
		gated := !in.external.Load()
		first := a.New && (gated || !(a.Pressure || a.Fallback))
		if first {
			e, err := env.owners.addOwner(x.ke, x.tenant, a.Key, s.m, a.Pressure || a.Fallback)
			if err != nil {
				in.breaker.Abandon()
				x.lastErr = err
				continue
			}
			x.entry = e
			if !slices.Contains(e.Owners, a.Key) {
				// Another gateway placed the tenant meanwhile: go to its owner instead.
				in.breaker.Abandon()
				if in = ownerIn(e.Owners, s.byKey); in == nil || !in.breaker.Allow() {
					continue
				}
				a = affinity.Attempt{Key: in.key}
				first, gated = false, !in.external.Load()
			}
		}
		s.cur, s.first, s.gated, s.last = a, first, gated, s.next == len(s.plan)-1
		s.pauses, s.until = misdirectedPauses, time.Now().Add(env.refreshWait)
		s.next++
		return in, nil
	}
	if x.lastErr == nil {
		x.lastErr = &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "no-live-instance", Title: "No live instance",
			Detail: "every server of kind " + x.ke.name + " has an open circuit", RetryAfter: time.Second}
	}
	return nil, x.lastErr
}

// misdirectedPauses are the pauses before asking an owner again that answered 421: 5 ms,
// doubling, for up to RefreshWait; exact (the wait is one client's, nobody competes).
var misdirectedPauses = backoff.Policy{Initial: 5 * time.Millisecond, Max: time.Minute, Jitter: backoff.None}.Pauses()

func (affinityPolicy) judge(env *policyEnv, x *exchange, in *instance, up *upConn, err error, _ int) (verdict, error) {
	s := &x.aff
	if err == nil && up.resp.Status == http.StatusMisdirectedRequest {
		// A shardkit instance just made an owner may not have seen its placement yet (same
		// epoch, so its gate does not wait for it): it is asked again, with a short backoff,
		// for up to RefreshWait.
		discard(up)
		if pause := s.pauses.Next(); s.gated && x.replayable && !time.Now().Add(pause).After(s.until) {
			if !ctxtime.Sleep(x.ctx, pause) {
				return fail, x.ctx.Err()
			}
			if e, ok := x.ke.lookup(x.tenant); ok {
				x.entry = e
			}
			s.same = true
			return again, nil
		}
		up, err = nil, errMisdirected(x)
	}
	if err == nil && up.resp.Status < 500 {
		if s.cur.New && !s.first {
			if e, err := env.owners.addOwner(x.ke, x.tenant, s.cur.Key, s.m, true); err == nil {
				x.entry = e
			} else {
				env.log.Warn("recording affinity assignment failed", "kind", x.ke.name, "tenant", x.tenant, "err", err)
			}
		}
		x.ke.aff.Served(x.tenant, s.cur.Key)
		x.affinityAnswer = true
		result := affinityResult(s.cur)
		x.ke.metrics.m.affinity.WithLabelValues(x.ke.name, result).Inc()
		env.log.Debug("affinity: served", "kind", x.ke.name, "tenant", x.tenant, "server", s.cur.Key, "result", result)
		return deliver, nil
	}
	if s.first && (s.cur.Pressure || s.cur.Fallback) {
		env.owners.removeOwner(x.ke, x.tenant, s.cur.Key)
	}
	if err != nil {
		if errors.Is(x.ctx.Err(), context.Canceled) {
			return fail, err
		}
		x.lastErr = &upstreamError{inst: in.key, err: err}
		if !x.replayable || x.ctx.Err() != nil {
			return fail, x.lastErr
		}
		x.ke.metrics.retry("failover")
		return again, nil
	}
	// A 5xx: the next attempt, unless this is the last or the body cannot be sent again.
	if s.last || !x.replayable {
		x.affinityAnswer = true
		return deliver, nil
	}
	status := up.resp.Status
	discard(up)
	x.lastErr = &upstreamError{inst: in.key, err: errors.New("answered " + strconv.Itoa(status))}
	x.ke.metrics.retry("failover")
	return again, nil
}

// affinityOwners writes a tenant's affinity owners to its placement: what the affinity policy
// asks of the gateway's control plane (affinityControl).
type affinityOwners interface {
	addOwner(ke *kindEntry, tenant, key string, m int, force bool) (placement.Entry, error)
	removeOwner(ke *kindEntry, tenant, key string)
}

// planString is a selection plan for the debug log: each attempt's server and why it is there.
func planString(plan []affinity.Attempt) string {
	parts := make([]string, len(plan))
	for i, a := range plan {
		parts[i] = a.Key + ":" + affinityResult(a)
	}
	return strings.Join(parts, " ")
}

// affinityServers lists the route's live instances with an available circuit as selector
// candidates, by key.
func affinityServers(rt *route, defCap int) ([]affinity.Server, map[string]*instance) {
	byKey := map[string]*instance{}
	var servers []affinity.Server
	for _, l := range rt.byShard {
		for _, in := range l {
			if !in.breaker.Available() {
				continue
			}
			c := int(in.capacity.Load())
			if c <= 0 {
				c = defCap
			}
			byKey[in.key] = in
			servers = append(servers, affinity.Server{Key: in.key, Capacity: c})
		}
	}
	slices.SortFunc(servers, func(a, b affinity.Server) int { return strings.Compare(a.Key, b.Key) })
	return servers, byKey
}

// ownerIn returns the first of owners that is a candidate.
func ownerIn(owners []string, byKey map[string]*instance) *instance {
	for _, o := range owners {
		if in := byKey[o]; in != nil {
			return in
		}
	}
	return nil
}

// discard reads and drops a response's body (bounded) and ends the exchange.
func discard(up *upConn) {
	_, err := io.Copy(io.Discard, io.LimitReader(up, 64<<10))
	up.release(err == nil)
}
