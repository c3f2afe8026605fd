package schema

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
)

// Phase is where a tenant's placement stands in the move state machine:
//
//	active(A) -> warming(A->B) -> handoff(A->B) -> draining(B, epoch+1, from A) -> active(B)
//	warming or handoff -> active(A) aborts the move.
//	active(A), warming(A->*) or handoff(A->*) -> takeover(A->B) -> active(B, epoch+1): a
//	takeover, the move of a tenant off a shard with no live instance, without its drain.
type Phase string

const (
	PhaseActive   Phase = "active"
	PhaseWarming  Phase = "warming"
	PhaseHandoff  Phase = "handoff"
	PhaseDraining Phase = "draining"
	// PhaseTakeover: the owner (Shard) is fenced and the target (Target) takes the tenant at the
	// next epoch without the owner's drain. Nobody serves the tenant: gateways hold its
	// requests, the owner's instances refuse it (a live one reports drained, which lets the
	// takeover commit without waiting out its lease), the target loads the tenant from the
	// store and fences the owner's late writes there (shardkit Hooks.Takeover). The rebalancer
	// alone commits it, once the target is ready and no instance of the owner can still serve
	// (see docs/design.md, "Failover"). A takeover never goes back to the owner: once the
	// target may have fenced the owner's writes, the owner cannot write at its epoch again.
	PhaseTakeover Phase = "takeover"
)

// Moving reports whether a tenant in phase p is between owners, so nobody serves it and a
// gateway holds its requests (handoff, takeover).
func (p Phase) Moving() bool { return p == PhaseHandoff || p == PhaseTakeover }

// Placement is one tenant's owner for one kind, key <tenant> in tm_placement_<kind>.
type Placement struct {
	Kind   string `json:"kind"`
	Tenant string `json:"tenant"`
	// Shard is the owner: it serves the tenant at Epoch.
	Shard string `json:"shard"`
	// Epoch grows by one with every change of owner; it fences stale routers and owners.
	Epoch uint64 `json:"epoch"`
	Phase Phase  `json:"phase"`
	// Target is the shard a move goes to (warming, handoff, takeover).
	Target string `json:"target,omitempty"`
	// Source is the former owner finishing its drain (draining).
	Source string `json:"source,omitempty"`
	// Move names the move workflow that made the current phase.
	Move string `json:"move,omitempty"`
	// Strategy tells the move's target how to warm up ("snapshot", "replay"; "" = the
	// service's default). The rebalancer chooses it per move, from the tenant's size.
	Strategy string `json:"strategy,omitempty"`
	// Owners lists the instances serving the tenant under the affinity policy, as instance
	// keys (<kind>.<shard>.<instance>, InstanceID.Key), most recently used first, at most the
	// kind's multiplex.
	Owners []string `json:"owners,omitempty"`
	// Pinned tenants are never moved by a planner.
	Pinned    bool      `json:"pinned,omitempty"`
	UpdatedAt time.Time `json:"updated_at"`
	UpdatedBy string    `json:"updated_by,omitempty"`

	// Revision is the KV revision the value was read at (not stored).
	Revision uint64 `json:"-"`
}

// Validate checks the value on its own: names, phase and the fields each phase needs.
func (p Placement) Validate() error {
	if err := CheckName("kind", p.Kind); err != nil {
		return err
	}
	if err := CheckTenant(p.Tenant); err != nil {
		return err
	}
	if err := CheckName("shard", p.Shard); err != nil {
		return err
	}
	if p.Epoch == 0 {
		return fmt.Errorf("%w: %s/%s: epoch starts at 1", ErrInvalid, p.Kind, p.Tenant)
	}
	switch p.Phase {
	case PhaseActive:
		if p.Target != "" || p.Source != "" {
			return fmt.Errorf("%w: %s/%s: an active placement has no target or source", ErrInvalid, p.Kind, p.Tenant)
		}
	case PhaseWarming, PhaseHandoff, PhaseTakeover:
		if err := CheckName("target shard", p.Target); err != nil {
			return err
		}
		if p.Target == p.Shard {
			return fmt.Errorf("%w: %s/%s: target %s is already the owner", ErrInvalid, p.Kind, p.Tenant, p.Target)
		}
	case PhaseDraining:
		if err := CheckName("source shard", p.Source); err != nil {
			return err
		}
	default:
		return fmt.Errorf("%w: %s/%s: phase %q is not one of active, warming, handoff, draining, takeover", ErrInvalid, p.Kind, p.Tenant, p.Phase)
	}
	return nil
}

