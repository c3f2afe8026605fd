package gateway

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/tenantmesh/tenantmesh/gateway/edgeauth"
	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/tracing"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// BenchmarkPlacementChangeRouted measures how long a placement change takes to steer traffic,
// with 1 and 3 gateways on a 1-node embedded NATS server or a 3-node embedded cluster (placement
// bucket with 3 replicas, each gateway connected to a different node):
//
//	go test -run '^$' -bench PlacementChangeRouted -benchtime 300x ./gateway/
//
// The tenant's placement flips between two shards by CAS. Each iteration times, from the start
// of the KV write and from its acknowledgement, until every gateway routes the tenant's next
// request (real HTTP to real backends) to the new owner. Each gateway's side awaits its
// placement-change broadcast (as a request waiting after a 421 does), then sends requests until
// one is served by the new owner. Reported in microseconds:
//
//	all-gw-p50/p99-from-write-us  write start -> every gateway routed to the new owner
//	all-gw-p50/p99-from-ack-us    acknowledgement -> every gateway routed
//	p50/p99-from-ack-us           acknowledgement -> one gateway routed (all gateways pooled)
//	applied-p99-from-ack-us       acknowledgement -> every gateway's snapshot has it
//	cas-p50/p99-us                the CAS write's own round trip (start -> acknowledgement)
//
// The watchers may apply the change, and a gateway may even route to the new owner, before the
// writer sees its acknowledgement; such a time from the acknowledgement counts as 0.
func BenchmarkPlacementChangeRouted(b *testing.B) {
	for _, nodes := range []int{1, 3} {
		for _, gateways := range []int{1, 3} {
			b.Run(fmt.Sprintf("nodes=%d/gateways=%d", nodes, gateways), func(b *testing.B) {
				benchPlacementChange(b, nodes, gateways)
			})
		}
	}
}

