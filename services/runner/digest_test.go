package runner

import (
	"context"
	"fmt"
	"testing"
	"time"

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

// A claim under way when a move's source fences gives its job back (pending, no attempt) once
// it finds the tenant released. The source's digest waits for that: read before, it would see
// the job running and leave it out, while the target, reading later, counts it queued (a false
// mismatch a quiet 1,000-move e2e run hit).
func TestFenceDigestWaitsForClaimsUnderWay(t *testing.T) {
	ctx := context.Background()
	st := openStore(t)
	kc := schema.DefaultKindConfig(Kind)
	kc.Verify = true
	if _, err := st.Kinds().Put(ctx, kc); err != nil {
		t.Fatal(err)
	}
	s := startService(t, st, "runner-1", "i1", Config{})
	waitUntil(t, 5*time.Second, "the runner to follow the kind's verify flag", s.verify.Load)
	place(t, st, "acme", "runner-1")
	owning(t, s, "acme", true)
	id := create(t, s, "acme", 1, NewJob{Type: "noop", Delay: "1h"})[0] // not due: nothing claims it

	// A claim under way, as the dispatcher starts one: the run is running, attempt 1.
	s.mu.Lock()
	tq := s.tenants["acme"]
	tq.claiming++
	s.mu.Unlock()
	r, err := s.store.getLatest(ctx, "acme", id)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	lease := now.Add(time.Minute)
	r.Status, r.Attempts, r.RanOn, r.StartedAt, r.LeaseUntil = StatusRunning, 1, "i1", &now, &lease
	if err := s.store.putRun(ctx, &r); err != nil {
		t.Fatal(err)
	}

	s.Fence("acme")
	s.mu.Lock()
	c := s.fenced["acme"]
	s.mu.Unlock()
	select {
	case <-c.done:
		t.Fatalf("the source read its digest (%+v) while a claim was under way", c.d)
	case <-time.After(300 * time.Millisecond): // a read that did not wait takes a few ms
	}
	s.exec.unclaim(&r) // the claim finds the tenant released: the job goes back to pending
	s.exec.claimSettled(tq)
	d, err := s.Digest(ctx, "acme", 0)
	if err != nil {
		t.Fatal(err)
	}
	if d.Items != 1 {
		t.Fatalf("the source's digest counts %d queued jobs, want the 1 given back: %+v", d.Items, d)
	}
}
