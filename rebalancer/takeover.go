package rebalancer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// A takeover moves a tenant off a shard that has no live instance, without the source's
// drain (docs/design.md, "Failover"):
//
//	active(A) | warming(A->*) | handoff(A->*) | takeover(A->*)  ->  takeover(A->B)  ->  active(B, epoch+1)
//
// Safety rests on fences, never on A being dead. From the takeover write on, gateways hold the
// tenant's requests and A's instances refuse it once they see it; B's instances fence A's
// late writes in the service's store (shardkit Hooks.Takeover: the events package's epoch
// marker) and warm up from the store. The engine commits only when B is ready and no instance
// of A can still serve the tenant: every live A instance reported drained (A was alive after
// all), or Presence found every A instance gone (NATS closed their connections: none can
// confirm its view again without a new connection, which subscribes to its probe first), or
// the longest lease of A's instances (with a margin for clock rates) has passed since the
// takeover was written: an A instance that could not confirm its view since stopped serving,
// and one that did saw the takeover.

// leaseMargin is added to a lease, beyond 10% of it for the two clocks' rates, before a
// takeover counts it as run out.
const leaseMargin = 250 * time.Millisecond

// goneDelay is how long after the takeover write a probe must have found the source's
// instances gone: a reconnecting instance's new subscription reaches every server first.
const goneDelay = 200 * time.Millisecond

// targetGrace is how long a takeover waits for a target with no live instance before it fails
// the move (a failover, or the autopilot's retake once the source is live, plans another
// target).
const targetGrace = 5 * time.Second

// shardDown reports whether Presence says kind's shard has no live instance (false without
// Presence).
func (e *Engine) shardDown(kind, shard string) bool {
	return e.cfg.Presence != nil && e.cfg.Presence.Shard(kind, shard).Down()
}

// toTakeover turns m, a move whose source died while it warmed or handed off, into a takeover
// of the same tenant to the same target.
func (e *Engine) toTakeover(ctx context.Context, m *MoveRecord, p schema.Placement, w *signalWatch) error {
	e.cfg.Logger.Warn("the move's source has no live instance: taking the tenant over", "move", m.Key(), "kind", m.Kind, "tenant", m.Tenant, "from", m.From, "to", m.To)
	m.Takeover = true
	return e.startTakeover(ctx, m, p, w)
}

// startTakeover puts the placement in takeover(from -> to), from any phase in which from still
// owns the tenant. A failover plans from the placements as they were, so the revision may have
// moved on (a move of the tenant started or was converted); what counts is that from owns it.
func (e *Engine) startTakeover(ctx context.Context, m *MoveRecord, p schema.Placement, w *signalWatch) error {
	if p.Shard != m.From || p.Phase == schema.PhaseDraining {
		m.State, m.Finished = MoveSkipped, time.Now().UTC()
		m.Reason = fmt.Sprintf("the tenant is no longer on %s (now %s on %s at epoch %d)", m.From, p.Phase, p.Shard, p.Epoch)
		return e.saveMove(ctx, m)
	}
	next := p
	next.Phase, next.Target, next.Move, next.Strategy, next.Source = schema.PhaseTakeover, m.To, m.Key(), m.Strategy, ""
	got, err := e.transition(ctx, m, "move.takeover", p, next)
	if err != nil {
		return err
	}
	w.fencedAt = time.Now()
	now := time.Now().UTC()
	m.State, m.Epoch, m.Handoff = MoveTakeover, p.Epoch, got.UpdatedAt
	if m.Started.IsZero() {
		m.Started = now
	}
	if m.Handoff.IsZero() {
		m.Handoff = now
	}
	return e.saveMove(ctx, m)
}

