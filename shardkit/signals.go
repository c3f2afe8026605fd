package shardkit

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"

	"github.com/tenantmesh/tenantmesh/shardkit/kvwatch"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// signalView keeps the kind's tenant signals in memory from a standing watch, so a move's
// target learns the source's fence the moment it is written, without opening a watch (and
// listing the directory) on the handoff's critical path. Signals exist only for tenants in a
// move, so the view stays small.
type signalView struct {
	s      *Shard
	synced chan struct{}
	once   sync.Once

	mu       sync.Mutex
	byTenant map[string]map[string]schema.TenantSignal // tenant -> key -> signal
	notify   chan struct{}                             // closed and replaced on every change
}

func newSignalView(s *Shard) *signalView {
	return &signalView{s: s, synced: make(chan struct{}), byTenant: map[string]map[string]schema.TenantSignal{},
		notify: make(chan struct{})}
}

func (v *signalView) start(ctx context.Context, wg *sync.WaitGroup) error {
	f, err := kvwatch.New(kvwatch.Config{
		JS:     v.s.st.JS().JetStream(),
		Bucket: schema.BucketTenantState,
		Filter: v.s.kind + ".>",
		Logger: v.s.cfg.Logger.With("watch", schema.BucketTenantState),
	}, v)
	if err != nil {
		return fmt.Errorf("shardkit: %w", err)
	}
	wg.Go(func() { _ = f.Run(ctx) })
	return nil
}

func (v *signalView) waitReady(ctx context.Context) error {
	select {
	case <-v.synced:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("shardkit: waiting for the tenant signals: %w", ctx.Err())
	}
}

// Apply implements kvwatch.Handler.
func (v *signalView) Apply(e kvwatch.Entry) {
	parts := strings.Split(e.Key, ".") // <kind>.<tenant>.<shard>.<instance>
	if len(parts) != 4 {
		return
	}
	tenant := parts[1]
	v.mu.Lock()
	defer v.mu.Unlock()
	defer func() {
		close(v.notify)
		v.notify = make(chan struct{})
	}()
	var sig schema.TenantSignal
	if e.Op != kvwatch.Put || json.Unmarshal(e.Value, &sig) != nil {
		if m := v.byTenant[tenant]; m != nil {
			delete(m, e.Key)
			if len(m) == 0 {
				delete(v.byTenant, tenant)
			}
		}
		return
	}
	sig.Revision = e.Revision
	m := v.byTenant[tenant]
	if m == nil {
		m = map[string]schema.TenantSignal{}
		v.byTenant[tenant] = m
	}
	m[e.Key] = sig
}

// Synced implements kvwatch.Handler.
func (v *signalView) Synced() { v.once.Do(func() { close(v.synced) }) }

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
