package shardkit_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// nopWriter is a reusable ResponseWriter, so the benchmark measures the gate alone.
type nopWriter struct{ h http.Header }

func (w *nopWriter) Header() http.Header         { return w.h }
func (w *nopWriter) Write(b []byte) (int, error) { return len(b), nil }
func (w *nopWriter) WriteHeader(int)             {}

// benchGate runs a shard that owns tenant "bench" and returns its gate around a trivial handler.
func benchGate(b *testing.B) http.Handler {
	srv := natstest.Server(b)
	st := kittest.StoreAt(b, srv.URL())
	p := place(b, st, schema.Placement{Kind: "aggregate", Tenant: "bench", Shard: "aggregate-1"})
	sk, err := shardkit.New(shardkit.Config{Store: st, ID: id("aggregate-1", "a"), URL: "http://127.0.0.1:1"})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = sk.Run(ctx) }()
	b.Cleanup(func() { cancel(); <-done })
	select {
	case <-sk.Running():
	case <-time.After(30 * time.Second):
		b.Fatal("shard not running")
	}
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	if err := sk.WaitPlacement(wctx, p.Revision); err != nil {
		b.Fatal(err)
	}
	return sk.Gate(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) }))
}

func benchRequest() *http.Request {
	r := httptest.NewRequest("GET", "/t/x", nil)
	r.Header.Set(tmhttp.HeaderTenant, "bench")
	r.Header.Set(tmhttp.HeaderEpoch, "1")
	return r
}

// BenchmarkGate is the gate's cost per served request: header parsing, the placement lookup,
// the in-flight counters and the metrics.
func BenchmarkGate(b *testing.B) {
	h := benchGate(b)
	r, w := benchRequest(), &nopWriter{h: http.Header{}}
	h.ServeHTTP(w, r) // create the tenant's state
	b.ReportAllocs()
	for b.Loop() {
		h.ServeHTTP(w, r)
	}
}

// BenchmarkGateParallel is the same with every CPU sending.
func BenchmarkGateParallel(b *testing.B) {
	h := benchGate(b)
	h.ServeHTTP(&nopWriter{h: http.Header{}}, benchRequest())
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		r, w := benchRequest(), &nopWriter{h: http.Header{}}
		for pb.Next() {
			h.ServeHTTP(w, r)
		}
	})
}
