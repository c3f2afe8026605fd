package schema

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
)

// SignalPhase is a tenant's state on one instance of a shard.
type SignalPhase string

const (
	SignalWarming  SignalPhase = "warming"
	SignalReady    SignalPhase = "ready"
	SignalDraining SignalPhase = "draining"
	SignalDrained  SignalPhase = "drained"
)

// TenantSignal is what one instance reports about one tenant, key
// <kind>.<tenant>.<shard>.<instance> in tm_tenant_state. (docs/design.md keys it per shard; a shard
// with several instances needs every live instance's word, so the key names the instance.)
type TenantSignal struct {
	Kind     string      `json:"kind"`
	Tenant   string      `json:"tenant"`
	Shard    string      `json:"shard"`
	Instance string      `json:"instance"`
	Phase    SignalPhase `json:"phase"`
	// Epoch is the placement epoch the signal refers to.
	Epoch uint64 `json:"epoch"`
	// Applied is the service's applied sequence for the tenant; Fence the one it must reach.
	Applied uint64 `json:"applied"`
	Fence   uint64 `json:"fence,omitempty"`
	// Lag is the number of the tenant's stream entries not yet applied.
	Lag      uint64    `json:"lag"`
	InFlight int       `json:"in_flight"`
	Updated  time.Time `json:"updated"`
	// Steps is the handoff's timeline as far as this signal's writer knows it: the source's
	// steps on its drained signal, the source's and the target's on the target's ready signal
	// at the handoff's epoch.
	Steps *HandoffSteps `json:"steps,omitempty"`

	Revision uint64 `json:"-"`
}

// HandoffSteps is when each step of a handoff happened on its shards, by their processes'
// clocks: where the pause goes. The handoff's own write and the commit are the placement's
// stamps (the NATS server's clock), so an offset across hosts includes their clocks' skew;
// the gaps between two steps of one process do not.
type HandoffSteps struct {
	// SourceSaw: the source's watcher applied the handoff (requests stop being admitted).
	SourceSaw time.Time `json:"source_saw,omitzero"`
	// SourceIdle: its requests in flight finished.
	SourceIdle time.Time `json:"source_idle,omitzero"`
	// SourceFenced: its fence was taken and the drained note sent to the target.
	SourceFenced time.Time `json:"source_fenced,omitzero"`
	// TargetSaw: the target's watcher applied the handoff.
	TargetSaw time.Time `json:"target_saw,omitzero"`
	// TargetNoted: the target had the source's fence (its note, or its signal in the bucket).
	TargetNoted time.Time `json:"target_noted,omitzero"`
	// TargetAtFence: the target had applied up to the fence.
	TargetAtFence time.Time `json:"target_at_fence,omitzero"`
	// TargetCommit: the target sent its commit (the placement's compare-and-set).
	TargetCommit time.Time `json:"target_commit,omitzero"`
}

// HandoffStepNames names the steps Gaps measures, in order.
var HandoffStepNames = [...]string{
	"the source's watcher applies the handoff (delivery)",
	"its requests in flight finish",
	"its fence is taken, its drained note sent",
	"the target has the note (one hop)",
	"the target has applied up to the fence",
	"the target sends its commit (its siblings at the fence, if it has any)",
}

// Gaps is how long each step took after the one before it (HandoffStepNames), the first from
// handoff, the handoff's write, the last to commit, the commit's stamp, when the target did not
// stamp its commit (a shard of several instances reports ready before its siblings are); a
// step stamped before its predecessor (another host's clock) counts as zero. ok is false when
// a step is missing (a takeover, a move committed by the rebalancer, an older release).
func (s *HandoffSteps) Gaps(handoff, commit time.Time) (gaps [len(HandoffStepNames)]time.Duration, ok bool) {
	if s == nil {
		return gaps, false
	}
	sent := s.TargetCommit
	if sent.IsZero() {
		sent = commit
	}
	at := [len(HandoffStepNames)]time.Time{s.SourceSaw, s.SourceIdle, s.SourceFenced, s.TargetNoted, s.TargetAtFence, sent}
	prev := handoff
	for i, t := range at {
		if t.IsZero() {
			return gaps, false
		}
		gaps[i] = max(0, t.Sub(prev))
		if t.After(prev) {
			prev = t
		}
	}
	return gaps, true
}

func (t TenantSignal) id() InstanceID {
	return InstanceID{Kind: t.Kind, Shard: t.Shard, Instance: t.Instance}
}

// Signals is the handle on the tenants' signals, the bucket tm_tenant_state (each instance's
// warming, ready, draining and drained reports of the tenants it hosts) and their notes on core
// NATS: store.Signals().Put(ctx, sig).
type Signals struct{ s *Store }

// Signals is the handle on the tenants' signals.
func (s *Store) Signals() Signals { return Signals{s} }

