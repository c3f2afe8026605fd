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

	refMu  sync.Mutex
	refs   int
	cancel context.CancelFunc
	done   sync.WaitGroup

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
	h.refMu.Lock()
	defer h.refMu.Unlock()
	if h.refs++; h.refs > 1 {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	h.cancel = cancel
	h.mu.Lock()
	h.byTenant, h.synced = map[string]map[string]schema.TenantSignal{}, false
	h.mu.Unlock()
	h.done.Go(func() { h.follow(ctx) })
}

// release stops the hub once no move holds it.
func (h *sigHub) release() {
	h.refMu.Lock()
	defer h.refMu.Unlock()
	if h.refs--; h.refs > 0 {
		return
	}
	h.cancel()
	h.done.Wait()
}

// follow applies the signals from a kvwatch follower (an ordered KV watch can stall for 8-17 s
// after a NATS server dies, holding a handoff that long; a follower notices within a second
// and resumes).
func (h *sigHub) follow(ctx context.Context) {
	f, err := kvwatch.New(kvwatch.Config{
		JS:     h.e.st.JS().JetStream(),
		Bucket: schema.BucketTenantState,
		Logger: h.e.cfg.Logger.With("watch", schema.BucketTenantState),
	}, h)
	if err != nil {
		h.e.cfg.Logger.Error("watching the tenant signals", "err", err)
		return
	}
	_ = f.Run(ctx)
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
