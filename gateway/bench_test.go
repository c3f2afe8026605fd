package gateway

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// BenchmarkPlacementChangeRouted measures how long a placement change takes to steer traffic:
// from the start of the KV write (and from its acknowledgement) to the first request routed to
// the new owner. Reported as p50/p99 in microseconds; "ack-to-applied" is the part spent until
// the gateway's placement snapshot has the change (KV -> watcher), the rest is one request.
func BenchmarkPlacementChangeRouted(b *testing.B) {
	var s1, s2 *backend
	e := newEnv(b, Config{}, nil, func(e *env) {
		s1 = newBackend(b, "aggregate", "aggregate-1", "i1")
		s2 = newBackend(b, "aggregate", "aggregate-2", "i1")
		e.register(s1, "", 10, aggRoute)
		e.register(s2, "", 10, aggRoute)
		e.place("aggregate", "t1", "aggregate-1")
	})
	e.waitServedBy("/agg/x", "t1", s1.id.Key())
	ctx := context.Background()
	p, err := e.st.Placement(ctx, "aggregate", "t1")
	if err != nil {
		b.Fatal(err)
	}
	shards := map[string]string{"aggregate-1": s1.id.Key(), "aggregate-2": s2.id.Key()}
	req, _ := http.NewRequest("GET", e.url+"/agg/x", nil)
	req.Header.Set(tmhttp.HeaderTenant, "t1")
	servedBy := func() string {
		resp, err := e.client.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.Header.Get(tmhttp.HeaderServedBy)
	}
	var fromWrite, fromAck, applied []time.Duration
	ke := e.gw.reg.snap.Load().kinds["aggregate"]
	e.gw.waiters.Add(1) // keep the change broadcast on
	defer e.gw.waiters.Add(-1)
	b.ResetTimer()
	for b.Loop() {
		next := p
		next.Shard, next.Epoch = "aggregate-1", p.Epoch+1
		if p.Shard == "aggregate-1" {
			next.Shard = "aggregate-2"
		}
		t0 := time.Now()
		np, err := e.st.UpdatePlacement(ctx, p, next)
		if err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		deadline := t0.Add(10 * time.Second)
		// When the gateway's snapshot has the change (its watcher applied it): woken by the
		// gateway's placement-change broadcast, as a request waiting after a 421 is.
		for {
			ch := *e.gw.changed.Load()
			if en, _ := ke.lookup("t1"); en.Epoch == np.Epoch {
				break
			}
			select {
			case <-ch:
			case <-time.After(time.Until(deadline)):
				b.Fatal("placement change not applied within 10s")
			}
		}
		applied = append(applied, time.Since(t1))
		for servedBy() != shards[np.Shard] {
			if time.Now().After(deadline) {
				b.Fatal("placement change not routed within 10s")
			}
		}
		t2 := time.Now()
		fromWrite, fromAck = append(fromWrite, t2.Sub(t0)), append(fromAck, t2.Sub(t1))
		p = np
	}
	b.StopTimer()
	report(b, "write", fromWrite)
	report(b, "ack", fromAck)
	report(b, "ack-to-applied", applied)
}

func report(b *testing.B, name string, d []time.Duration) {
	slices.Sort(d)
	q := func(f float64) float64 { return float64(d[min(len(d)-1, int(f*float64(len(d))))].Microseconds()) }
	b.ReportMetric(q(0.50), "p50-from-"+name+"-µs")
	b.ReportMetric(q(0.99), "p99-from-"+name+"-µs")
}

// BenchmarkProxy measures the request path end to end over loopback: client -> gateway -> shard,
// 1,000 tenants over 4 shards, parallel clients.
func BenchmarkProxy(b *testing.B) {
	const tenants = 1000
	e := newEnv(b, Config{}, nil, func(e *env) {
		for i := 1; i <= 4; i++ {
			be := newBackend(b, "aggregate", fmt.Sprintf("aggregate-%d", i), "i1")
			be.setHandler(func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok") })
			e.register(be, "", tenants, aggRoute)
		}
		for i := range tenants {
			e.place("aggregate", fmt.Sprintf("t%d", i), fmt.Sprintf("aggregate-%d", i%4+1))
		}
	})
	var n atomic.Int64
	tr := &http.Transport{MaxIdleConnsPerHost: 256}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	b.ReportAllocs()
	b.SetParallelism(8)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		req, _ := http.NewRequest("GET", e.url+"/agg/x", nil)
		for pb.Next() {
			req.Header.Set(tmhttp.HeaderTenant, fmt.Sprintf("t%d", n.Add(1)%tenants))
			resp, err := client.Do(req)
			if err != nil {
				b.Fatal(err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				b.Fatalf("status %d", resp.StatusCode)
			}
		}
	})
}

// BenchmarkLookup measures the in-memory part of the request path: route match and placement
// lookup (no lock, no allocation).
func BenchmarkLookup(b *testing.B) {
	e := newEnv(b, Config{}, nil, func(e *env) {
		be := newBackend(b, "aggregate", "aggregate-1", "i1")
		e.register(be, "", 10, aggRoute)
		e.place("aggregate", "t1", "aggregate-1")
	})
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		snap := e.gw.reg.snap.Load()
		r := snap.match("GET", "/agg/x")
		if _, ok := snap.kinds[r.kind].lookup("t1"); !ok {
			b.Fatal("not placed")
		}
	}
}
