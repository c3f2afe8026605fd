package shardkit_test

import (
	"context"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// fakeService is a stateful service's hooks: Warm catches up to the fence it is given.
type fakeService struct {
	applied  atomic.Uint64
	released atomic.Int32
	short    atomic.Int32 // Warm calls with a fence that get only halfway
	// gate, if set, holds each Warm call until the test lets it go (pass), so that the
	// signal written before it stays in place until the test has seen it: a watcher of a
	// bucket keeping one value per key can miss a value overwritten a moment later.
	gate   chan struct{}
	mu     sync.Mutex
	fences []uint64
}

// pass lets one held Warm call go.
func (f *fakeService) pass(t testing.TB) {
	t.Helper()
	select {
	case f.gate <- struct{}{}:
	case <-time.After(20 * time.Second):
		t.Fatal("no Warm call within 20s")
	}
}

func (f *fakeService) hooks() shardkit.Hooks {
	return shardkit.Hooks{
		Warm: func(ctx context.Context, _ string, fence uint64) error {
			if f.gate != nil {
				select {
				case <-f.gate:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			f.mu.Lock()
			f.fences = append(f.fences, fence)
			f.mu.Unlock()
			if f.applied.Load() < fence {
				if f.short.Add(-1) >= 0 {
					f.applied.Store(fence / 2)
				} else {
					f.applied.Store(fence)
				}
			}
			return nil
		},
		Applied: func(string) uint64 { return f.applied.Load() },
		Release: func(context.Context, string) error { f.released.Add(1); return nil },
	}
}

// A move A -> B: B refuses while warming and during handoff and serves only after the commit,
// at the new epoch; A stops at handoff, reports its fence, and after the commit releases and
// reports drained; B warms up to A's fence before it reports ready.
func TestMoveTargetAcceptsOnlyAfterCommit(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	src, dst := &fakeService{}, &fakeService{}
	src.applied.Store(7)
	dst.short.Store(1) // the first warm-up to the fence falls short: B reports its lag, retries
	dst.gate = make(chan struct{})
	p := place(t, st, schema.Placement{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1"})
	a := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "a"), Hooks: src.hooks()})
	b := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-2", "b"), Hooks: dst.hooks(), WarmRetry: 20 * time.Millisecond})
	synced(t, p.Revision, a, b)
	sigA := watchSignal(t, st, "aggregate", "t1", a.ID())
	sigB := watchSignal(t, st, "aggregate", "t1", b.ID())

	expect := func(s *testShard, epoch string, want int, owner string) {
		t.Helper()
		var hdr map[string]string
		if epoch != "" {
			hdr = map[string]string{tmhttp.HeaderEpoch: epoch}
		}
		code, h, body := call(t, "GET", s.URL+"/t/x", "t1", hdr, "")
		if code != want {
			t.Fatalf("%s (epoch %q): %d, want %d: %s", s.ID().Shard, epoch, code, want, body)
		}
		if want != http.StatusOK && owner != "" {
			if p := problemOf(t, h, body); p.Owner != owner {
				t.Fatalf("%s: owner %q, want %q", s.ID().Shard, p.Owner, owner)
			}
		}
	}
	expect(a, "1", http.StatusOK, "")
	expect(b, "1", http.StatusMisdirectedRequest, "aggregate-1")

	// warming: A serves, B warms and reports ready but refuses.
	p.Phase, p.Target = schema.PhaseWarming, "aggregate-2"
	p = place(t, st, p)
	synced(t, p.Revision, a, b)
	sigB.next(t, "warming", phaseIs(schema.SignalWarming))
	dst.pass(t)
	if s := sigB.next(t, "ready", phaseIs(schema.SignalReady)); s.Fence != 0 || s.Epoch != 1 {
		t.Fatalf("ready while warming: %+v", s)
	}
	expect(a, "1", http.StatusOK, "")
	expect(b, "1", http.StatusMisdirectedRequest, "aggregate-1")

	// handoff: both refuse (503, the gateway holds); A drains and reports its fence; B warms to it.
	p.Phase, p.Move, p.Pinned = schema.PhaseHandoff, "mv-1", true
	p = place(t, st, p)
	synced(t, p.Revision, a, b)
	expect(a, "1", http.StatusServiceUnavailable, "aggregate-2")
	expect(b, "1", http.StatusServiceUnavailable, "aggregate-2")
	if s := sigA.next(t, "drained at handoff", phaseIs(schema.SignalDrained)); s.Fence != 7 || s.Epoch != 1 {
		t.Fatalf("source at handoff: %+v", s)
	}
	dst.pass(t) // the first warm-up to the fence: it falls short
	if s := sigB.next(t, "warming short of the fence", func(s *schema.TenantSignal) bool { return s != nil && s.Fence > 0 }); s.Phase != schema.SignalWarming || s.Fence != 7 || s.Applied != 3 || s.Lag != 4 {
		t.Fatalf("target short of the fence: %+v", s)
	}
	if src.released.Load() != 0 {
		t.Fatal("the source released before the commit")
	}
	dst.pass(t) // the retry reaches it
	if s := sigB.next(t, "ready at the fence", func(s *schema.TenantSignal) bool { return s != nil && s.Fence > 0 && s.Phase == schema.SignalReady }); s.Fence != 7 || s.Applied < 7 {
		t.Fatalf("target at handoff: %+v", s)
	}

	// commit, by B itself at the fence: B serves at epoch 2, refuses epoch 1; A refuses, naming
	// B, and releases.
	p = awaitPlacement(t, st, "aggregate", "t1", func(p schema.Placement) bool {
		return p.Phase == schema.PhaseDraining && p.Shard == "aggregate-2" && p.Source == "aggregate-1" && p.Epoch == 2
	})
	if p.Move != "mv-1" || !p.Pinned || p.UpdatedBy != "shard/"+b.ID().Key() {
		t.Fatalf("the commit did not carry the handoff's move and pin on (it writes from the watcher's view): %+v", p)
	}
	synced(t, p.Revision, a, b)
	expect(b, "2", http.StatusOK, "")
	expect(b, "", http.StatusOK, "")
	expect(b, "1", http.StatusMisdirectedRequest, "aggregate-2")
	expect(a, "2", http.StatusMisdirectedRequest, "aggregate-2")
	if s := sigA.next(t, "drained after commit", func(s *schema.TenantSignal) bool { return s != nil && s.Epoch == 2 }); s.Phase != schema.SignalDrained {
		t.Fatalf("source after commit: %+v", s)
	}
	if src.released.Load() != 1 {
		t.Fatalf("source released %d times", src.released.Load())
	}

	// active(B): both clear their signals.
	p.Phase, p.Source = schema.PhaseActive, ""
	p = place(t, st, p)
	synced(t, p.Revision, a, b)
	sigA.next(t, "source signal removed", func(s *schema.TenantSignal) bool { return s == nil })
	sigB.next(t, "target signal removed", func(s *schema.TenantSignal) bool { return s == nil })
	expect(b, "2", http.StatusOK, "")
	dst.mu.Lock()
	defer dst.mu.Unlock()
	if !slices.Equal(dst.fences, []uint64{0, 7, 7}) {
		t.Fatalf("warm fences %v, want [0 7 7]", dst.fences)
	}
	if dst.released.Load() != 0 {
		t.Fatal("the target released the tenant it now owns")
	}
}

// An aborted move returns the tenant to the source, which accepts again; the target releases
// what it warmed.
func TestMoveAbort(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	src, dst := &fakeService{}, &fakeService{gate: make(chan struct{})}
	src.applied.Store(5)
	p := place(t, st, schema.Placement{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1"})
	a := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "a"), Hooks: src.hooks()})
	b := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-2", "b"), Hooks: dst.hooks()})
	sigA := watchSignal(t, st, "aggregate", "t1", a.ID())
	sigB := watchSignal(t, st, "aggregate", "t1", b.ID())
	p.Phase, p.Target = schema.PhaseWarming, "aggregate-2"
	p = place(t, st, p)
	dst.pass(t)
	sigB.next(t, "ready", phaseIs(schema.SignalReady))
	// At handoff B's warm-up to the fence is held (never passed), so B never commits.
	p.Phase = schema.PhaseHandoff
	p = place(t, st, p)
	sigA.next(t, "drained", phaseIs(schema.SignalDrained))
	p.Phase, p.Target = schema.PhaseActive, ""
	p = place(t, st, p)
	synced(t, p.Revision, a, b)
	sigA.next(t, "source signal removed", func(s *schema.TenantSignal) bool { return s == nil })
	sigB.next(t, "target signal removed", func(s *schema.TenantSignal) bool { return s == nil })
	if code, _, body := call(t, "GET", a.URL+"/t/x", "t1", nil, ""); code != http.StatusOK {
		t.Fatalf("source after abort: %d %s", code, body)
	}
	if code, _, _ := call(t, "GET", b.URL+"/t/x", "t1", nil, ""); code != http.StatusMisdirectedRequest {
		t.Fatalf("target after abort: %d", code)
	}
	if dst.released.Load() != 1 || src.released.Load() != 0 {
		t.Fatalf("released: target %d (want 1), source %d (want 0)", dst.released.Load(), src.released.Load())
	}
}