// CheckTransition enforces the move state machine and the epoch rules between a stored value
// and its replacement: the epoch changes only with the owner, and then by exactly one.
func CheckTransition(prev, next Placement) error {
	bad := func(why string) error {
		return fmt.Errorf("%w: %s/%s: %s -> %s: %s", ErrTransition, next.Kind, next.Tenant, prev.Phase, next.Phase, why)
	}
	if prev.Kind != next.Kind || prev.Tenant != next.Tenant {
		return bad("kind and tenant cannot change")
	}
	if next.Shard == prev.Shard {
		if next.Epoch != prev.Epoch {
			return bad(fmt.Sprintf("the owner stays %s, so the epoch must stay %d (got %d)", prev.Shard, prev.Epoch, next.Epoch))
		}
	} else if next.Epoch != prev.Epoch+1 {
		return bad(fmt.Sprintf("the owner changes %s -> %s, so the epoch must become %d (got %d)", prev.Shard, next.Shard, prev.Epoch+1, next.Epoch))
	}
	if next.Phase == PhaseTakeover {
		// A takeover starts from any phase in which the owner still serves or hands off, and
		// may change its target (the first one died); it keeps the owner and the epoch.
		switch prev.Phase {
		case PhaseActive, PhaseWarming, PhaseHandoff, PhaseTakeover:
			if next.Shard == prev.Shard {
				return nil
			}
			return bad("a takeover keeps the owner and the epoch")
		}
		return bad("a takeover starts from active, warming, handoff or takeover")
	}
	switch prev.Phase {
	case PhaseActive:
		switch next.Phase {
		case PhaseActive, PhaseWarming:
			return nil // owner edits (affinity, manual reassignment) or a move starts
		}
	case PhaseTakeover:
		if next.Phase == PhaseActive && next.Shard == prev.Target {
			return nil // the takeover's commit
		}
		return bad(fmt.Sprintf("a takeover ends with its target %s active at the next epoch (it never goes back to the fenced owner)", prev.Target))
	case PhaseWarming:
		switch next.Phase {
		case PhaseHandoff:
			if next.Shard == prev.Shard && next.Target == prev.Target {
				return nil
			}
			return bad("handoff keeps owner and target")
		case PhaseActive:
			if next.Shard == prev.Shard {
				return nil // abort
			}
			return bad("an abort keeps the owner")
		case PhaseWarming:
			if next.Shard == prev.Shard && next.Target == prev.Target {
				return nil
			}
			return bad("warming keeps owner and target")
		}
	case PhaseHandoff:
		switch next.Phase {
		case PhaseDraining:
			if next.Shard == prev.Target && next.Source == prev.Shard {
				return nil // commit
			}
			return bad(fmt.Sprintf("commit makes %s the owner with %s as the draining source", prev.Target, prev.Shard))
		case PhaseActive:
			if next.Shard == prev.Shard {
				return nil // abort
			}
			if next.Shard == prev.Target {
				return nil // commit that skips draining (nothing to drain)
			}
			return bad("handoff ends in its owner or its target")
		}
	case PhaseDraining:
		switch next.Phase {
		case PhaseActive:
			if next.Shard == prev.Shard {
				return nil
			}
			return bad("draining ends with the new owner active")
		case PhaseDraining:
			if next.Shard == prev.Shard && next.Source == prev.Source {
				return nil
			}
		}
	}
	return bad("not a step of the move state machine")
}

// Placements is the handle on one kind's placements, the bucket tm_placement_<kind>:
// store.Placements(kind).Latest(ctx, tenant). It is a small value, made for each use; the kind
// is checked, and its bucket opened (once per store), by the calls that need it.
type Placements struct {
	s    *Store
	kind string
}

// Placements is the handle on kind's placements.
func (s *Store) Placements(kind string) Placements { return Placements{s: s, kind: kind} }

// Kind is the kind whose placements the handle reaches.
func (ps Placements) Kind() string { return ps.kind }

// Get reads tenant's placement. Absent: ErrNotFound.
func (ps Placements) Get(ctx context.Context, tenant string) (Placement, error) {
	return ps.read(ctx, tenant, (*jsx.Records).Get)
}

// Latest is Get answered by the bucket's stream leader, so it sees every write acknowledged
// before the call (Get may be answered by a replica that is behind): for a writer about to
// compare-and-set on what it read.
func (ps Placements) Latest(ctx context.Context, tenant string) (Placement, error) {
	return ps.read(ctx, tenant, (*jsx.Records).Latest)
}

func (ps Placements) read(ctx context.Context, tenant string,
	get func(*jsx.Records, context.Context, string, any) (uint64, error)) (Placement, error) {
	if err := CheckTenant(tenant); err != nil {
		return Placement{}, err
	}
	kv, err := ps.KV(ctx)
	if err != nil {
		return Placement{}, err
	}
	var p Placement
	rev, err := get(ps.s.js.Records(kv), ctx, tenant, &p)
	if err != nil {
		return Placement{}, err
	}
	p.Revision = rev
	return p, nil
}