// Put writes an instance's signal for a tenant.
func (ss Signals) Put(ctx context.Context, sig TenantSignal) (TenantSignal, error) {
	if err := CheckTenant(sig.Tenant); err != nil {
		return TenantSignal{}, err
	}
	if err := sig.id().Check(); err != nil {
		return TenantSignal{}, err
	}
	sig.Updated = time.Now().UTC()
	rev, err := ss.s.js.Records(ss.s.signals).Put(ctx, signalKey(sig.Kind, sig.Tenant, sig.id()), sig)
	if err != nil {
		return TenantSignal{}, err
	}
	sig.Revision = rev
	return sig, nil
}

// Delete removes an instance's signal for a tenant (it no longer hosts it).
func (ss Signals) Delete(ctx context.Context, kind, tenant string, id InstanceID) error {
	if err := CheckTenant(tenant); err != nil {
		return err
	}
	return ss.s.js.Records(ss.s.signals).Delete(ctx, signalKey(kind, tenant, id), 0)
}

// List lists the signals of a tenant on one shard (every instance), or on every shard when
// shard is "".
func (ss Signals) List(ctx context.Context, kind, tenant, shard string) ([]TenantSignal, error) {
	if err := CheckTenant(tenant); err != nil {
		return nil, err
	}
	if err := CheckName("kind", kind); err != nil {
		return nil, err
	}
	filter := kind + "." + tenant + ".>"
	if shard != "" {
		if err := CheckName("shard", shard); err != nil {
			return nil, err
		}
		filter = SignalFilter(kind, tenant, shard)
	}
	var out []TenantSignal
	_, err := jsx.ListJSON(ctx, ss.s.js.Records(ss.s.signals), filter, func(_ string, rev uint64, t TenantSignal) {
		t.Revision = rev
		out = append(out, t)
	})
	return out, err
}

// Get reads one instance's signal for a tenant (a direct get, which any replica may answer).
// ok is false when there is none.
func (ss Signals) Get(ctx context.Context, kind, tenant string, id InstanceID) (sig TenantSignal, ok bool, err error) {
	if err := CheckTenant(tenant); err != nil {
		return TenantSignal{}, false, err
	}
	rev, err := ss.s.js.Records(ss.s.signals).Get(ctx, signalKey(kind, tenant, id), &sig)
	if errors.Is(err, ErrNotFound) {
		return TenantSignal{}, false, nil
	}
	if err != nil {
		return TenantSignal{}, false, err
	}
	sig.Revision = rev
	return sig, true, nil
}

// Note tells shard's instances (core NATS, no acknowledgement) that sig was written: the
// signal as stored, with its revision. Only shards of sig's kind may publish notes for its
// shards, and their credentials can already write the kind's placements, so a note is trusted
// as far as they are; a lost note is covered by the reader's direct reads of tm_tenant_state.
func (ss Signals) Note(shard string, sig TenantSignal) error {
	if err := CheckName("shard", shard); err != nil {
		return err
	}
	b, err := json.Marshal(noteOf(sig))
	if err != nil {
		return fmt.Errorf("schema: encode signal note: %w", err)
	}
	return ss.s.js.Conn().Publish(SignalNoteSubject(sig.Kind, shard), b)
}

// signalNote is a TenantSignal with its revision on the wire.
type signalNote struct {
	TenantSignal
	Rev uint64 `json:"revision"`
}

func noteOf(sig TenantSignal) signalNote { return signalNote{TenantSignal: sig, Rev: sig.Revision} }

// SubscribeNotes calls fn with each signal noted for shard of kind. fn runs on the
// subscription's goroutine and must not block. Malformed notes are dropped.
func (ss Signals) SubscribeNotes(kind, shard string, fn func(TenantSignal)) (*nats.Subscription, error) {
	if err := CheckName("shard", shard); err != nil {
		return nil, err
	}
	subj := SignalNoteSubject(kind, shard)
	sub, err := ss.s.js.Conn().Subscribe(subj, func(m *nats.Msg) {
		var n signalNote
		if json.Unmarshal(m.Data, &n) != nil || n.Kind != kind || CheckTenant(n.Tenant) != nil || n.id().Check() != nil {
			return
		}
		n.TenantSignal.Revision = n.Rev
		fn(n.TenantSignal)
	})
	if err != nil {
		return nil, fmt.Errorf("schema: subscribe %s: %w", subj, err)
	}
	return sub, nil
}

// SignalFilter is the watch filter for one tenant's signals on one shard.
func SignalFilter(kind, tenant, shard string) string { return kind + "." + tenant + "." + shard + ".*" }

// KV is one of the shared buckets the store opened, for watchers: BucketKinds, BucketInstances,
// BucketRoutes, BucketTenantState (the rebalancer awaits ready and drained there) or
// BucketRebalance. Any other name is nil; a kind's placements are Placements(kind).KV.
func (s *Store) KV(bucket string) jetstream.KeyValue {
	switch bucket {
	case BucketKinds:
		return s.kinds
	case BucketInstances:
		return s.instances
	case BucketRoutes:
		return s.routes
	case BucketTenantState:
		return s.signals
	case BucketRebalance:
		return s.rebalance
	}
	return nil
}
