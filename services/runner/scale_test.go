package runner

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// 10,000 tenants on one shard: the instance acquires all of them and runs a job of each. make
// e2e runs it; under the race detector (make test) it took 50 s of the CI's budget.
func TestTenThousandTenants(t *testing.T) {
	if testing.Short() || raceEnabled {
		t.Skip("scale test: make e2e runs it without -race")
	}
	st := openStore(t)
	const n = 10000
	tenants := make([]string, n)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	start := time.Now()
	for i := range tenants {
		tenants[i] = fmt.Sprintf("t%05d", i)
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			if _, err := st.Placements(Kind).Create(context.Background(), schema.Placement{Tenant: tenants[i], Shard: "runner-1"}); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	placed := time.Since(start)
	start = time.Now()
	s := startService(t, st, "runner-1", "a", Config{MaxConcurrent: 16})
	waitUntil(t, 60*time.Second, "10,000 tenants acquired", func() bool { return s.Status().Tenants == n })
	acquired := time.Since(start)
	goroutines := runtime.NumGoroutine()
	jobs := n
	start = time.Now()
	for _, tn := range tenants {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			if _, _, err := s.Create(context.Background(), tn, NewJob{Type: "noop"}); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	created := time.Since(start)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	w, err := s.store.runs.WatchAll(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	done := map[string]bool{}
	for len(done) < jobs {
		select {
		case e := <-w.Updates():
			if e != nil && e.Operation() == jetstream.KeyValuePut && strings.Contains(string(e.Value()), `"status":"succeeded"`) {
				done[e.Key()] = true
			}
		case <-ctx.Done():
			t.Fatalf("%d of %d tenants' jobs finished", len(done), jobs)
		}
	}
	ran := time.Since(start)
	t.Logf("MEASURED 10k tenants: placed in %v; instance acquired all (20,000 wake-up subscriptions, %d goroutines in the test process) in %v; "+
		"%d jobs (one per tenant) created in %v and all finished %v after the first create (%.0f jobs/s across %d tenants)",
		placed.Round(time.Millisecond), goroutines, acquired.Round(time.Millisecond), jobs, created.Round(time.Millisecond), ran.Round(time.Millisecond), float64(jobs)/ran.Seconds(), jobs)
}
