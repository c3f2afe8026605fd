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

	"github.com/tenantmesh/tenantmesh/gateway/h1"
	"github.com/tenantmesh/tenantmesh/gateway/policy/affinity"
	"github.com/tenantmesh/tenantmesh/internal/backoff"
	"github.com/tenantmesh/tenantmesh/internal/ctxtime"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// Response headers of the affinity policy: the server that answered and the tenant (realm) it
// answered for. The prerender manager's own names for them, x-boxel-prerender-target and
// x-boxel-prerender-realm, are sent too, with the same values; an instance's answer carrying
// any of the four has them replaced.
const (
	HeaderTarget       = "X-Tm-Target"
	HeaderTargetTenant = "X-Tm-Tenant"
	HeaderSeedTarget   = "X-Boxel-Prerender-Target"
	HeaderSeedRealm    = "X-Boxel-Prerender-Realm"
)

// planString is a selection plan for the debug log: each attempt's server and why it is there.
func planString(plan []affinity.Attempt) string {
	parts := make([]string, len(plan))
	for i, a := range plan {
		parts[i] = a.Key + ":" + affinityResult(a)
	}
	return strings.Join(parts, " ")
}

// isAffinityHeader reports whether n is one of the affinity answer's headers (any spelling).
func isAffinityHeader(n []byte) bool {
	return h1.EqualFold(n, HeaderTarget) || h1.EqualFold(n, HeaderTargetTenant) || h1.EqualFold(n, HeaderSeedTarget) || h1.EqualFold(n, HeaderSeedRealm)
}

// labelRegisteredBy marks directory entries the gateway registered on a server's behalf (the
// prerender manager's HTTP registration API); the gateway heartbeats them while their health checks pass.
const (
	labelRegisteredBy = "registered-by"
	registeredByGW    = "gateway"
)

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

