package runner

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// BenchmarkCreate measures POST /jobs without HTTP: depth check, run record, enqueue.
func BenchmarkCreate(b *testing.B) {
	st := openStore(b)
	s := startService(b, st, "runner-1", "a", Config{MaxQueued: 1 << 30})
	place(b, st, "bench", "runner-9") // not owned here: nothing runs
	nj := NewJob{Type: "noop", Payload: json.RawMessage(`{"n":1}`)}
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, _, err := s.Create(context.Background(), "bench", nj); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkCreateLatency measures one create at a time (ns/op is a create's latency), with and
// without an idempotency key (a keyed create whose key is new), on one NATS node and on a
// 3-node cluster with replicated streams (where a round trip costs what it does in a fleet).
func BenchmarkCreateLatency(b *testing.B) {
	for _, nodes := range []int{1, 3} {
		st := openStore(b)
		if nodes == 3 {
			c := natstest.NewCluster(b)
			octx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			var err error
			st, err = schema.OpenRetry(octx, natstest.Connect(b, c.URLs()), schema.Options{Replicas: 3, Timeout: 5 * time.Second})
			cancel()
			if err != nil {
				b.Fatal(err)
			}
		}
		benchCreates(b, fmt.Sprintf("nodes=%d/", nodes), st)
	}
}

func benchCreates(b *testing.B, prefix string, st *schema.Store) {
	s := startService(b, st, "runner-1", "a", Config{MaxQueued: 1 << 30})
	place(b, st, "bench", "runner-9") // not owned here: nothing runs
	for _, keyed := range []bool{false, true} {
		b.Run(fmt.Sprintf("%skeyed=%v", prefix, keyed), func(b *testing.B) {
			nj := NewJob{Type: "noop", Payload: json.RawMessage(`{"n":1}`)}
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				if keyed {
					i++
					nj.IdempotencyKey = fmt.Sprintf("k-%d-%d", b.N, i)
				}
				if _, created, err := s.Create(context.Background(), "bench", nj); err != nil || !created {
					b.Fatal(err, created)
				}
			}
		})
	}
}

// BenchmarkRun measures queued noop jobs run end to end (acquire, claim, finish, dequeue)
// by one instance with 16 slots, over 10 tenants.
func BenchmarkRun(b *testing.B) {
	st := openStore(b)
	s := startService(b, st, "runner-1", "a", Config{MaxConcurrent: 16, MaxQueued: 1 << 30})
	tenants := make([]string, 10)
	ps := make([]schema.Placement, len(tenants))
	ids := map[string][]string{}
	for i := range tenants {
		tenants[i] = fmt.Sprintf("t%d", i)
		ps[i] = place(b, st, tenants[i], "runner-9")
		ids[tenants[i]] = create(b, s, tenants[i], max(b.N/len(tenants), 1), NewJob{Type: "noop"})
	}
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	for i, p := range ps {
		next := p
		next.Shard, next.Epoch = "runner-1", p.Epoch+1
		if _, err := st.Placements(next.Kind).Update(context.Background(), p, next); err != nil {
			b.Fatal(err)
		}
		_ = i
	}
	n := 0
	for _, tn := range tenants {
		n += len(waitDone(b, s, tn, ids[tn], 5*time.Minute))
	}
	b.ReportMetric(float64(n)/time.Since(start).Seconds(), "jobs/s")
}
