package rebalancer

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// InstanceDetail is one instance's page (the multi-host design's GET /hosts/:hostId): its
// directory entry and derived status, the tenants its shard serves, its recent job runs and
// newest load report from telemetry, its circuit as each gateway sees it, and its status history.
type InstanceDetail struct {
	InstanceView
	// Tenants are the tenants placed on the instance's shard (affinity kinds: the tenants it
	// owns), sorted, at most MaxDetailTenants; TenantsTotal counts them all.
	Tenants      []DetailTenant `json:"tenants"`
	TenantsTotal int            `json:"tenants_total"`
	// Load is the instance's newest load report, if one arrived recently.
	Load *schema.LoadReport `json:"load,omitempty"`
	// Runs are its recent job runs, newest first (runner instances).
	Runs []schema.RunSummary `json:"recent_runs"`
	// Circuits is the instance's circuit breaker in each gateway that reported recently.
	Circuits []GatewayCircuit `json:"circuits"`
	// History is its recent status changes, oldest first (bounded: schema.MaxStatusHistory).
	History []schema.StatusChange `json:"history"`
}

// DetailTenant is one tenant on an instance's page.
type DetailTenant struct {
	Tenant string       `json:"tenant"`
	Phase  schema.Phase `json:"phase"`
	Epoch  uint64       `json:"epoch"`
	Pinned bool         `json:"pinned,omitempty"`
}

// MaxDetailTenants bounds the tenants an instance's page lists.
const MaxDetailTenants = 200

// GatewayCircuit is an instance's circuit in one gateway's view.
type GatewayCircuit struct {
	Gateway   string    `json:"gateway"`
	State     string    `json:"state"` // closed, open, half-open
	Failures  int       `json:"failures"`
	OpenUntil time.Time `json:"open_until,omitzero"`
	Reported  time.Time `json:"reported"`
}

// DetailSources are where an instance's page reads what is not in KV; either may be nil.
type DetailSources struct {
	Telemetry *Telemetry
	Circuits  *Circuits
}

// Detail reads one instance's page. It lists the kind's placements to find the shard's tenants:
// an operator's read, not a loop.
func Detail(ctx context.Context, st *schema.Store, key string, h Health, src DetailSources, now time.Time) (InstanceDetail, error) {
	id, err := schema.ParseInstanceID(key)
	if err != nil {
		return InstanceDetail{}, err
	}
	inst, err := st.Directory().Instance(ctx, id)
	if err != nil {
		return InstanceDetail{}, fmt.Errorf("instance %s: %w", key, err)
	}
	d := InstanceDetail{InstanceView: InstanceView{Instance: inst, Key: key, Status: h.Status(inst, now), HeartbeatAge: now.Sub(inst.Heartbeat).Seconds()},
		Tenants: []DetailTenant{}, Runs: []schema.RunSummary{}}
	if d.Tenants, d.TenantsTotal, err = shardTenants(ctx, st, id); err != nil {
		return InstanceDetail{}, err
	}
	if r, ok := src.Telemetry.Latest(key, now, 30*time.Second); ok {
		d.Load = &r
		if r.Runs != nil {
			d.Runs = r.Runs
		}
		if r.Time.After(inst.Heartbeat) { // the load report is the heartbeat between directory writes
			d.HeartbeatAge = now.Sub(r.Time).Seconds()
		}
	}
	d.Circuits = src.Circuits.Of(key, now)
	hist, _, err := st.Directory().InstanceHistory(ctx, id)
	if err != nil {
		return InstanceDetail{}, err
	}
	d.History = hist.Changes
	if d.History == nil {
		d.History = []schema.StatusChange{}
	}
	return d, nil
}

