package rebalancer

import (
	"context"
	"strings"
	"sync"

	"github.com/tenantmesh/tenantmesh/shardkit/kvwatch"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// sigHub is the tenant signals of every running move in memory, from one follower of the whole
// signal bucket shared by all of them. Signals exist only for tenants in a move, so the bucket
// stays small; a follower per move instead cost a consumer created and deleted through the
// JetStream API for every move (in a cluster, through its meta leader), which the scale
// harness showed to be what limited a plan's moves per second. It runs while at least one move
// holds it (acquire/release).
type sigHub struct {
	e *Engine
	shared

	mu       sync.Mutex
	byTenant map[string]map[string]schema.TenantSignal // "<kind>.<tenant>" -> instance key -> signal
	notify   map[string]chan struct{}                  // "<kind>.<tenant>" -> closed at its next change
	synced   bool
}

func newSigHub(e *Engine) *sigHub {
	return &sigHub{e: e, byTenant: map[string]map[string]schema.TenantSignal{}, notify: map[string]chan struct{}{}}
}

// acquire starts the hub if it is not running; every acquire needs a release.
func (h *sigHub) acquire() {
	h.shared.acquire(func() {
		h.mu.Lock()
		h.byTenant, h.synced = map[string]map[string]schema.TenantSignal{}, false
		h.mu.Unlock()
	}, func(ctx context.Context) { h.e.follow(ctx, schema.BucketTenantState, h) })
}

// Apply implements kvwatch.Handler.
func (h *sigHub) Apply(e kvwatch.Entry) {
	kind, rest, _ := strings.Cut(e.Key, ".") // <kind>.<tenant>.<shard>.<instance>
	tenant, _, _ := strings.Cut(rest, ".")
	kt := kind + "." + tenant
	h.mu.Lock()
	defer h.mu.Unlock()
	sigs := h.byTenant[kt]
	if sigs == nil {
		sigs = map[string]schema.TenantSignal{}
		h.byTenant[kt] = sigs
	}
	applySignal(sigs, e)
	if len(sigs) == 0 {
		delete(h.byTenant, kt)
	}
	if ch, ok := h.notify[kt]; ok {
		close(ch)
		delete(h.notify, kt)
	}
}

// Synced implements kvwatch.Handler.
func (h *sigHub) Synced() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.synced = true
	for kt, ch := range h.notify {
		close(ch)
		delete(h.notify, kt)
	}
}

// tenant returns a copy of tenant's signals (instance key -> signal), whether the hub has
// synced, and a channel closed at the tenant's next change.
func (h *sigHub) tenant(kind, tenant string) (map[string]schema.TenantSignal, bool, <-chan struct{}) {
	kt := kind + "." + tenant
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make(map[string]schema.TenantSignal, len(h.byTenant[kt]))
	for k, s := range h.byTenant[kt] {
		out[k] = s
	}
	ch, ok := h.notify[kt]
	if !ok {
		ch = make(chan struct{})
		h.notify[kt] = ch
	}
	return out, h.synced, ch
}
