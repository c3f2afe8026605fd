package autopilot

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// The retake detector. A takeover whose target has no live instance for a while, or is not
// ready in time, fails its move and leaves the placement in takeover: gateways keep holding
// the tenant's requests and the source's instances keep refusing it, so no write can land on
// two owners. While the source has no live instance the failover detector plans such a tenant
// again with the rest of the shard. But once the source is live again (a partition that
// healed, an instance restarted), nothing would: retake finds these tenants and takes them
// over again, to live shards (planner.Retake), in the failover lane. A takeover never goes
// back to the owner it fenced; the live source drains for the new takeover at once.

// maxRetake bounds the tenants one look examines (two KV reads each) and one retake plan holds.
const maxRetake = 1000

// retakeDetector names retake's decisions and plans.
const retakeDetector = "retake"

// heldTakeover is a tenant whose takeover's move ended without committing.
type heldTakeover struct {
	tenant, source, reason string
	since                  time.Time // when the move ended
}

// lookForHeldTakeovers is the retake detector: for every kind whose failover is auto, the
// tenants held in a takeover that no move drives any more, whose source has a live instance,
// are taken over again.
func (a *Autopilot) lookForHeldTakeovers(ctx context.Context) {
	if !a.d.Presence.Ready() || a.cfg.Mode == Off {
		return
	}
	kcs, err := a.d.Store.Kinds().List(ctx)
	if err != nil {
		return
	}
	held := map[string]int{}
	for _, kc := range kcs {
		if kc.Policy != schema.PolicyManaged {
			continue
		}
		found := a.heldTakeovers(ctx, kc.Kind)
		held[kc.Kind] = len(found)
		if len(found) > 0 && kc.Failover == schema.FailoverAuto && !a.failingKind(kc.Kind) {
			a.retake(ctx, kc.Kind, found)
		}
	}
	a.mu.Lock()
	a.stuck = held
	a.mu.Unlock()
}

// failingKind reports whether a failover or retake plan of kind is under way, or was held back
// a moment ago: retake plans none beside it, so no two plans take over one tenant at once.
func (a *Autopilot) failingKind(kind string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	for subject := range a.failing {
		if subject == kind || strings.HasPrefix(subject, kind+"/") {
			return true
		}
	}
	return time.Now().Before(a.retryAt[kind])
}

// heldTakeovers finds kind's tenants in a takeover whose move is over (or gone) and whose
// source has a live instance (a source without one is the failover detector's), at most
// maxRetake of them.
func (a *Autopilot) heldTakeovers(ctx context.Context, kind string) []heldTakeover {
	var cands []string
	a.takeovers(ctx, kind, func(tenant, source string) bool {
		if !a.d.Presence.Shard(kind, source).Down() {
			cands = append(cands, tenant)
		}
		return len(cands) < maxRetake
	})
	var out []heldTakeover
	for _, tenant := range cands {
		p, err := a.d.Store.Placements(kind).Latest(ctx, tenant)
		if err != nil || p.Phase != schema.PhaseTakeover {
			continue
		}
		h := heldTakeover{tenant: tenant, source: p.Shard, since: p.UpdatedAt}
		m, err := a.d.Engine.Move(ctx, p.Move)
		switch {
		case errors.Is(err, rebalancer.ErrPlanNotFound):
			h.reason = "its move " + p.Move + " is not recorded"
		case err != nil, !m.State.Terminal():
			continue // a move drives it (or its record cannot be read now: look again later)
		default:
			h.reason = fmt.Sprintf("its move %s %s: %s", p.Move, m.State, m.Reason)
			h.since = m.Finished
		}
		out = append(out, h)
	}
	return out
}

// takeovers calls fn with each of kind's tenants in a takeover and its source, from the
// leader's placement watcher, or else from a listing of the kind's placements.
func (a *Autopilot) takeovers(ctx context.Context, kind string, fn func(tenant, source string) bool) {
	if a.d.Takeovers != nil && a.d.Takeovers(kind, fn) {
		return
	}
	pls, _, err := a.d.Store.Placements(kind).List(ctx)
	if err != nil {
		return
	}
	for _, p := range pls {
		if p.Phase == schema.PhaseTakeover && !fn(p.Tenant, p.Shard) {
			return
		}
	}
}

// retake plans and applies (or proposes) taking kind's held tenants over again.
func (a *Autopilot) retake(ctx context.Context, kind string, held []heldTakeover) {
	a.mu.Lock()
	proposedAt, proposed := a.proposed[retakeDetector+"/"+kind]
	a.mu.Unlock()
	if proposed && time.Since(proposedAt) < 10*time.Minute {
		return
	}
	first := held[0]
	tenants := make([]string, len(held))
	for i, h := range held {
		tenants[i] = h.tenant
		if h.since.Before(first.since) {
			first = h
		}
	}
	trig := rebalancer.Trigger{Detector: retakeDetector, Subject: kind, Since: first.since,
		Figure:    fmt.Sprintf("%d tenants held in a takeover that no move drives (%s on %s: %s)", len(held), first.tenant, first.source, first.reason),
		Threshold: "a takeover's move ended without committing while its source has a live instance"}
	w, err := rebalancer.BuildWorld(ctx, a.d.Store, kind, rebalancer.WorldOptions{Telemetry: a.telemetry(), Dead: a.d.Presence.Dead})
	if err != nil {
		a.retry(kind, 2*time.Second)
		a.decide(ctx, Decision{Detector: retakeDetector, Subject: kind, Outcome: "failed", Detail: "reading the kind: " + err.Error()})
		return
	}
	p, err := planner.Retake(w, tenants, planner.Options{Concurrency: a.cfg.FailoverConcurrency})
	if err == nil && len(p.Moves) == 0 {
		err = fmt.Errorf("no tenant can be taken over again: %s", strings.Join(p.Notes, "; "))
	}
	if err != nil {
		a.retry(kind, 10*time.Second)
		a.decide(ctx, Decision{Detector: retakeDetector, Subject: kind, Outcome: "blocked", Guardrail: "no room", Detail: err.Error()})
		return
	}
	a.apply(ctx, retakeDetector, kind, trig, p, true)
}
