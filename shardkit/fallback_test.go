package shardkit_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// brokenURL is an address that accepts connections and closes them at once: a request reaches
// the instance and gets no answer. accepted counts the connections.
func brokenURL(t *testing.T) (string, *atomic.Int64) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var accepted atomic.Int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			_ = c.Close()
		}
	}()
	t.Cleanup(func() { _ = ln.Close(); <-done })
	return "http://" + ln.Addr().String(), &accepted
}

// With ForwardFallback, an instance serves a forwarded tenant itself when the owner fails twice
// in a way that is safe to repeat, or has no live instance, and says so with X-Fallback; it
// never falls back when the request may have reached the owner's service.
func TestForwardFallback(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	const kind = "projection"
	pid := func(shard, inst string) schema.InstanceID {
		return schema.InstanceID{Kind: kind, Shard: shard, Instance: inst}
	}
	broken, accepted := brokenURL(t)
	// t-dead's owner refuses connections; t-broken's three instances close them; t-gone's owner has
	// no instance.
	place(t, st, schema.Placement{Kind: kind, Tenant: "t-dead", Shard: "projection-1"})
	place(t, st, schema.Placement{Kind: kind, Tenant: "t-broken", Shard: "projection-2"})
	rev := place(t, st, schema.Placement{Kind: kind, Tenant: "t-gone", Shard: "projection-9"}).Revision
	for _, in := range []schema.Instance{
		{InstanceID: pid("projection-1", "dead"), URL: deadURL(t), Capacity: 10},
		{InstanceID: pid("projection-2", "broken"), URL: broken, Capacity: 10},
		{InstanceID: pid("projection-2", "broken2"), URL: broken, Capacity: 10},
		{InstanceID: pid("projection-2", "broken3"), URL: broken, Capacity: 10},
	} {
		if _, err := st.Directory().Register(ctx, in); err != nil {
			t.Fatal(err)
		}
	}
	fb := startShard(t, shardkit.Config{Store: st, ID: pid("projection-3", "fb"), Forward: true, ForwardFallback: true})
	plain := startShard(t, shardkit.Config{Store: st, ID: pid("projection-4", "plain"), Forward: true})
	synced(t, rev, fb, plain)

	cases := []struct {
		name, method, tenant, body string
		fallback                   bool
		code                       int
	}{
		{"connection refused, GET", "GET", "t-dead", "", true, http.StatusOK},
		{"connection refused, POST keeps its body", "POST", "t-dead", "payload", true, http.StatusOK},
		{"no live instance", "GET", "t-gone", "", true, http.StatusOK},
		{"reached the owner, GET is idempotent", "GET", "t-broken", "", true, http.StatusOK},
		{"reached the owner, POST may have run there", "POST", "t-broken", "payload", false, http.StatusBadGateway},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before, conns := fb.app.calls.Load(), accepted.Load()
			code, h, body := call(t, c.method, fb.URL+"/t/x", c.tenant, nil, c.body)
			if code != c.code || (h.Get(tmhttp.HeaderFallback) == "true") != c.fallback {
				t.Fatalf("%d fallback=%q: %s", code, h.Get(tmhttp.HeaderFallback), body)
			}
			if c.fallback {
				if body != "ok "+c.tenant+" "+c.body || h.Get(tmhttp.HeaderServedBy) != "projection.projection-3.fb" ||
					h.Get(tmhttp.HeaderRefused) != "" || fb.app.calls.Load() != before+1 {
					t.Fatalf("fallback answer: %s served by %q, headers %v", body, h.Get(tmhttp.HeaderServedBy), h)
				}
			} else if fb.app.calls.Load() != before {
				t.Fatal("the local service ran although the request may have reached the owner")
			}
			if c.tenant == "t-broken" && c.fallback && accepted.Load()-conns != 2 {
				t.Fatalf("the owner was tried %d times before the fallback, want 2 (the preferred instance, the next)", accepted.Load()-conns)
			}
			// Without ForwardFallback the same request fails.
			if code, _, body := call(t, c.method, plain.URL+"/t/x", c.tenant, nil, c.body); code < 500 {
				t.Fatalf("without fallback: %d %s", code, body)
			}
		})
	}
	if n := plain.app.calls.Load(); n != 0 {
		t.Fatalf("the instance without fallback served %d requests it does not own", n)
	}
	if _, _, m := call(t, "GET", fb.URL+"/metrics", "", nil, ""); !strings.Contains(m, `tm_shard_forwarded_total{result="fallback"} 4`) {
		t.Fatalf("fallback metric missing:\n%s", m)
	}
}

// A kind that needs a single writer refuses ForwardFallback: Run fails and says why.
func TestForwardFallbackRefusedForSingleWriter(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	if _, err := shardkit.New(shardkit.Config{Store: st, ID: id("aggregate-1", "a"), URL: "http://127.0.0.1:1", ForwardFallback: true}); !errors.Is(err, shardkit.ErrConfig) {
		t.Fatalf("fallback without forward: %v", err)
	}
	sk, err := shardkit.New(shardkit.Config{Store: st, ID: id("aggregate-1", "a"), URL: "http://127.0.0.1:1", Forward: true, ForwardFallback: true})
	if err != nil {
		t.Fatal(err)
	}
	sk.Mount(chi.NewRouter())
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	err = sk.Run(ctx)
	if !errors.Is(err, shardkit.ErrConfig) || !strings.Contains(err.Error(), "single_writer") {
		t.Fatalf("Run: %v", err)
	}
	if _, err := st.Directory().Instance(ctx, id("aggregate-1", "a")); err == nil {
		t.Fatal("the refused instance stayed registered")
	}
}
