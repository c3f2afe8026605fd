package placement

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

func tenantKey(i int) string { return fmt.Sprintf("tenant-%07d", i) }

func buildTable(n int) *table {
	t := newTable(0)
	for i := range n {
		p := schema.Placement{Shard: "aggregate-" + strconv.Itoa(i%1000), Epoch: 1, Phase: schema.PhaseActive}
		v, _ := t.pack(p)
		t.set(tenantKey(i), v, uint64(i+1))
	}
	return t
}

// BenchmarkLookup1M measures a hit lookup among 1M placements (random keys, so cache misses
// count) and reports the table's heap bytes per placement.
func BenchmarkLookup1M(b *testing.B) {
	const n = 1_000_000
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	t := buildTable(n)
	runtime.GC()
	runtime.ReadMemStats(&after)
	perEntry := float64(after.HeapAlloc-before.HeapAlloc) / n
	keys := make([]string, 4096)
	for i := range keys {
		keys[i] = tenantKey(rand.IntN(n))
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		if _, ok := t.lookup(keys[i&4095]); !ok {
			b.Fatal("miss")
		}
	}
	b.ReportMetric(perEntry, "B/placement")
	runtime.KeepAlive(t)
}

// BenchmarkLookupParallel is the same lookup from all cores at once (no lock to contend on).
func BenchmarkLookupParallel(b *testing.B) {
	t := buildTable(100_000)
	keys := make([]string, 4096)
	for i := range keys {
		keys[i] = tenantKey(rand.IntN(100_000))
	}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		i := rand.IntN(4096)
		for pb.Next() {
			i = (i + 1) & 4095
			if _, ok := t.lookup(keys[i]); !ok {
				b.Fatal("miss")
			}
		}
	})
}

func percentile(d []time.Duration, p float64) time.Duration {
	slices.Sort(d)
	return d[int(float64(len(d)-1)*p)]
}

// BenchmarkPutToApplied measures the time from issuing a KV put to the watcher having applied
// it (OnChange), through a real embedded nats-server. The put's acknowledgement often arrives
// after the watcher has applied the change, so the clock starts before the put.
func BenchmarkPutToApplied(b *testing.B) {
	srv := natstest.Server(b)
	nc := natstest.Connect(b, srv.URL())
	ctx := context.Background()
	st, err := schema.Open(ctx, nc, schema.Options{})
	if err != nil {
		b.Fatal(err)
	}
	applied := make(chan time.Time, 1)
	w, err := New(Config{Store: st, Kinds: []string{"aggregate"}, OnChange: func(Change) { applied <- time.Now() }})
	if err != nil {
		b.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go w.Run(rctx)
	if err := w.WaitReady(ctx); err != nil {
		b.Fatal(err)
	}
	kv, _ := st.Placements("aggregate").KV(ctx)
	var lat []time.Duration
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		val := fmt.Sprintf(`{"shard":"aggregate-1","epoch":%d,"phase":"active"}`, i+1)
		put := time.Now()
		if _, err := kv.Put(ctx, "acme", []byte(val)); err != nil {
			b.Fatal(err)
		}
		select {
		case at := <-applied:
			lat = append(lat, at.Sub(put))
		case <-time.After(5 * time.Second):
			b.Fatal("change not applied within 5s")
		}
	}
	b.StopTimer()
	if len(lat) > 0 {
		b.ReportMetric(float64(percentile(lat, 0.5).Microseconds()), "p50-µs")
		b.ReportMetric(float64(percentile(lat, 0.99).Microseconds()), "p99-µs")
	}
}

// benchPlacements is the cold-start size; TM_BENCH_PLACEMENTS overrides the 1M default.
func benchPlacements() int {
	if n, err := strconv.Atoi(os.Getenv("TM_BENCH_PLACEMENTS")); err == nil && n > 0 {
		return n
	}
	return 1_000_000
}

