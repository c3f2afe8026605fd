package gateway

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

func newTestHold(lim HoldLimits) (*holdBuffer, *kindEntry) {
	m := newMetrics(&Gateway{}, nil)
	return newHoldBuffer(lim, m), &kindEntry{name: "k", metrics: m.forKind("k")}
}

// TestHoldBounds: per-tenant and overall byte bounds turn requests away at once (503).
func TestHoldBounds(t *testing.T) {
	h, ke := newTestHold(HoldLimits{PerTenantBytes: 10, TotalBytes: 15})
	held := func() bool { return true }
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	results := make(chan error, 3)
	go func() { _, err := h.wait(ctx, ke, "a", 6, time.Minute, held); results <- err }()
	waitHeld(t, h, 1)
	var te *tmhttp.Error
	if _, err := h.wait(ctx, ke, "a", 6, time.Minute, held); err == nil || !asTM(err, &te) || te.Status != http.StatusServiceUnavailable {
		t.Fatalf("over the tenant's bytes: %v", err)
	}
	go func() { _, err := h.wait(ctx, ke, "b", 9, time.Minute, held); results <- err }()
	waitHeld(t, h, 2)
	if _, err := h.wait(ctx, ke, "c", 1, time.Minute, held); err == nil {
		t.Fatal("over the total bytes: held")
	}
	cancel()
	for range 2 {
		if err := <-results; err != context.Canceled {
			t.Fatalf("canceled wait: %v", err)
		}
	}
	if n, b, q := h.stats(); n != 0 || b != 0 || q != 0 {
		t.Fatalf("after cancel: %d held, %d bytes, %d queues", n, b, q)
	}
}

// TestHoldOrder: released requests go one at a time in arrival order; one that expired in the
// middle is skipped; requests arriving while the backlog drains queue behind it.
func TestHoldOrder(t *testing.T) {
	h, ke := newTestHold(HoldLimits{})
	var released atomic.Bool
	stillHeld := func() bool { return !released.Load() }
	order := make(chan int, 8)
	tickets := make(chan *held, 8)
	start := func(i int, budget time.Duration) {
		go func() {
			it, err := h.wait(context.Background(), ke, "t", 0, budget, stillHeld)
			if err != nil {
				order <- -i
				return
			}
			order <- i
			tickets <- it
		}()
	}
	start(1, time.Minute)
	waitHeld(t, h, 1)
	start(2, 50*time.Millisecond) // gives up before the release
	waitHeld(t, h, 2)
	start(3, time.Minute)
	waitHeld(t, h, 3)
	if got := <-order; got != -2 {
		t.Fatalf("first outcome %d, want request 2 expiring", got)
	}
	h.release("k", "t", false)
	if got := <-order; got != 1 {
		t.Fatalf("released first: %d", got)
	}
	released.Store(true)
	start(4, time.Minute) // arrives while the backlog drains: queues behind 3
	waitHeld(t, h, 3)     // 1 (dispatching), 3, 4
	select {
	case got := <-order:
		t.Fatalf("request %d let go while 1 was still dispatching", got)
	default:
	}
	for _, want := range []int{3, 4} {
		h.done(ke, <-tickets)
		if got := <-order; got != want {
			t.Fatalf("next released %d, want %d", got, want)
		}
	}
	h.done(ke, <-tickets)
	if n, _, q := h.stats(); n != 0 || q != 0 || h.active.Load() != 0 {
		t.Fatalf("after all done: %d held, %d queues", n, q)
	}
}

func waitHeld(t *testing.T, h *holdBuffer, n int) {
	t.Helper()
	eventually(t, 5*time.Second, "held requests", func() bool { c, _, _ := h.stats(); return c == n })
}

func asTM(err error, te **tmhttp.Error) bool {
	e, ok := err.(*tmhttp.Error)
	*te = e
	return ok
}
