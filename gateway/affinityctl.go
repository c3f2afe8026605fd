package gateway

import (
	"context"
	"errors"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/ctxtime"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// affinityControl is the affinity policy's control plane: owners written by CAS (the policy's
// affinityOwners), and the probing and health polling of servers registered through the
// gateway (register.go); none of it runs on the request path but the owner writes.
type affinityControl struct{ g *Gateway }

func (g *Gateway) affCtl() affinityControl { return affinityControl{g} }

// labelRegisteredBy marks directory entries the gateway registered on a server's behalf (the
// prerender manager's HTTP registration API); the gateway heartbeats them while their health checks pass.
const (
	labelRegisteredBy = "registered-by"
	registeredByGW    = "gateway"
)

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

// shardOfKey returns the shard of an instance key <kind>.<shard>.<instance>.
func shardOfKey(key string) string {
	parts := strings.Split(key, ".")
	if len(parts) != 3 {
		return ""
	}
	return parts[1]
}
