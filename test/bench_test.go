package test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// BenchmarkCutoverPause is the handoff pause under load: the whole platform as processes (dev
// stack: embedded NATS, gateway, rebalancer, 2 shards of each kind), 6 tenants sending
// commands, queries and webhook jobs through the gateway, while each iteration moves one
// tenant across all three kinds through the rebalancer API. The pause is handoff -> commit of
// each kind move: the time the gateway holds the tenant's requests. Requests that failed are
// reported, not asserted (TestMovesUnderLoad asserts them).
func BenchmarkCutoverPause(b *testing.B) {
	s := startStack(b)
	rcv := &receiver{byKey: map[string]int{}}
	hook := httptest.NewServer(rcv)
	defer hook.Close()
	nc, err := nats.Connect(s.natsURL)
	if err != nil {
		b.Fatal(err)
	}
	defer nc.Close()
	st, err := schema.Open(context.Background(), nc, schema.Options{})
	if err != nil {
		b.Fatal(err)
	}
	l := &load{gw: s.gateway, hc: &http.Client{Timeout: 15 * time.Second}, receiver: hook.URL,
		deposits: map[string]int64{}, jobs: map[string]string{}}
	tenants := []string{"acme", "globex", "initech", "umbrella", "hooli", "stark"}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for _, tenant := range tenants {
		wg.Go(func() { l.run(tenant, stop) })
	}
	var pauses []time.Duration
	b.ResetTimer()
	for i := range b.N {
		pauses = append(pauses, moveAcross(b, st, s.rebalancer, tenants[i%len(tenants)])...)
	}
	b.StopTimer()
	close(stop)
	wg.Wait()
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	b.ReportMetric(ms(pct(pauses, 0.5)), "pause-p50-ms")
	b.ReportMetric(ms(pct(pauses, 0.99)), "pause-p99-ms")
	b.ReportMetric(ms(pct(pauses, 1)), "pause-max-ms")
	b.ReportMetric(float64(len(pauses)), "kind-moves")
	b.ReportMetric(float64(l.requests.Load()), "requests")
	b.ReportMetric(float64(len(l.failures)), "failed-requests")
	s.stop(b)
}
