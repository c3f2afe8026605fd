package shardkit_test

import (
	"net/http"
	"strconv"
	"testing"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// An instance serves only the tenants its shard owns at the request's epoch; others get 421
// problem+json naming the owner and epoch.
func TestGateServesOnlyOwnedTenants(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	place(t, st, schema.Placement{Kind: "aggregate", Tenant: "mine", Shard: "aggregate-1"})
	rev := place(t, st, schema.Placement{Kind: "aggregate", Tenant: "theirs", Shard: "aggregate-2"}).Revision
	a := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "a")})
	synced(t, rev, a)

	code, h, body := call(t, "GET", a.URL+"/t/x", "mine", nil, "")
	if code != http.StatusOK || h.Get(tmhttp.HeaderServedBy) != "aggregate.aggregate-1.a" {
		t.Fatalf("owned tenant: %d %q %s", code, h.Get(tmhttp.HeaderServedBy), body)
	}
	code, _, _ = call(t, "GET", a.URL+"/t/x", "mine", map[string]string{tmhttp.HeaderEpoch: "1"}, "")
	if code != http.StatusOK {
		t.Fatalf("owned tenant at its epoch: %d", code)
	}

	code, h, body = call(t, "GET", a.URL+"/t/x", "theirs", nil, "")
	p := problemOf(t, h, body)
	if code != http.StatusMisdirectedRequest || p.Owner != "aggregate-2" || p.Epoch != 1 || p.Tenant != "theirs" || p.Kind != "aggregate" {
		t.Fatalf("other shard's tenant: %d %+v", code, p)
	}

	code, h, body = call(t, "GET", a.URL+"/t/x", "nobody", nil, "")
	if p := problemOf(t, h, body); code != http.StatusMisdirectedRequest || p.Owner != "" {
		t.Fatalf("unplaced tenant: %d %+v", code, p)
	}

	for _, bad := range []struct{ tenant, epoch string }{{"", ""}, {"no/slash", ""}, {"mine", "x"}, {"mine", "0"}} {
		code, h, body = call(t, "GET", a.URL+"/t/x", bad.tenant, map[string]string{tmhttp.HeaderEpoch: bad.epoch}, "")
		if problemOf(t, h, body); code != http.StatusBadRequest {
			t.Fatalf("tenant %q epoch %q: %d %s", bad.tenant, bad.epoch, code, body)
		}
	}
	if n := a.app.calls.Load(); n != 2 {
		t.Fatalf("the service saw %d requests, want 2", n)
	}
}

// A request carrying an epoch newer than the instance's snapshot waits for the snapshot; one
// carrying an older epoch is refused.
func TestGateJudgesEpochs(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	rev := place(t, st, schema.Placement{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-2"}).Revision
	a := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "a")})
	synced(t, rev, a)

	type result struct {
		code int
		body string
	}
	res := make(chan result, 1)
	go func() {
		// The gateway already knows epoch 2 (owner aggregate-1); this instance learns it later.
		code, _, body := call(t, "GET", a.URL+"/t/x", "t1", map[string]string{tmhttp.HeaderEpoch: "2"}, "")
		res <- result{code, body}
	}()
	rev = place(t, st, schema.Placement{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1", Epoch: 2, Phase: schema.PhaseActive}).Revision
	if r := <-res; r.code != http.StatusOK {
		t.Fatalf("newer epoch: %d %s", r.code, r.body)
	}
	synced(t, rev, a)

	code, h, body := call(t, "GET", a.URL+"/t/x", "t1", map[string]string{tmhttp.HeaderEpoch: "1"}, "")
	if p := problemOf(t, h, body); code != http.StatusMisdirectedRequest || p.Owner != "aggregate-1" || p.Epoch != 2 {
		t.Fatalf("stale epoch: %d %+v", code, p)
	}
	code, h, body = call(t, "GET", a.URL+"/t/x", "t1", map[string]string{tmhttp.HeaderEpoch: strconv.Itoa(9)}, "")
	if p := problemOf(t, h, body); code != http.StatusServiceUnavailable || h.Get("Retry-After") == "" {
		t.Fatalf("epoch never seen: %d %+v", code, p)
	}
}