func (affinityPolicy) pick(g *Gateway, x *exchange, n int) (*instance, error) {
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
		if g.log.Enabled(x.ctx, slog.LevelDebug) {
			g.log.Debug("affinity: selection", "kind", x.ke.name, "tenant", x.tenant, "owners", x.ke.aff.Owners(x.tenant),
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
			e, err := g.affCtl().addOwner(x.ke, x.tenant, a.Key, s.m, a.Pressure || a.Fallback)
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
		s.pauses, s.until = misdirectedPauses, time.Now().Add(g.cfg.RefreshWait)
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

func (affinityPolicy) judge(g *Gateway, x *exchange, in *instance, up *upConn, err error, _ int) (verdict, error) {
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
			if e, err := g.affCtl().addOwner(x.ke, x.tenant, s.cur.Key, s.m, true); err == nil {
				x.entry = e
			} else {
				g.log.Warn("recording affinity assignment failed", "kind", x.ke.name, "tenant", x.tenant, "err", err)
			}
		}
		x.ke.aff.Served(x.tenant, s.cur.Key)
		x.affinityAnswer = true
		result := affinityResult(s.cur)
		x.ke.metrics.m.affinity.WithLabelValues(x.ke.name, result).Inc()
		g.log.Debug("affinity: served", "kind", x.ke.name, "tenant", x.tenant, "server", s.cur.Key, "result", result)
		return deliver, nil
	}
	if s.first && (s.cur.Pressure || s.cur.Fallback) {
		g.affCtl().removeOwner(x.ke, x.tenant, s.cur.Key)
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

// shardOfKey returns the shard of an instance key <kind>.<shard>.<instance>.
func shardOfKey(key string) string {
	parts := strings.Split(key, ".")
	if len(parts) != 3 {
		return ""
	}
	return parts[1]
}

// entryOf is a placement read from the bucket, as the view keeps it.
func entryOf(p schema.Placement) placement.Entry {
	return placement.Entry{Shard: p.Shard, Epoch: p.Epoch, Phase: p.Phase, Target: p.Target, Source: p.Source,
		Owners: p.Owners, Pinned: p.Pinned, Revision: p.Revision}
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

// addOwner makes key an owner of tenant (first in the list, at most m owners, the oldest
// dropped), creating the placement if the tenant has none: by CAS, re-reading on conflict, so
// every gateway agrees. Unless force is set (an assignment that already succeeded), a tenant
// that already has m owners keeps them: this gateway planned from a view another gateway has
// overtaken, and the caller goes to one of the stored owners instead. The placement's Shard is the shard of its first owner and never
// changes afterwards (docs/decisions.md), so the epoch stays 1 through owner edits.
func (c affinityControl) addOwner(ke *kindEntry, tenant, key string, m int, force bool) (placement.Entry, error) {
	g := c.g
	ctx, cancel := context.WithTimeout(g.bgCtx, assignTimeout)
	defer cancel()
	by := "gateway/" + g.cfg.ID
	for range 16 {
		p, err := g.store.Placements(ke.name).Get(ctx, tenant)
		if errors.Is(err, schema.ErrNotFound) {
			np, err := g.store.Placements(ke.name).Create(ctx, schema.Placement{Tenant: tenant, Shard: shardOfKey(key),
				Owners: []string{key}, UpdatedBy: by})
			if errors.Is(err, schema.ErrConflict) {
				continue
			}
			if err != nil {
				return placement.Entry{}, assignFailed(err)
			}
			ke.metrics.m.assigned.WithLabelValues(ke.name).Inc()
			ke.aff.SetOwners(tenant, np.Owners)
			return entryOf(np), nil
		}
		if err != nil {
			return placement.Entry{}, assignFailed(err)
		}
		if slices.Contains(p.Owners, key) || p.Phase != schema.PhaseActive || (!force && len(p.Owners) >= m) {
			ke.aff.SetOwners(tenant, p.Owners)
			return entryOf(p), nil
		}
		next := p
		next.Owners = append([]string{key}, p.Owners...)
		if len(next.Owners) > m {
			next.Owners = next.Owners[:m]
		}
		next.UpdatedBy = by
		np, err := g.store.Placements(next.Kind).Update(ctx, p, next)
		if errors.Is(err, schema.ErrConflict) {
			continue
		}
		if err != nil {
			return placement.Entry{}, assignFailed(err)
		}
		ke.aff.SetOwners(tenant, np.Owners)
		return entryOf(np), nil
	}
	return placement.Entry{}, assignFailed(errors.New("too many concurrent placement writers"))
}

func assignFailed(err error) error {
	return &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "assign-failed", Title: "Tenant could not be placed",
		Detail: "the gateway could not record the tenant's server; retry shortly", RetryAfter: time.Second, Err: err}
}

// removeOwner takes key out of tenant's owners by CAS, deleting the placement with its last
// owner (what shardkit's Release does for an instance). Absent: nothing to do.
func (c affinityControl) removeOwner(ke *kindEntry, tenant, key string) {
	g := c.g
	ctx, cancel := context.WithTimeout(g.bgCtx, assignTimeout)
	defer cancel()
	for range 16 {
		p, err := g.store.Placements(ke.name).Get(ctx, tenant)
		if errors.Is(err, schema.ErrNotFound) {
			ke.aff.SetOwners(tenant, nil)
			return
		}
		if err != nil {
			g.log.Warn("removing affinity owner failed", "kind", ke.name, "tenant", tenant, "err", err)
			return
		}
		owners := slices.DeleteFunc(slices.Clone(p.Owners), func(o string) bool { return o == key })
		if len(owners) == len(p.Owners) {
			ke.aff.SetOwners(tenant, p.Owners)
			return
		}
		if len(owners) == 0 {
			err = g.store.Placements(ke.name).Delete(ctx, tenant, p.Revision)
		} else {
			next := p
			next.Owners = owners
			next.UpdatedBy = "gateway/" + g.cfg.ID
			_, err = g.store.Placements(next.Kind).Update(ctx, p, next)
		}
		if errors.Is(err, schema.ErrConflict) {
			continue
		}
		if err != nil && !errors.Is(err, schema.ErrNotFound) {
			g.log.Warn("removing affinity owner failed", "kind", ke.name, "tenant", tenant, "err", err)
			return
		}
		ke.aff.SetOwners(tenant, owners)
		if len(owners) == 0 {
			ke.aff.Forget(tenant)
		}
		return
	}
}

// dropServer removes key from every tenant's owners.
func (c affinityControl) dropServer(ke *kindEntry, key string) {
	g := c.g
	for _, t := range ke.aff.TenantsOf(key) {
		g.affCtl().removeOwner(ke, t, key)
	}
}

// affinityHealth polls the servers the gateway registered (the prerender manager's health polling), every
// affinity kind's HealthInterval: a server that answers GET / keeps its directory entry fresh
// (the gateway heartbeats on its behalf), one that does not is unregistered. Owners that left
// the directory or stopped being live are dropped from every tenant's mapping.
func (c affinityControl) affinityHealth() {
	g := c.g
	last := map[string]time.Time{}
	for {
		wake := time.Second // kinds registered later are noticed within a second
		due := map[string]time.Duration{}
		now := time.Now()
		for name, ke := range g.reg.snap.Load().kinds {
			if c := ke.config(); c != nil && c.Policy == schema.PolicyAffinity && c.Affinity != nil {
				iv := c.Affinity.HealthInterval.D()
				if now.Sub(last[name]) >= iv {
					due[name] = iv
				}
				wake = min(wake, iv)
			}
		}
		select {
		case <-g.ready:
			if len(due) > 0 {
				g.affCtl().healthTick(due)
				for name := range due {
					last[name] = now
				}
			}
		default:
		}
		if !ctxtime.Sleep(g.bgCtx, wake) {
			return
		}
	}
}

// healthTick checks the kinds in due (kind -> its health interval).
func (c affinityControl) healthTick(due map[string]time.Duration) {
	g := c.g
	snap := g.reg.snap.Load()
	now := time.Now()
	at := g.reg.liveAt(now)
	g.reg.mu.Lock()
	dir := make(map[string]schema.Instance, len(g.reg.dir))
	for k, v := range g.reg.dir {
		dir[k] = v
	}
	g.reg.mu.Unlock()
	for _, ke := range snap.kinds {
		interval, ok := due[ke.name]
		if !ok {
			continue
		}
		var checks []schema.Instance
		for _, in := range dir {
			if in.Kind == ke.name && in.Labels[labelRegisteredBy] == registeredByGW {
				checks = append(checks, in)
			}
		}
		type result struct {
			in schema.Instance
			ok bool
		}
		res := make(chan result, len(checks))
		timeout := min(interval, 5*time.Second)
		for _, in := range checks {
			go func() { res <- result{in, g.affCtl().probe(in.URL, timeout) == nil} }()
		}
		for range checks {
			r := <-res
			if r.ok {
				ctx, cancel := context.WithTimeout(g.bgCtx, assignTimeout)
				if _, err := g.store.Directory().Heartbeat(ctx, r.in); err != nil {
					g.log.Warn("heartbeat for a registered server failed", "instance", r.in.Key(), "err", err)
				}
				cancel()
				continue
			}
			g.log.Warn("registered server failed its health check; unregistering", "instance", r.in.Key())
			g.affCtl().unregisterServer(ke, r.in.InstanceID)
			delete(dir, r.in.Key())
		}
		for _, key := range ke.aff.Instances() {
			in, ok := dir[key]
			if !ok || !g.cfg.Thresholds.Status(in, at).Live() {
				g.affCtl().dropServer(ke, key)
			}
		}
	}
}

// probe checks a server with GET / (the prerender manager's health check and registration validation).
func (c affinityControl) probe(base string, timeout time.Duration) error {
	g := c.g
	ctx, cancel := context.WithTimeout(g.bgCtx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(base, "/")+"/", nil)
	if err != nil {
		return err
	}
	resp, err := g.health.Do(req)
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	if resp.StatusCode >= 300 {
		return errors.New("GET / answered " + strconv.Itoa(resp.StatusCode))
	}
	return nil
}

// unregisterServer removes a server from the directory, the routes and every mapping.
func (c affinityControl) unregisterServer(ke *kindEntry, id schema.InstanceID) {
	g := c.g
	ctx, cancel := context.WithTimeout(g.bgCtx, assignTimeout)
	defer cancel()
	if err := g.store.Directory().Unregister(ctx, id); err != nil {
		g.log.Warn("unregistering server failed", "instance", id.Key(), "err", err)
	}
	if _, err := g.store.Routes().RemoveInstanceEverywhere(ctx, id); err != nil {
		g.log.Warn("removing server from routes failed", "instance", id.Key(), "err", err)
	}
	g.affCtl().dropServer(ke, id.Key())
}

// affinityControl is the affinity policy's control plane: owners written by CAS, and the
// health polling of servers registered through the gateway.
type affinityControl struct{ g *Gateway }

func (g *Gateway) affCtl() affinityControl { return affinityControl{g} }
