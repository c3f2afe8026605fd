package runner

import (
	"context"
	"fmt"
	"testing"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// BenchmarkQueueDigest is what a runner move's digest costs inside the handoff pause, on each
// side, by the number of jobs waiting in the tenant's queue.
func BenchmarkQueueDigest(b *testing.B) {
	st := openStore(b)
	kc := schema.DefaultKindConfig(Kind)
	kc.Verify = true
	if _, err := st.Kinds().Put(context.Background(), kc); err != nil {
		b.Fatal(err)
	}
	s := startService(b, st, "runner-1", "i1", Config{})
	for _, n := range []int{0, 10, 100} {
		tenant := fmt.Sprintf("t%d", n)
		place(b, st, tenant, "runner-1")
		owning(b, s, tenant, true)
		if n > 0 {
			create(b, s, tenant, n, NewJob{Type: "noop", Delay: "1h"})
		}
		b.Run(fmt.Sprintf("waiting=%d", n), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				d, err := s.queueDigest(context.Background(), tenant, 0)
				if err != nil || d.Items != n {
					b.Fatalf("%v %+v", err, d)
				}
			}
		})
	}
}