func shardTenants(ctx context.Context, st *schema.Store, id schema.InstanceID) ([]DetailTenant, int, error) {
	kc, err := st.Kinds().Get(ctx, id.Kind)
	if err != nil {
		return nil, 0, err
	}
	pls, _, err := st.Placements(id.Kind).List(ctx)
	if err != nil {
		return nil, 0, err
	}
	out := []DetailTenant{}
	total := 0
	for _, p := range pls {
		on := p.Shard == id.Shard || p.Target == id.Shard
		if kc.Policy == schema.PolicyAffinity {
			on = slices.Contains(p.Owners, id.Key())
		}
		if !on {
			continue
		}
		total++
		out = append(out, DetailTenant{Tenant: p.Tenant, Phase: p.Phase, Epoch: p.Epoch, Pinned: p.Pinned})
	}
	slices.SortFunc(out, func(a, b DetailTenant) int { return strings.Compare(a.Tenant, b.Tenant) })
	if len(out) > MaxDetailTenants {
		out = out[:MaxDetailTenants]
	}
	return out, total, nil
}

// Latest is instance key's newest report if it is at most maxAge old at now.
func (t *Telemetry) Latest(key string, now time.Time, maxAge time.Duration) (schema.LoadReport, bool) {
	if t == nil {
		return schema.LoadReport{}, false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	r, ok := t.latest[key]
	if !ok || now.Sub(r.Time) > maxAge {
		return schema.LoadReport{}, false
	}
	return r, true
}

// Circuits keeps every gateway's newest circuit report (schema.CircuitReport), from
// tm.circuit.>, so an instance's page shows its circuit as the gateways see it.
type Circuits struct {
	mu     sync.Mutex
	latest map[string]schema.CircuitReport // gateway -> newest report
	sub    *nats.Subscription
}

// circuitMaxAge is how long a gateway's report counts: gateways report every 2s.
const circuitMaxAge = 10 * time.Second

// WatchCircuits subscribes to the gateways' circuit reports until Stop.
func WatchCircuits(st *schema.Store) (*Circuits, error) {
	c := &Circuits{latest: map[string]schema.CircuitReport{}}
	sub, err := st.SubscribeCircuits(c.Add)
	if err != nil {
		return nil, err
	}
	c.sub = sub
	return c, nil
}

// Add records a report; a gateway's newer report replaces its older one.
func (c *Circuits) Add(r schema.CircuitReport) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if cur, ok := c.latest[r.Gateway]; ok && cur.Time.After(r.Time) {
		return
	}
	c.latest[r.Gateway] = r
	now := time.Now()
	maps.DeleteFunc(c.latest, func(_ string, r schema.CircuitReport) bool { return now.Sub(r.Time) > forgetAfter })
}

// Stop ends the subscription.
func (c *Circuits) Stop() {
	if c != nil && c.sub != nil {
		_ = c.sub.Unsubscribe()
	}
}

// Of is instance key's circuit in every gateway that reported within circuitMaxAge of now,
// sorted by gateway: closed unless the gateway lists it.
func (c *Circuits) Of(key string, now time.Time) []GatewayCircuit {
	out := []GatewayCircuit{}
	if c == nil {
		return out
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for gw, r := range c.latest {
		if now.Sub(r.Time) > circuitMaxAge {
			continue
		}
		g := GatewayCircuit{Gateway: gw, State: "closed", Reported: r.Time}
		for _, cs := range r.Circuits {
			if cs.Instance == key {
				g.State, g.Failures, g.OpenUntil = cs.State, cs.Failures, cs.OpenUntil
			}
		}
		out = append(out, g)
	}
	slices.SortFunc(out, func(a, b GatewayCircuit) int { return strings.Compare(a.Gateway, b.Gateway) })
	return out
}

// SetDegraded sets (on) or clears the operator's degraded flag of instance key and audits it.
func SetDegraded(ctx context.Context, st *schema.Store, key string, on bool, reason, actor string) (schema.Instance, error) {
	id, err := schema.ParseInstanceID(key)
	if err != nil {
		return schema.Instance{}, err
	}
	var f *schema.InstanceFlag
	action := "instance.degraded-cleared"
	if on {
		f = &schema.InstanceFlag{Degraded: true, Reason: reason, By: actor}
		action = "instance.degraded-set"
	}
	inst, err := st.Directory().SetInstanceFlag(ctx, id, f)
	if err != nil {
		return schema.Instance{}, fmt.Errorf("instance %s: %w", key, err)
	}
	_ = st.Audit().Append(ctx, schema.AuditEvent{Actor: actor, Action: action, Kind: id.Kind, After: f, Detail: "instance " + key + ": " + reason})
	return inst, nil
}
