package shardkit_test

import (
	"context"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// deadURL is an address where nothing listens: connections are refused.
func deadURL(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return "http://" + addr
}

// In forward mode any instance answers: a request for another shard's tenant is proxied to a
// live instance of the owner (retrying past a dead one), and a forwarded request is never
// forwarded again.
func TestForwardReachesOwnerWithoutLoops(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	place(t, st, schema.Placement{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1"})
	place(t, st, schema.Placement{Kind: "aggregate", Tenant: "t3", Shard: "aggregate-3"})
	rev := place(t, st, schema.Placement{Kind: "aggregate", Tenant: "t2", Shard: "aggregate-2"}).Revision
	// A registered instance of the owner that refuses connections: forwards must retry past it.
	if _, err := st.Directory().Register(ctx, schema.Instance{InstanceID: id("aggregate-1", "dead"), URL: deadURL(t), Capacity: 10}); err != nil {
		t.Fatal(err)
	}
	// aggregate-3's only instance is dead: its tenant's forward reaches no one.
	if _, err := st.Directory().Register(ctx, schema.Instance{InstanceID: id("aggregate-3", "dead"), URL: deadURL(t), Capacity: 10}); err != nil {
		t.Fatal(err)
	}
	a := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "a"), Forward: true})
	b := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-2", "b"), Forward: true})
	synced(t, rev, a, b)

	for i := range 4 { // the round-robin starts at the dead instance at least once
		code, h, body := call(t, "POST", b.URL+"/t/x", "t1", nil, "payload")
		if code != http.StatusOK || h.Get(tmhttp.HeaderServedBy) != "aggregate.aggregate-1.a" || body != "ok t1 payload" {
			t.Fatalf("forward %d: %d served by %q: %s", i, code, h.Get(tmhttp.HeaderServedBy), body)
		}
		if got := h.Get(tmhttp.HeaderForwardedBy); got != "aggregate.aggregate-2.b" {
			t.Fatalf("response x-forwarded-by %q", got)
		}
		// The owner ran it: a gateway reading a refusal mark here would send it again.
		if got := h.Values(tmhttp.HeaderRefused); len(got) != 0 {
			t.Fatalf("the owner's answer, forwarded, is marked refused: %q", got)
		}
		if got := a.app.forwarded.Load(); got != "aggregate.aggregate-2.b" {
			t.Fatalf("owner saw x-forwarded-by %q", got)
		}
	}
	if n := b.app.calls.Load(); n != 0 {
		t.Fatalf("the non-owner's service ran %d times", n)
	}
	if _, _, metrics := call(t, "GET", b.URL+"/metrics", "", nil, ""); !strings.Contains(metrics, `tm_shard_forwarded_total{result="retry"}`) {
		t.Fatal("no forward was retried past the dead instance")
	}

	// A forward that reached no instance keeps the refusal mark: sending it again is safe.
	code, h, body := call(t, "POST", b.URL+"/t/x", "t3", nil, "payload")
	if code != http.StatusBadGateway || h.Get(tmhttp.HeaderRefused) != "not_owner" {
		t.Fatalf("a forward to no live instance: %d, refusal mark %q: %s", code, h.Get(tmhttp.HeaderRefused), body)
	}

	// Already forwarded once: answered here, never forwarded again.
	before := a.app.calls.Load()
	code, h, body = call(t, "GET", b.URL+"/t/x", "t1", map[string]string{tmhttp.HeaderForwardedBy: "aggregate.aggregate-9.z"}, "")
	if p := problemOf(t, h, body); code != http.StatusMisdirectedRequest || p.Owner != "aggregate-1" {
		t.Fatalf("second hop: %d %+v", code, p)
	}
	code, h, body = call(t, "GET", a.URL+"/t/x", "t2", map[string]string{tmhttp.HeaderForwardedBy: "aggregate.aggregate-1.a"}, "")
	if problemOf(t, h, body); code != http.StatusLoopDetected {
		t.Fatalf("loop through itself: %d %s", code, body)
	}
	if a.app.calls.Load() != before || b.app.calls.Load() != 0 {
		t.Fatal("a refused forward reached a service")
	}

	// The owner's own requests are served locally.
	code, h, _ = call(t, "GET", b.URL+"/t/x", "t2", nil, "")
	if code != http.StatusOK || h.Get(tmhttp.HeaderForwardedBy) != "" || !strings.HasSuffix(h.Get(tmhttp.HeaderServedBy), ".b") {
		t.Fatalf("local tenant: %d %v", code, h)
	}
}

// Forward mode's timeouts are the kind's (the Queen coordinator's connect_timeout and
// forward_timeout, 1 s and 5 s by default), not fixed ones: a peer that does not accept the
// connection is given up after the kind's connect timeout, so the next one still answers within
// the forward's bound; and an owner that does not answer is a 504 once the kind's forward
// timeout has passed.
func TestForwardTimeoutsFromKind(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	kc := schema.DefaultKindConfig("aggregate")
	kc.Load = schema.KindConfig{Kind: "aggregate", Policy: schema.PolicyLoad}.WithDefaults().Load
	kc.Load.ForwardTimeout, kc.Load.ConnectTimeout = schema.Duration(800*time.Millisecond), schema.Duration(150*time.Millisecond)
	if _, err := st.Kinds().Put(ctx, kc); err != nil {
		t.Fatal(err)
	}
	rev := place(t, st, schema.Placement{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1"}).Revision
	// An instance of the owner whose connections are never accepted (not refused): only the
	// connect timeout ends an attempt there.
	if _, err := st.Directory().Register(ctx, schema.Instance{InstanceID: id("aggregate-1", "hole"), URL: "http://" + tmtest.Unaccepted(t), Capacity: 10}); err != nil {
		t.Fatal(err)
	}
	a := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "a")})
	b := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-2", "b"), Forward: true})
	synced(t, rev, a, b)
	for i := range 4 { // the peers' order starts at the black hole at least once
		if code, h, body := call(t, "GET", b.URL+"/t/x", "t1", nil, ""); code != http.StatusOK || h.Get(tmhttp.HeaderServedBy) != "aggregate.aggregate-1.a" {
			t.Fatalf("forward %d past a peer that never connects: %d %s", i, code, body)
		}
	}
	code, _, body := call(t, "GET", b.URL+"/t/slow", "t1", nil, "")
	if code != http.StatusGatewayTimeout {
		t.Fatalf("a forward to an owner that does not answer: %d %s, want 504 after the kind's forward timeout", code, body)
	}
}
