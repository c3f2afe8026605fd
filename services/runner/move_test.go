package runner

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// step moves the placement one phase, as the rebalancer would, by compare-and-set.
func step(t *testing.T, st *schema.Store, prev schema.Placement, edit func(*schema.Placement)) schema.Placement {
	t.Helper()
	next := prev
	edit(&next)
	got, err := st.Placements(next.Kind).Update(context.Background(), prev, next)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// A tenant moved between shards while 1,000 jobs run: every job's webhook effect reaches the
// receiver exactly once, and both shards ran some of the jobs. The source is drained at
// handoff (shardkit's Fence) or only after the commit (shardkit's Release), when both shards
// acquire the tenant for a while.
func TestMoveWhileJobsRun(t *testing.T) {
	for _, late := range []bool{false, true} {
		name := "release-at-handoff"
		if late {
			name = "release-after-commit"
		}
		t.Run(name, func(t *testing.T) {
			if late && testing.Short() {
				t.Skip("short")
			}
			testMove(t, late)
		})
	}
}

func testMove(t *testing.T, late bool) {
	st := openStore(t)
	rc := newReceiver(t)
	rc.delay = time.Millisecond
	const tenant, n = "acme", 1000
	p := place(t, st, tenant, "runner-1")
	cfg := Config{MaxConcurrent: 16, DrainTimeout: 10 * time.Second}
	// Shard A has two instances, shard B one.
	a1 := startService(t, st, "runner-1", "a1", cfg)
	a2 := startService(t, st, "runner-1", "a2", cfg)
	b1 := startService(t, st, "runner-2", "b1", cfg)
	owning(t, a1, tenant, true)
	owning(t, a2, tenant, true)

	start := time.Now()
	ids := create(t, a1, tenant, n, hookJob(rc.URL, map[string]string{"hello": "world"}))
	created := time.Since(start)
	rc.await(t, 200, 30*time.Second) // jobs are running on A
	moveStart := time.Now()

	p = step(t, st, p, func(p *schema.Placement) { p.Phase, p.Target = schema.PhaseWarming, "runner-2" })
	if err := b1.Warm(context.Background(), tenant, 0); err != nil {
		t.Fatal(err)
	}
	p = step(t, st, p, func(p *schema.Placement) { p.Phase = schema.PhaseHandoff })
	// shardkit drains the source: every instance of A, concurrently.
	release := func() {
		var wg sync.WaitGroup
		for _, a := range []*Service{a1, a2} {
			wg.Go(func() {
				if err := a.Release(context.Background(), tenant); err != nil {
					t.Error(err)
				}
			})
		}
		wg.Wait()
	}
	if !late {
		release()
	}
	_, atHandoff := rc.snapshot()
	p = kittest.Commit(t, st, p, "runner-2")
	owning(t, b1, tenant, true)
	if late {
		release()
	}
	step(t, st, p, func(p *schema.Placement) { p.Phase, p.Source = schema.PhaseActive, "" })

	moved := time.Since(moveStart)
	runs := waitDone(t, b1, tenant, ids, 60*time.Second)
	el := time.Since(start)
	counts, total := rc.snapshot()
	on := map[string]int{}
	for _, id := range ids {
		r := runs[id]
		if r.Status != StatusSucceeded {
			t.Errorf("job %s: %s %s", id, r.Status, r.Error)
		}
		on[r.RanOn]++
		if c := counts[fmt.Sprintf("%s.job.%s.0", tenant, id)]; c != 1 {
			t.Errorf("job %s: effect delivered %d times, want exactly 1", id, c)
		}
	}
	if total != n || len(counts) != n {
		t.Errorf("receiver got %d deliveries of %d keys, want %d of %d", total, len(counts), n, n)
	}
	if on["a1"]+on["a2"] == 0 || on["b1"] == 0 {
		t.Errorf("jobs per instance %v: the move did not happen while jobs ran", on)
	}
	// A run is marked finished before its queue entry is removed: the queue empties right after.
	waitUntil(t, 5*time.Second, "the queue to empty", func() bool {
		d, err := b1.Depth(context.Background(), tenant)
		return err == nil && d == 0
	})
	t.Logf("MEASURED move: %d jobs (created in %v), %d effects delivered once each in %v (%.0f jobs/s); the move took %v; %d delivered before handoff; ran on %v",
		n, created.Round(time.Millisecond), total, el.Round(time.Millisecond), float64(n)/el.Seconds(), moved.Round(time.Millisecond), atHandoff, on)
}

// A release that reaches its bound cancels the runs in flight; the next owner runs them, and
// the effects they had already delivered are not repeated. Release returns at once; the bound
// and the cancel are its background part, which ends with the drain record.
func TestReleaseBound(t *testing.T) {
	st := openStore(t)
	rc := newReceiver(t)
	const tenant = "acme"
	p := place(t, st, tenant, "runner-1")
	block := make(chan struct{})
	var once sync.Once
	slow := func(ctx context.Context, r Run) (Output, error) {
		if r.Attempts == 1 {
			once.Do(func() { close(block) })
			<-ctx.Done() // the first attempt never finishes on its own
			return Output{}, ctx.Err()
		}
		return webhookJob(ctx, r)
	}
	cfg := Config{Logger: testLogger(), DrainTimeout: 100 * time.Millisecond, RetryBackoff: time.Millisecond, Handlers: map[string]Handler{"slow": slow}}
	a := startService(t, st, "runner-1", "a", cfg)
	b := startService(t, st, "runner-2", "b", cfg)
	owning(t, a, tenant, true)
	nj := hookJob(rc.URL, "x")
	nj.Type = "slow"
	ids := create(t, a, tenant, 1, nj)
	<-block
	p = step(t, st, p, func(p *schema.Placement) { p.Phase, p.Target = schema.PhaseWarming, "runner-2" })
	p = step(t, st, p, func(p *schema.Placement) { p.Phase = schema.PhaseHandoff })
	if err := a.Release(context.Background(), tenant); err != nil {
		t.Fatal(err)
	}
	var e jetstream.KeyValueEntry
	waitUntil(t, 10*time.Second, "the source's drain record (written after the release's bound)", func() bool {
		var err error
		e, err = a.sagas.checks.Get(context.Background(), drainKey(tenant))
		return err == nil
	})
	t.Logf("drain record: %s", e.Value())
	var rec struct{ Cancelled int }
	if err := json.Unmarshal(e.Value(), &rec); err != nil || rec.Cancelled != 1 {
		t.Fatalf("drain record %s: want 1 run cancelled (err %v)", e.Value(), err)
	}
	kittest.Commit(t, st, p, "runner-2")
	runs := waitDone(t, b, tenant, ids, 20*time.Second)
	r := runs[ids[0]]
	if r.Status != StatusSucceeded || r.RanOn != "b" || r.Attempts != 2 {
		t.Fatalf("run %+v, want succeeded on b at attempt 2", r)
	}
	rc.await(t, 1, 5*time.Second)
}

// A move aborted before the source's drain at handoff ran: the placement is back on the
// source when shardkit calls Fence. The source takes the tenant up again once drained, instead
// of leaving it released (its jobs waiting) until the next placement change.
func TestFenceAfterAbortTakesTheTenantBack(t *testing.T) {
	st := openStore(t)
	place(t, st, "acme", "runner-1")
	s := startService(t, st, "runner-1", "a", Config{})
	owning(t, s, "acme", true)
	s.Fence("acme")
	owning(t, s, "acme", true)
	ids := create(t, s, "acme", 1, NewJob{Type: "log"})
	if r := waitDone(t, s, "acme", ids, 10*time.Second)[ids[0]]; r.Status != StatusSucceeded {
		t.Fatalf("job after the aborted move's drain: %+v", r)
	}
}
