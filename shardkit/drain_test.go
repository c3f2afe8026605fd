package shardkit_test

import (
	"context"
	"encoding/json"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// POST /admin/drain stops new requests at once, waits for the slow one in flight, releases the
// tenant and reports drained; the tenant stays refused until undrained.
func TestDrainWaitsForInFlight(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	rev := place(t, st, schema.Placement{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1"}).Revision
	var released atomic.Int32
	hooks := shardkit.Hooks{
		Release: func(context.Context, string) error { released.Add(1); return nil },
		Applied: func(string) uint64 { return 42 },
	}
	a := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "a"), Hooks: hooks, AdminToken: testToken})
	synced(t, rev, a)
	sig := watchSignal(t, st, "aggregate", "t1", a.ID())

	slow := make(chan int, 1)
	go func() { code, _, _ := call(t, "GET", a.URL+"/t/slow", "t1", nil, ""); slow <- code }()
	<-a.app.entered

	if code, body := admin(t, "POST", a.URL+"/admin/drain?tenant_id=t1", testToken); code != http.StatusAccepted {
		t.Fatalf("drain: %d %s", code, body)
	}
	code, h, body := call(t, "GET", a.URL+"/t/x", "t1", nil, "")
	if p := problemOf(t, h, body); code != http.StatusServiceUnavailable || h.Get("Retry-After") == "" {
		t.Fatalf("new request while draining: %d %+v", code, p)
	}
	sig.next(t, "draining", phaseIs(schema.SignalDraining))
	var st1 shardkit.TenantStatus
	_, body = admin(t, "GET", a.URL+"/admin/drain?tenant_id=t1", testToken)
	if err := json.Unmarshal([]byte(body), &st1); err != nil || st1.Phase != "draining" || st1.InFlight != 1 {
		t.Fatalf("status while the slow request runs: %s", body)
	}
	if released.Load() != 0 {
		t.Fatal("released before the in-flight request finished")
	}

	close(a.app.release)
	if code := <-slow; code != http.StatusOK {
		t.Fatalf("the in-flight request: %d", code)
	}
	got := sig.next(t, "drained", func(s *schema.TenantSignal) bool { return s != nil && s.Phase != schema.SignalDraining })
	if got.Phase != schema.SignalDrained || got.InFlight != 0 || got.Fence != 42 {
		t.Fatalf("after the request: %+v", got)
	}
	if released.Load() != 1 {
		t.Fatalf("release hook ran %d times", released.Load())
	}
	_, body = admin(t, "GET", a.URL+"/admin/tenants", testToken)
	var list struct{ Tenants []shardkit.TenantStatus }
	if err := json.Unmarshal([]byte(body), &list); err != nil || len(list.Tenants) != 1 || list.Tenants[0].Phase != "drained" || list.Tenants[0].Requests != 1 {
		t.Fatalf("tenants: %s", body)
	}
	if code, _, _ := call(t, "GET", a.URL+"/t/x", "t1", nil, ""); code != http.StatusServiceUnavailable {
		t.Fatalf("request after drained: %d", code)
	}

	if code, body := admin(t, "DELETE", a.URL+"/admin/drain?tenant_id=t1", testToken); code != http.StatusNoContent {
		t.Fatalf("undrain: %d %s", code, body)
	}
	sig.next(t, "removed", func(s *schema.TenantSignal) bool { return s == nil })
	if code, _, _ := call(t, "GET", a.URL+"/t/x", "t1", nil, ""); code != http.StatusOK {
		t.Fatalf("request after undrain: %d", code)
	}
}

// A drain waits only up to DrainTimeout: a request that outlives it is reported, not waited for.
func TestDrainIsBounded(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	rev := place(t, st, schema.Placement{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1"}).Revision
	a := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "a"), DrainTimeout: 100 * time.Millisecond})
	synced(t, rev, a)
	sig := watchSignal(t, st, "aggregate", "t1", a.ID())
	slow := make(chan int, 1)
	go func() { code, _, _ := call(t, "GET", a.URL+"/t/slow", "t1", nil, ""); slow <- code }()
	<-a.app.entered
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	left, err := a.Drain(ctx, "t1")
	if err != nil || left != 1 {
		t.Fatalf("Drain = %d, %v; want 1 request left", left, err)
	}
	if s := sig.next(t, "drained", phaseIs(schema.SignalDrained)); s.InFlight != 1 {
		t.Fatalf("drained signal: %+v", s)
	}
	close(a.app.release)
	if code := <-slow; code != http.StatusOK {
		t.Fatalf("the request that outlived the drain: %d", code)
	}
}
