package shardkit

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// signalView keeps in memory the tenant signals a move into this instance's shard waits for:
// its siblings' ready and the source's drained. It follows only its own shard's signal notes
// (core NATS, tm.signal.<kind>.<shard>: each signal as stored, published by its writer once
// tm_tenant_state acknowledged it; a source's drained also before its write). A waiter also reads the signals it needs from the bucket
// when it starts and every second, which covers a note lost on the way. So what an instance
// receives per move does not grow with the instances of its kind: following the kind's whole
// bucket cost every instance a delivery per signal of every move (5,583 deliveries per move at
// 996 instances, docs/scale.md).
type signalView struct {
	s *Shard

	mu       sync.Mutex
	byTenant map[string]map[string]schema.TenantSignal // tenant -> "<shard>.<instance>" -> signal
	seen     map[string]time.Time                      // tenant -> last change, for pruning
	notify   chan struct{}                             // closed and replaced on every change
}

// maxSignalTenants bounds the view: beyond it, tenants unchanged for signalKeep are forgotten,
// and if that is not enough, the quarter changed longest ago (a waiter among them reads its
// signals from the bucket again within a second).
const (
	maxSignalTenants = 4096
	signalKeep       = 10 * time.Minute
)

func newSignalView(s *Shard) *signalView {
	return &signalView{s: s, byTenant: map[string]map[string]schema.TenantSignal{},
		seen: map[string]time.Time{}, notify: make(chan struct{})}
}

// start subscribes to the shard's notes until ctx ends.
func (v *signalView) start(ctx context.Context, wg *sync.WaitGroup) error {
	sub, err := v.s.st.Signals().SubscribeNotes(v.s.kind, v.s.cfg.ID.Shard, v.apply)
	if err != nil {
		return fmt.Errorf("shardkit: %w", err)
	}
	wg.Go(func() {
		<-ctx.Done()
		_ = sub.Unsubscribe()
	})
	return nil
}

// fetch reads id's signal for tenant from the bucket (a direct get, which a replica behind may
// answer: the next read or note brings the newer one) and keeps it if it is newer.
func (v *signalView) fetch(ctx context.Context, tenant string, id schema.InstanceID) {
	fctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if sig, ok, err := v.s.st.Signals().Get(fctx, v.s.kind, tenant, id); err == nil && ok {
		v.apply(sig)
	}
}

// refresh reads tenant's signals from shard's instances named, from the bucket (when a wait
// starts and every second while it lasts; beside the wait, not before it, so a note that
// arrives meanwhile is seen at once).
func (v *signalView) refresh(ctx context.Context, tenant, shard string, instances []string) {
	for _, inst := range instances {
		if inst == v.s.cfg.ID.Instance && shard == v.s.cfg.ID.Shard {
			continue // its own signals are not waited for
		}
		v.fetch(ctx, tenant, schema.InstanceID{Kind: v.s.kind, Shard: shard, Instance: inst})
	}
}

// apply keeps sig when it is newer than the view's signal of its writer.
func (v *signalView) apply(sig schema.TenantSignal) {
	v.mu.Lock()
	defer v.mu.Unlock()
	m := v.byTenant[sig.Tenant]
	if m == nil {
		if len(v.byTenant) >= maxSignalTenants {
			v.prune(time.Now())
		}
		m = map[string]schema.TenantSignal{}
		v.byTenant[sig.Tenant] = m
	}
	key := sig.Shard + "." + sig.Instance
	if old, ok := m[key]; ok && !newer(old, sig) {
		return
	}
	m[key] = sig
	v.seen[sig.Tenant] = time.Now()
	close(v.notify)
	v.notify = make(chan struct{})
}

// newer reports whether sig replaces old, both from one writer. Stored signals go by revision.
// A note without one is a drained signal noted before its write (handoffTask): it replaces a
// signal of an older epoch, or of its epoch not drained yet, and only a signal of a later
// epoch, or its own stored, replaces it.
func newer(old, sig schema.TenantSignal) bool {
	switch {
	case sig.Revision == 0:
		return old.Epoch < sig.Epoch || (old.Epoch == sig.Epoch && old.Phase != schema.SignalDrained)
	case old.Revision == 0:
		return sig.Epoch > old.Epoch || (sig.Epoch == old.Epoch && sig.Phase == schema.SignalDrained)
	}
	return sig.Revision > old.Revision
}

// prune makes room (v.mu held).
func (v *signalView) prune(now time.Time) {
	for t, at := range v.seen {
		if now.Sub(at) > signalKeep {
			v.forget(t)
		}
	}
	if len(v.byTenant) < maxSignalTenants {
		return
	}
	byAge := slices.SortedFunc(maps.Keys(v.seen), func(a, b string) int { return v.seen[a].Compare(v.seen[b]) })
	for _, t := range byAge[:len(byAge)/4] {
		v.forget(t)
	}
}

func (v *signalView) forget(tenant string) {
	delete(v.seen, tenant)
	delete(v.byTenant, tenant)
}

// shard returns tenant's signals from shard's instances, keyed by instance name, and a channel
// closed at the next change.
func (v *signalView) shard(tenant, shard string) (map[string]schema.TenantSignal, <-chan struct{}) {
	v.mu.Lock()
	defer v.mu.Unlock()
	out := map[string]schema.TenantSignal{}
	for _, sig := range v.byTenant[tenant] {
		if sig.Shard == shard {
			out[sig.Instance] = sig
		}
	}
	return out, v.notify
}
