package shardkit_test

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// setLease registers kind aggregate with a lease of d.
func setLease(t testing.TB, st *schema.Store, d time.Duration) {
	t.Helper()
	kc := schema.DefaultKindConfig("aggregate")
	kc.Lease = schema.Duration(d)
	if _, err := st.Kinds().Put(context.Background(), kc); err != nil {
		t.Fatal(err)
	}
}

// An instance cut off from NATS stops serving its tenants within its lease (a takeover of
// them waits that long, so they are never served twice), says why, and serves again once it
// confirms its view of placement with the stream leader.
func TestLeaseRunsOutWithoutNATS(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	setLease(t, st, time.Second)
	a := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "a"), Confirm: 100 * time.Millisecond})
	rev := place(t, st, schema.Placement{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1"}).Revision
	synced(t, rev, a)
	if code, _, body := call(t, "GET", a.URL+"/t/x", "t1", nil, ""); code != http.StatusOK {
		t.Fatalf("before: %d %s", code, body)
	}
	cfg := srv.Config()
	srv.Stop()
	stopped := time.Now()
	var code int
	var hdr http.Header
	var body string
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("the instance refusing once its lease ran out", func() bool {
		code, hdr, body = call(t, "GET", a.URL+"/t/x", "t1", nil, "")
		return code == http.StatusServiceUnavailable
	}))
	// The lease counts from the last confirmation before the stop: Confirm earlier, or more
	// when a loaded machine ran the confirming tick late. Half the lease tells an instance that
	// serves out its lease from one that refuses as soon as NATS is gone.
	held := time.Since(stopped)
	if held < 500*time.Millisecond {
		t.Fatalf("refused %s after NATS stopped: well before its lease of 1s (confirmed every 100ms) ran out", held)
	}
	t.Logf("refused %s after NATS stopped (lease 1s, confirmed every 100ms)", held.Round(time.Millisecond))
	if hdr.Get(tmhttp.HeaderRefused) != "unconfirmed" || hdr.Get("Retry-After") == "" {
		t.Fatalf("refusal: %d %v %s", code, hdr, body)
	}
	if p := problemOf(t, hdr, body); p.Type != tmhttp.TypeBase+"lease-expired" {
		t.Fatalf("problem %+v", p)
	}
	natstest.Restart(t, cfg)
	tmtest.WaitFor(t, 20*time.Second, tmtest.Until("serving again after NATS came back", func() bool {
		code, _, _ := call(t, "GET", a.URL+"/t/x", "t1", nil, "")
		return code == http.StatusOK
	}))
	_ = a.stop(t) // before the restarted server's cleanup stops it
}

// A request admitted before a takeover of its tenant does not answer from stale state: its
// answer is withheld (503, no X-Tm-Refused: the service saw it) when it begins after the
// takeover was written. A takeover's target fences the former owner (Hooks.Takeover, at the
// next epoch), warms up to the fence it names and reports ready; the former owner, alive after
// all, reports drained, so the takeover need not wait out its lease.
func TestTakeoverOfALiveOwner(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	var fencedAt atomic.Uint64
	var applied atomic.Uint64
	hooks := shardkit.Hooks{
		Takeover: func(_ context.Context, tenant string, epoch uint64) (uint64, error) {
			fencedAt.Store(epoch)
			return 42, nil
		},
		Warm: func(_ context.Context, tenant string, fence uint64) error {
			applied.Store(max(applied.Load(), fence))
			return nil
		},
		Applied: func(string) uint64 { return applied.Load() },
	}
	a := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "a")})
	b := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-2", "b"), Hooks: hooks})
	p := place(t, st, schema.Placement{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1"})
	synced(t, p.Revision, a, b)

	type answer struct {
		code int
		hdr  http.Header
		body string
	}
	slow := make(chan answer, 1)
	go func() {
		code, hdr, body := call(t, "GET", a.URL+"/t/slow", "t1", nil, "")
		slow <- answer{code, hdr, body}
	}()
	select {
	case <-a.app.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the slow request did not reach the service")
	}
	aSig := watchSignal(t, st, "aggregate", "t1", a.ID())
	bSig := watchSignal(t, st, "aggregate", "t1", b.ID())
	next := p
	next.Phase, next.Target, next.Move = schema.PhaseTakeover, "aggregate-2", "test/m1"
	p = place(t, st, next)
	synced(t, p.Revision, a, b)
	a.app.release <- struct{}{}
	got := <-slow
	if got.code != http.StatusServiceUnavailable || got.hdr.Get(tmhttp.HeaderRefused) != "" {
		t.Fatalf("the answer of a request admitted before the takeover: %d refused=%q %s", got.code, got.hdr.Get(tmhttp.HeaderRefused), got.body)
	}
	if pr := problemOf(t, got.hdr, got.body); pr.Type != tmhttp.TypeBase+"answer-withheld" {
		t.Fatalf("problem %+v", pr)
	}
	if code, hdr, body := call(t, "GET", a.URL+"/t/x", "t1", nil, ""); code != http.StatusServiceUnavailable || hdr.Get(tmhttp.HeaderRefused) != "handoff" {
		t.Fatalf("a new request at the former owner during the takeover: %d %v %s", code, hdr, body)
	}
	ready := bSig.next(t, "the target ready at the fence", func(s *schema.TenantSignal) bool {
		return s != nil && s.Phase == schema.SignalReady && s.Epoch == p.Epoch
	})
	if ready.Fence != 42 || ready.Applied < 42 || fencedAt.Load() != p.Epoch+1 {
		t.Fatalf("target ready %+v; Takeover called at epoch %d (want %d)", ready, fencedAt.Load(), p.Epoch+1)
	}
	aSig.next(t, "the live former owner drained", func(s *schema.TenantSignal) bool {
		return s != nil && s.Phase == schema.SignalDrained && s.Epoch == p.Epoch
	})
	// The commit (the rebalancer's): the target serves at the next epoch, the former owner
	// refuses naming it.
	done := p
	done.Phase, done.Shard, done.Target, done.Move, done.Epoch = schema.PhaseActive, "aggregate-2", "", "", p.Epoch+1
	p = place(t, st, done)
	synced(t, p.Revision, a, b)
	if code, _, body := call(t, "GET", b.URL+"/t/x", "t1", nil, ""); code != http.StatusOK {
		t.Fatalf("the new owner: %d %s", code, body)
	}
	if code, hdr, body := call(t, "GET", a.URL+"/t/x", "t1", nil, ""); code != http.StatusMisdirectedRequest || problemOf(t, hdr, body).Owner != "aggregate-2" {
		t.Fatalf("the former owner after the commit: %d %s", code, body)
	}
}