// BenchmarkColdStart loads N placements into a bucket, then times, side by side: nats.go's own
// KeyValue.WatchAll to its initial-values marker (the peer), our watcher reading every key, and
// our watcher starting from a compacted snapshot.
func BenchmarkColdStart(b *testing.B) {
	if testing.Short() {
		b.Skip("loads 1M placements")
	}
	n := benchPlacements()
	srv := natstest.Server(b)
	nc := natstest.Connect(b, srv.URL())
	ctx := context.Background()
	st, err := schema.Open(ctx, nc, schema.Options{})
	if err != nil {
		b.Fatal(err)
	}
	loadStart := time.Now()
	js := st.JS().JetStream()
	prefix := schema.PlacementSubjectPrefix("aggregate")
	for i := range n {
		val := fmt.Sprintf(`{"kind":"aggregate","tenant":"%s","shard":"aggregate-%d","epoch":1,"phase":"active","updated_at":"2026-11-22T10:00:00Z"}`, tenantKey(i), i%1000)
		if _, err := js.PublishAsync(prefix+tenantKey(i), []byte(val)); err != nil {
			b.Fatal(err)
		}
		// Stay under nats.go's 4,000 outstanding async publishes: past it, a publish waits
		// only 200 ms for room and then fails ("stalled"), which a loaded machine hits.
		if i%2000 == 1999 {
			<-js.PublishAsyncComplete()
		}
	}
	<-js.PublishAsyncComplete()
	b.Logf("loaded %d placements in %s", n, time.Since(loadStart).Round(time.Millisecond))

	start := func(cfg Config) (time.Duration, *Watcher) {
		t0 := time.Now()
		w, err := New(cfg)
		if err != nil {
			b.Fatal(err)
		}
		rctx, cancel := context.WithCancel(ctx)
		b.Cleanup(cancel)
		go w.Run(rctx)
		wctx, wcancel := context.WithTimeout(ctx, 5*time.Minute)
		defer wcancel()
		if err := w.WaitReady(wctx); err != nil {
			b.Fatal(err)
		}
		return time.Since(t0), w
	}
	natsWatch := func() time.Duration {
		t0 := time.Now()
		kv, _ := st.Placements("aggregate").KV(ctx)
		wctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
		defer cancel()
		kw, err := kv.WatchAll(wctx)
		if err != nil {
			b.Fatal(err)
		}
		defer kw.Stop()
		for e := range kw.Updates() {
			if e == nil {
				return time.Since(t0)
			}
		}
		b.Fatal("nats watch closed")
		return 0
	}
	b.ResetTimer()
	for b.Loop() {
		peer := natsWatch()
		full, w := start(Config{Store: st, Kinds: []string{"aggregate"}, NoSnapshot: true})
		if s, _ := w.Stats("aggregate"); s.Placements != n {
			b.Fatalf("full read holds %d placements, want %d", s.Placements, n)
		}
		ws := time.Now()
		if err := w.WriteSnapshot(ctx, "aggregate"); err != nil {
			b.Fatal(err)
		}
		write := time.Since(ws)
		snap, w2 := start(Config{Store: st, Kinds: []string{"aggregate"}})
		if s, _ := w2.Stats("aggregate"); s.Placements != n || s.SnapshotRevision == 0 {
			b.Fatalf("snapshot start: %+v", s)
		}
		b.ReportMetric(peer.Seconds(), "nats-watch-s")
		b.ReportMetric(full.Seconds(), "full-read-s")
		b.ReportMetric(snap.Seconds(), "snapshot-start-s")
		b.ReportMetric(write.Seconds(), "snapshot-write-s")
	}
}

// BenchmarkLookup1MGoMap is the peer: the same 1M placements in a plain Go map (which would
// also need a lock or copy-on-write to be updated while read), value = packed word + revision.
func BenchmarkLookup1MGoMap(b *testing.B) {
	const n = 1_000_000
	type val struct{ v, rev uint64 }
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	m := make(map[string]val)
	for i := range n {
		m[tenantKey(i)] = val{uint64(i), uint64(i)}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	perEntry := float64(after.HeapAlloc-before.HeapAlloc) / n
	keys := make([]string, 4096)
	for i := range keys {
		keys[i] = tenantKey(rand.IntN(n))
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		if _, ok := m[keys[i&4095]]; !ok {
			b.Fatal("miss")
		}
	}
	b.ReportMetric(perEntry, "B/placement")
	runtime.KeepAlive(m)
}

// BenchmarkTakeovers1M is one look for the tenants in a takeover (Watcher.Takeovers, what the
// autopilot's retake detector does every few seconds while any exists) among 1M placements,
// 100 of them in a takeover.
func BenchmarkTakeovers1M(b *testing.B) {
	const n, held = 1_000_000, 100
	t := buildTable(n)
	for i := range held {
		p := schema.Placement{Shard: "aggregate-1", Target: "aggregate-2", Epoch: 2, Phase: schema.PhaseTakeover}
		v, _ := t.pack(p)
		t.set(tenantKey(i*(n/held)), v, uint64(n+i+1))
	}
	ks := &kindState{kind: "aggregate"}
	ks.t.Store(t)
	w := &Watcher{kinds: map[string]*kindState{"aggregate": ks}}
	b.ReportAllocs()
	for b.Loop() {
		found := 0
		w.Takeovers("aggregate", func(string, Entry) bool { found++; return true })
		if found != held {
			b.Fatalf("found %d takeovers, want %d", found, held)
		}
	}
}
