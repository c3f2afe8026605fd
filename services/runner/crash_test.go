package runner

import (
	"context"
	"encoding/json"
	"testing"
	"time"
)

// An instance that died mid-run leaves a run "running" and maybe a marker: the next claimant
// takes the job over when the lease ends; an effect the dead instance delivered is not
// repeated, one it only started is delivered (once) by the new claimant.
func TestCrashRecovery(t *testing.T) {
	st := openStore(t)
	rc := newReceiver(t)
	const tenant = "acme"
	p := place(t, st, tenant, "runner-9") // queued while no instance serves it
	s := startService(t, st, "runner-1", "a", Config{})
	ids := create(t, s, tenant, 2, hookJob(rc.URL, "x"))
	ctx := context.Background()
	past := time.Now().Add(-time.Minute).UTC()
	// Both jobs were claimed by an instance that died; it delivered the first job's effect
	// (marker "delivered") and was delivering the second's when it died (marker "delivering").
	for i, id := range ids {
		r, err := s.Get(ctx, tenant, id)
		if err != nil {
			t.Fatal(err)
		}
		r.Status, r.Attempts, r.RanOn, r.StartedAt, r.LeaseUntil = StatusRunning, 1, "dead", &past, &past
		if err := s.store.putRun(ctx, &r); err != nil {
			t.Fatal(err)
		}
		state := markDelivered
		if i == 1 {
			state = markDelivering
		}
		b, _ := json.Marshal(marker{State: state, By: "dead", At: past, Until: past})
		if _, err := s.outbox.markers.Create(ctx, tenant+".job."+id+".0", b); err != nil {
			t.Fatal(err)
		}
	}
	next := p
	next.Shard, next.Epoch = "runner-1", p.Epoch+1
	if _, err := st.Placements(next.Kind).Update(ctx, p, next); err != nil {
		t.Fatal(err)
	}
	runs := waitDone(t, s, tenant, ids, 10*time.Second)
	for _, id := range ids {
		if r := runs[id]; r.Status != StatusSucceeded || r.Attempts != 2 || r.RanOn != "a" {
			t.Fatalf("run %+v, want succeeded by a at attempt 2", r)
		}
	}
	rc.await(t, 1, 5*time.Second)
	counts, total := rc.snapshot()
	if total != 1 || counts[tenant+".job."+ids[0]+".0"] != 0 || counts[tenant+".job."+ids[1]+".0"] != 1 {
		t.Fatalf("deliveries %v: want only the second job's effect, once", counts)
	}
}

// A marker write whose answer was lost (a leader election) is recognised as ours by its token
// on the next read: the delivery goes on instead of waiting out its own lease as if another
// instance held it.
func TestTakeMarkerRecognisesItsOwnLostWrite(t *testing.T) {
	st := openStore(t)
	s := startService(t, st, "runner-1", "a", Config{})
	ctx := context.Background()
	now := time.Now().UTC()
	b, _ := json.Marshal(marker{State: markDelivering, By: "a", Token: "t1", At: now, Until: now.Add(time.Minute)})
	rev, err := s.outbox.markers.Create(ctx, "acme.job.x.0", b)
	if err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	h, err := s.outbox.takeMarker(short, "acme.job.x.0", "t1")
	if err != nil || h.rev != rev || h.token != "t1" {
		t.Fatalf("takeMarker with the writer's token: %+v, %v; want revision %d", h, err, rev)
	}
	if _, err := s.outbox.takeMarker(short, "acme.job.x.0", "t2"); err == nil {
		t.Fatal("takeMarker with another token took a marker whose lease runs for a minute")
	}
}
