package sidecar_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/natsconn"
	"github.com/tenantmesh/tenantmesh/shardkit/natsperm"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/shardmain"
	"github.com/tenantmesh/tenantmesh/shardkit/sidecar/sidecartest"
)

// ok is the service's handler in both set-ups: a small JSON answer.
var ok = http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, `{"ok":true}`)
})

// embedded is the same service with shardkit in process: the handler behind the gate.
type embedded struct{}

func (embedded) Hooks() shardkit.Hooks { return shardkit.Hooks{} }
func (embedded) Routes() []schema.Route {
	return []schema.Route{{Method: "GET", Prefix: "/notes"}}
}
func (embedded) Handler(sk *shardkit.Shard) http.Handler { return sk.Gate(ok) }

func startEmbedded(b *testing.B, natsURL string) string {
	b.Helper()
	m := &shardmain.Main{Kind: "bench", Addr: "127.0.0.1:0", Shard: "bench-1", Instance: "embedded",
		NATS:     natsconn.Options{URL: natsURL, Creds: natstest.CredsFile(b, natsperm.Shard("bench", "bench-1", natsperm.Assets{}))},
		LogLevel: "error", LogFormat: "json", Stderr: io.Discard, Heartbeat: time.Second}
	return kittest.Main(b, m, func(context.Context, shardmain.Env) (shardmain.App, error) { return embedded{}, nil })
}

// BenchmarkSidecarLatency is one request at a time over loopback keep-alive connections to the
// same Go handler, embedded behind shardkit's gate in its own process ("embedded") and behind
// the sidecar's gate and proxy ("sidecar"). p50-µs and p99-µs are the latencies the client saw;
// the sidecar's added latency is the difference of the p50s of the two, run side by side.
func BenchmarkSidecarLatency(b *testing.B) {
	st, natsURL := openStore(b)
	ctx := context.Background()
	if _, err := st.Kinds().Ensure(ctx, schema.KindConfig{Kind: "bench"}); err != nil {
		b.Fatal(err)
	}
	if _, err := st.Placements("bench").Create(ctx, schema.Placement{Tenant: "acme", Shard: "bench-1"}); err != nil {
		b.Fatal(err)
	}
	upstream := httptest.NewServer(ok)
	b.Cleanup(upstream.Close)
	urls := map[string]string{
		"embedded": startEmbedded(b, natsURL),
		"sidecar":  sidecartest.Start(b, natsURL, "bench", "bench-1", "sidecar", upstream.URL, ""),
	}
	hc := &http.Client{Timeout: 5 * time.Second}
	get := func(url string) error {
		req, _ := http.NewRequest("GET", url+"/notes", nil)
		req.Header.Set("x-tenant-id", "acme")
		resp, err := hc.Do(req)
		if err != nil {
			return err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("status %d", resp.StatusCode)
		}
		return nil
	}
	for _, name := range []string{"embedded", "sidecar"} {
		tmtest.WaitFor(b, 10*time.Second, func() error { return get(urls[name]) })
	}
	for _, name := range []string{"embedded", "sidecar"} {
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			lat := make([]time.Duration, 0, 1<<16)
			for b.Loop() {
				start := time.Now()
				if err := get(urls[name]); err != nil {
					b.Fatal(err)
				}
				if len(lat) < cap(lat) {
					lat = append(lat, time.Since(start))
				}
			}
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-µs")
			b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds())/1e3, "p99-µs")
		})
	}
}