func benchPlacementChange(b *testing.B, nodes, gateways int) {
	if testing.Short() {
		b.Skip("integration benchmark: needs embedded nats-servers")
	}
	ctx := context.Background()
	var urls []string // one client URL per NATS node
	replicas := 1
	if nodes == 1 {
		urls = []string{natstest.Server(b).URL()}
	} else {
		c := natstest.NewCluster(b)
		for _, cfg := range c.Configs {
			urls = append(urls, "nats://127.0.0.1:"+strconv.Itoa(cfg.Port))
		}
		replicas = 3
	}
	open := func(url string) *schema.Store {
		nc := natstest.Connect(b, url)
		octx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		st, err := schema.OpenRetry(octx, nc, schema.Options{Replicas: replicas}) // peers may still be joining
		if err != nil {
			b.Fatal(err)
		}
		return st
	}
	// The writer (the rebalancer's role) is connected to the first node.
	w := &env{t: b, st: open(urls[0])}
	s1 := newBackend(b, "aggregate", "aggregate-1", "i1")
	s2 := newBackend(b, "aggregate", "aggregate-2", "i1")
	w.register(s1, "", 10, aggRoute)
	w.register(s2, "", 10, aggRoute)
	p := w.place("aggregate", "t1", "aggregate-1")
	shards := map[string]string{"aggregate-1": s1.id.Key(), "aggregate-2": s2.id.Key()}
	// The snapshot object store exists in any running deployment; created here once, before the
	// gateways start. (Left to the gateways' watchers on a fresh 3-node cluster, their concurrent
	// first lookups can stall for the watcher's 30 s bound.)
	sctx, scancel := context.WithTimeout(ctx, 30*time.Second)
	_, err := w.st.Snapshots(sctx)
	scancel()
	if err != nil {
		b.Fatal(err)
	}

	gws := make([]*env, gateways)
	for i := range gws {
		g := &env{t: b, st: open(urls[i%len(urls)])}
		g.startGateway(Config{})
		g.waitServedBy("/agg/x", "t1", s1.id.Key())
		g.gw.waiters.Add(1) // keep the change broadcast on
		defer g.gw.waiters.Add(-1)
		gws[i] = g
	}

	type result struct {
		applied, routed time.Time
		err             error
	}
	// await waits until g's snapshot has epoch (woken by the gateway's placement-change
	// broadcast), then sends requests until one is served by want.
	await := func(ctx context.Context, g *env, epoch uint64, want string, r *result) {
		timer := time.NewTimer(time.Until(deadlineOf(ctx)))
		defer timer.Stop()
		for {
			ch := *g.gw.changed.Load()
			if en, _ := g.gw.reg.snap.Load().kinds["aggregate"].lookup("t1"); en.Epoch >= epoch {
				break
			}
			select {
			case <-ch:
			case <-timer.C:
				r.err = errors.New("placement change not applied within 10s")
				return
			}
		}
		r.applied = time.Now()
		req, _ := http.NewRequestWithContext(ctx, "GET", g.url+"/agg/x", nil)
		req.Header.Set(tmhttp.HeaderTenant, "t1")
		for {
			resp, err := g.client.Do(req)
			if err != nil {
				r.err = fmt.Errorf("placement change not routed: %w", err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.Header.Get(tmhttp.HeaderServedBy) == want {
				r.routed = time.Now()
				return
			}
		}
	}

	var allWrite, allAck, oneAck, applied, cas []time.Duration
	res := make([]result, gateways)
	b.ResetTimer()
	for b.Loop() {
		next := p
		next.Shard, next.Epoch = "aggregate-1", p.Epoch+1
		if p.Shard == "aggregate-1" {
			next.Shard = "aggregate-2"
		}
		ictx, cancel := context.WithTimeout(ctx, 10*time.Second)
		var wg sync.WaitGroup
		for i, g := range gws {
			res[i] = result{}
			wg.Go(func() { await(ictx, g, next.Epoch, shards[next.Shard], &res[i]) })
		}
		t0 := time.Now()
		np, err := w.st.Placements(next.Kind).Update(ictx, p, next)
		t1 := time.Now()
		if err != nil {
			cancel()
			wg.Wait()
			b.Fatal(err)
		}
		wg.Wait()
		cancel()
		var last, lastApplied time.Time
		for _, r := range res {
			if r.err != nil {
				b.Fatal(r.err)
			}
			oneAck = append(oneAck, max(0, r.routed.Sub(t1)))
			if r.routed.After(last) {
				last = r.routed
			}
			if r.applied.After(lastApplied) {
				lastApplied = r.applied
			}
		}
		allWrite, allAck = append(allWrite, last.Sub(t0)), append(allAck, max(0, last.Sub(t1)))
		applied = append(applied, max(0, lastApplied.Sub(t1)))
		cas = append(cas, t1.Sub(t0))
		p = np
	}
	b.StopTimer()
	b.ReportMetric(quantileUS(allWrite, 0.50), "all-gw-p50-from-write-us")
	b.ReportMetric(quantileUS(allWrite, 0.99), "all-gw-p99-from-write-us")
	b.ReportMetric(quantileUS(allAck, 0.50), "all-gw-p50-from-ack-us")
	b.ReportMetric(quantileUS(allAck, 0.99), "all-gw-p99-from-ack-us")
	b.ReportMetric(quantileUS(oneAck, 0.50), "p50-from-ack-us")
	b.ReportMetric(quantileUS(oneAck, 0.99), "p99-from-ack-us")
	b.ReportMetric(quantileUS(applied, 0.99), "applied-p99-from-ack-us")
	b.ReportMetric(quantileUS(cas, 0.50), "cas-p50-us")
	b.ReportMetric(quantileUS(cas, 0.99), "cas-p99-us")
}

func deadlineOf(ctx context.Context) time.Time {
	d, _ := ctx.Deadline()
	return d
}

// quantileUS is the q-quantile of d in microseconds (d is sorted in place).
func quantileUS(d []time.Duration, q float64) float64 {
	if len(d) == 0 {
		return 0
	}
	slices.Sort(d)
	return float64(d[min(len(d)-1, int(q*float64(len(d))))].Microseconds())
}

// BenchmarkProxy measures the request path end to end over loopback: client -> gateway -> shard,
// 1,000 tenants over 4 shards, parallel clients; "jwt" adds tenant identity at the edge (each
// tenant's ES256 token verified once, then remembered).
func BenchmarkProxy(b *testing.B) {
	b.Run("plain", func(b *testing.B) { benchProxy(b, nil, nil) })
	b.Run("jwt", func(b *testing.B) {
		v, sign := testVerifier(b)
		tokens := make([]string, 1000)
		for i := range tokens {
			tokens[i] = sign(jwt.MapClaims{"sub": "u", "tenant_id": fmt.Sprintf("t%d", i)})
		}
		benchProxy(b, v, tokens)
	})
}

func benchProxy(b *testing.B, auth *edgeauth.Verifier, tokens []string) {
	const tenants = 1000
	e := newEnv(b, Config{Auth: auth}, nil, func(e *env) {
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
			t := n.Add(1) % tenants
			req.Header.Set(tmhttp.HeaderTenant, fmt.Sprintf("t%d", t))
			if tokens != nil {
				req.Header.Set("Authorization", "Bearer "+tokens[t])
			}
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

// BenchmarkProxyRaw measures the gateway's own share of a proxied request: the client and the
// shard are raw TCP loops that allocate nothing (fixed request bytes, a fixed 64-byte answer),
// so allocs/op is the gateway's allocations per request (goal: 0 on the fast path).
// Sub-benchmarks: tracing off (the default), and on with 1% of the requests sampled (spans go
// to an exporter that drops them), so the cost of tracing is read side by side.
func BenchmarkProxyRaw(b *testing.B) {
	b.Run("off", benchProxyRaw)
	b.Run("traced-1pct", func(b *testing.B) {
		tp := tracing.NewProvider(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(0.01)),
			sdktrace.WithBatcher(discardSpans{}))
		defer func() { _ = tp.Shutdown(context.Background()) }()
		defer tracing.Use(tp)()
		benchProxyRaw(b)
	})
}

// discardSpans is a span exporter that drops what it is given.
type discardSpans struct{}

func (discardSpans) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (discardSpans) Shutdown(context.Context) error                             { return nil }

func benchProxyRaw(b *testing.B) {
	const tenants = 1000
	answer := []byte("HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 64\r\n\r\n" + strings.Repeat("x", 64))
	e := newEnv(b, Config{}, nil, func(e *env) {
		for i := 1; i <= 4; i++ {
			addr := rawShard(b, answer)
			id := schema.InstanceID{Kind: "aggregate", Shard: fmt.Sprintf("aggregate-%d", i), Instance: "i1"}
			if _, err := e.st.Directory().Register(context.Background(), schema.Instance{InstanceID: id, URL: "http://" + addr, Capacity: tenants}); err != nil {
				b.Fatal(err)
			}
			if _, err := e.st.Routes().AddInstance(context.Background(), aggRoute, id); err != nil {
				b.Fatal(err)
			}
		}
		for i := range tenants {
			e.place("aggregate", fmt.Sprintf("t%d", i), fmt.Sprintf("aggregate-%d", i%4+1))
		}
	})
	addr := strings.TrimPrefix(e.url, "http://")
	reqs := make([][]byte, tenants)
	for i := range reqs {
		reqs[i] = []byte(fmt.Sprintf("GET /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t%d\r\nx-request-id: r%d\r\n\r\n", i, i))
	}
	var n atomic.Int64
	b.ReportAllocs()
	b.SetParallelism(8)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			b.Error(err)
			return
		}
		defer c.Close()
		br := bufio.NewReaderSize(c, 4096)
		for pb.Next() {
			if _, err := c.Write(reqs[n.Add(1)%tenants]); err != nil {
				b.Error(err)
				return
			}
			if err := readRawAnswer(br); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

// readRawAnswer reads one response with a Content-Length body, without allocating.
func readRawAnswer(br *bufio.Reader) error {
	cl := -1
	status := false
	for {
		line, err := br.ReadSlice('\n')
		if err != nil {
			return err
		}
		if !status {
			if !bytes.HasPrefix(line, []byte("HTTP/1.1 200 ")) {
				return fmt.Errorf("answer %q", line)
			}
			status = true
			continue
		}
		if len(line) <= 2 {
			break
		}
		if v, ok := bytes.CutPrefix(line, []byte("Content-Length: ")); ok {
			cl = 0
			for _, c := range bytes.TrimSpace(v) {
				cl = cl*10 + int(c-'0')
			}
		}
	}
	if cl < 0 {
		return errors.New("answer without Content-Length")
	}
	_, err := br.Discard(cl)
	return err
}

// rawShard answers every request on every connection with answer, reading request heads
// without allocating (requests have no body).
func rawShard(b *testing.B, answer []byte) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				br := bufio.NewReaderSize(c, 8192)
				for {
					for {
						line, err := br.ReadSlice('\n')
						if err != nil {
							return
						}
						if len(line) <= 2 {
							break
						}
					}
					if _, err := c.Write(answer); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}