// own gives p the handle's kind if it has none; a placement of another kind is ErrInvalid.
func (ps Placements) own(p *Placement) error {
	if p.Kind == "" {
		p.Kind = ps.kind
	}
	if p.Kind != ps.kind {
		return fmt.Errorf("%w: %s/%s: not a placement of kind %s", ErrInvalid, p.Kind, p.Tenant, ps.kind)
	}
	return nil
}

// Create writes p only if the tenant has no placement. It returns p with its revision; if the
// tenant is already placed, a *ConflictError. p's kind is the handle's (an empty Kind takes it).
func (ps Placements) Create(ctx context.Context, p Placement) (Placement, error) {
	if err := ps.own(&p); err != nil {
		return Placement{}, err
	}
	if p.Phase == "" {
		p.Phase = PhaseActive
	}
	if p.Epoch == 0 {
		p.Epoch = 1
	}
	if p.UpdatedAt.IsZero() {
		p.UpdatedAt = time.Now().UTC()
	}
	if err := p.Validate(); err != nil {
		return Placement{}, err
	}
	kv, err := ps.KV(ctx)
	if err != nil {
		return Placement{}, err
	}
	rev, err := ps.s.js.Records(kv).Create(ctx, p.Tenant, p)
	if err != nil {
		return Placement{}, err
	}
	p.Revision = rev
	return p, nil
}

// Ensure creates p if the tenant is unplaced, else returns the placement that won. Every
// caller racing on the same tenant gets the same answer.
func (ps Placements) Ensure(ctx context.Context, p Placement) (_ Placement, created bool, _ error) {
	got, err := ps.Create(ctx, p)
	if err == nil {
		return got, true, nil
	}
	if !errors.Is(err, ErrConflict) {
		return Placement{}, false, err
	}
	got, err = ps.Get(ctx, p.Tenant)
	return got, false, err
}

// Update replaces prev (as read, with its Revision) by next, by compare-and-set on
// prev.Revision, after checking the transition. It returns next with its new revision. If the
// key changed since prev was read, the error is a *ConflictError. next's kind is the handle's
// (an empty Kind takes it).
func (ps Placements) Update(ctx context.Context, prev, next Placement) (Placement, error) {
	if err := ps.own(&next); err != nil {
		return Placement{}, err
	}
	next.UpdatedAt = time.Now().UTC()
	if err := next.Validate(); err != nil {
		return Placement{}, err
	}
	if err := CheckTransition(prev, next); err != nil {
		return Placement{}, err
	}
	if prev.Revision == 0 {
		return Placement{}, fmt.Errorf("%w: %s/%s: prev has no revision; pass the placement as read", ErrInvalid, prev.Kind, prev.Tenant)
	}
	kv, err := ps.KV(ctx)
	if err != nil {
		return Placement{}, err
	}
	rev, err := ps.s.js.Records(kv).CompareAndSet(ctx, next.Tenant, prev.Revision, next)
	if err != nil {
		return Placement{}, err
	}
	next.Revision = rev
	return next, nil
}

// Delete removes the tenant's placement if its revision is still rev (0: any).
func (ps Placements) Delete(ctx context.Context, tenant string, rev uint64) error {
	if err := CheckTenant(tenant); err != nil {
		return err
	}
	kv, err := ps.KV(ctx)
	if err != nil {
		return err
	}
	return ps.s.js.Records(kv).Delete(ctx, tenant, rev)
}

// List lists every placement of the kind (for planners and tools; routers use the watcher),
// with the number of entries that could not be decoded.
func (ps Placements) List(ctx context.Context) ([]Placement, int, error) {
	kv, err := ps.KV(ctx)
	if err != nil {
		return nil, 0, err
	}
	var out []Placement
	corrupt, err := jsx.ListJSON(ctx, ps.s.js.Records(kv), ">", func(_ string, rev uint64, p Placement) {
		p.Revision = rev
		out = append(out, p)
	})
	return out, corrupt, err
}

// KV opens the kind's placement bucket, for writers and watchers. It exists only for
// registered kinds: others are ErrUnknownKind.
func (ps Placements) KV(ctx context.Context) (jetstream.KeyValue, error) {
	s, kind := ps.s, ps.kind
	if err := CheckName("kind", kind); err != nil {
		return nil, err
	}
	s.mu.Lock()
	kv, ok := s.placements[kind]
	s.mu.Unlock()
	if ok {
		return kv, nil
	}
	if _, err := s.Kinds().Get(ctx, kind); err != nil {
		return nil, err
	}
	return s.placementKVCreate(ctx, kind)
}