// takeover waits until the target is ready and no instance of the source can serve the tenant,
// then commits: takeover(from -> to) -> active(to, epoch+1). A target not ready within
// WarmTimeout, or without a live instance for targetGrace, fails the move; the placement stays
// in takeover (held) for a failover or a retake (rebalancer/autopilot) to give it another
// target.
func (e *Engine) takeover(ctx context.Context, m *MoveRecord, p schema.Placement, w *signalWatch) error {
	if w.fencedAt.IsZero() {
		// Resumed (this engine did not write the takeover): the lease counts from now, which is
		// no earlier than the write.
		w.fencedAt = time.Now()
	}
	lease := e.sourceLease(ctx, m.Kind, m.From)
	leaseEnd := w.fencedAt.Add(lease + lease/10 + leaseMargin)
	deadline := w.fencedAt.Add(e.cfg.WarmTimeout)
	var fenced, failed string
	var noTarget time.Time
	w.every = 50 * time.Millisecond // the lease runs out with nothing to wake on
	defer func() { w.every = 0 }()
	err := w.wait(ctx, deadline, func(v signalView) bool {
		if len(v.live[m.To]) == 0 || e.shardDown(m.Kind, m.To) {
			if noTarget.IsZero() {
				noTarget = time.Now()
			}
			if time.Since(noTarget) > targetGrace {
				failed = fmt.Sprintf("the target %s has no live instance", m.To)
				return true
			}
			return false
		}
		noTarget = time.Time{}
		if !v.all(m.To, func(s schema.TenantSignal) bool {
			return s.Phase == schema.SignalReady && s.Epoch == m.Epoch && s.Applied >= s.Fence
		}) {
			return false
		}
		switch {
		case v.all(m.From, func(s schema.TenantSignal) bool { return s.Phase == schema.SignalDrained && s.Epoch == m.Epoch }):
			fenced = "the former owner's live instances drained"
		case e.cfg.Presence != nil && e.cfg.Presence.GoneSince(m.Kind, m.From, w.fencedAt.Add(goneDelay)):
			fenced = "every instance of the former owner was gone (NATS closed their connections)"
		case !time.Now().Before(leaseEnd):
			fenced = fmt.Sprintf("the former owner's lease (%s) ran out", lease)
		default:
			return false
		}
		return true
	})
	if errors.Is(err, errTimeout) {
		failed = fmt.Sprintf("the target %s was not ready within %s", m.To, e.cfg.WarmTimeout)
	} else if err != nil {
		return err
	}
	if failed != "" {
		m.State, m.Finished = MoveFailed, time.Now().UTC()
		m.Reason = failed + "; the tenant stays in takeover (its requests held) until a failover or the autopilot's retake gives it another target"
		e.cfg.Logger.Warn("takeover failed", "move", m.Key(), "kind", m.Kind, "tenant", m.Tenant, "reason", m.Reason)
		return e.saveMove(ctx, m)
	}
	next := schema.Placement{Kind: p.Kind, Tenant: p.Tenant, Shard: m.To, Epoch: p.Epoch + 1, Phase: schema.PhaseActive, Pinned: p.Pinned}
	got, err := e.transition(ctx, m, "move.commit", p, next)
	if err != nil {
		return err
	}
	m.State, m.Fenced, m.Commit, m.Finished = MoveDone, fenced, got.UpdatedAt, time.Now().UTC()
	if m.Commit.IsZero() {
		m.Commit = m.Finished
	}
	e.cfg.Logger.Info("takeover committed", "move", m.Key(), "kind", m.Kind, "tenant", m.Tenant, "to", m.To,
		"epoch", got.Epoch, "fenced", fenced, "held", m.Pause().Round(time.Millisecond))
	return e.saveMove(ctx, m)
}

// sourceLease is the longest lease a takeover of kind's shard must wait out: the kind's, and
// any longer one its instances registered with (an instance started before the kind's lease
// was shortened).
func (e *Engine) sourceLease(ctx context.Context, kind, shard string) time.Duration {
	lease := schema.DefaultLease
	if kc, err := e.st.Kinds().Get(ctx, kind); err == nil {
		lease = kc.Lease.D()
	} else {
		e.cfg.Logger.Warn("reading the kind's lease for a takeover; waiting out the default or longer", "kind", kind, "err", err)
		lease = max(lease, 30*time.Second)
	}
	if e.cfg.Presence != nil {
		return max(lease, e.cfg.Presence.Shard(kind, shard).Lease)
	}
	insts, err := e.st.Directory().Instances(ctx, kind)
	if err != nil {
		e.cfg.Logger.Warn("reading the directory for a takeover's lease; waiting out 30s or longer", "kind", kind, "err", err)
		return max(lease, 30*time.Second)
	}
	for _, i := range insts {
		if i.Shard == shard {
			lease = max(lease, time.Duration(i.LeaseMS)*time.Millisecond)
		}
	}
	return lease
}
