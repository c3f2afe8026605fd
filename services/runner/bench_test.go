package runner

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

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
