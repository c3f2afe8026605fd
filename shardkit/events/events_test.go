package events_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit/events"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// counters is a test service's state: a count per subject.
type counters struct {
	N map[string]int `json:"n"`
}

var errTooMany = errors.New("counter full")

func openStore(t testing.TB) *schema.Store {
	t.Helper()
	st := kittest.StoreAt(t, natstest.Server(t).URL())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := st.JS().JetStream().CreateStream(ctx, jetstream.StreamConfig{Name: "COUNTERS", Subjects: []string{"counters.>"}}); err != nil {
		t.Fatal(err)
	}
	return st
}

// newLog is one instance's log of counters, running until the test ends.
func newLog(t testing.TB, st *schema.Store, snapshots string) *events.Log[*counters] {
	t.Helper()
	l, err := events.New(context.Background(), events.Config[*counters]{
		Store: st, Kind: "counter", Stream: "COUNTERS", Snapshots: snapshots,
		Prefix: func(tenant string) string { return "counters." + tenant + "." },
		New:    func() *counters { return &counters{N: map[string]int{}} },
		Apply: func(c *counters, ev events.Event) error {
			if ev.Type != "inc" {
				return fmt.Errorf("unknown event %q", ev.Type)
			}
			c.N[ev.Subject]++
			return nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = l.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return l
}

// inc adds one to subject unless it reached limit.
func inc(l *events.Log[*counters], tenant, subject, key string, limit int) (events.Result, error) {
	return l.Execute(context.Background(), tenant, subject, key, func(c *counters, at events.Position) (events.Event, error) {
		if c.N[subject] != int(at.Version) {
			return events.Event{}, fmt.Errorf("state says %d, position %d", c.N[subject], at.Version)
		}
		if c.N[subject] >= limit {
			return events.Event{}, errTooMany
		}
		return events.Event{Type: "inc", Data: []byte(strconv.Itoa(c.N[subject] + 1))}, nil
	})
}

// Two instances that both believe they own a tenant write the same subject at once: every
// command applies once, in one history without a fork (versions 1..n), and a rejection is
// decided on the subject's last stored event.
func TestTwoWritersCannotFork(t *testing.T) {
	st := openStore(t)
	a, b := newLog(t, st, ""), newLog(t, st, "")
	var wg sync.WaitGroup
	for w, l := range []*events.Log[*counters]{a, b, a, b} {
		wg.Go(func() {
			for i := range 20 {
				if _, err := inc(l, "acme", "c.x", fmt.Sprintf("w%d-%d", w, i), 1000); err != nil {
					t.Errorf("writer %d command %d: %v", w, i, err)
				}
			}
		})
	}
	wg.Wait()
	var seqs []uint64
	if _, err := a.Replay(context.Background(), "acme", "c.x", 0, func(ev events.Event) error {
		seqs = append(seqs, ev.Seq)
		if want := strconv.Itoa(len(seqs)); string(ev.Data) != want {
			return fmt.Errorf("event %d carries %s: history forked", len(seqs), ev.Data)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if len(seqs) != 80 {
		t.Fatalf("%d events for 80 commands", len(seqs))
	}
	// b has not seen a's last writes; its limit check must see them before rejecting.
	if _, err := inc(b, "acme", "c.x", "over", 80); !errors.Is(err, errTooMany) {
		t.Fatalf("the 81st increment with limit 80: %v, want errTooMany", err)
	}
	// A stale append is refused by the stream itself.
	if _, _, err := a.Append(context.Background(), "acme", events.Event{Subject: "c.x", Type: "inc", Data: []byte("2")}, seqs[0]); !errors.Is(err, events.ErrStale) {
		t.Fatalf("append expecting an old sequence: %v, want ErrStale", err)
	}
}

// A retried key answers the first outcome, on the instance that ran it, on a new owner that
// loaded the released tenant's snapshot, and on one that rebuilt it from the events alone.
func TestIdempotencySurvivesMoves(t *testing.T) {
	st := openStore(t)
	ctx := context.Background()
	src := newLog(t, st, "counter_snapshots")
	first, err := inc(src, "acme", "c.x", "k1", 10)
	if err != nil || first.Replayed || first.Version != 1 {
		t.Fatalf("first: %+v %v", first, err)
	}
	for i := range 5 {
		if _, err := inc(src, "acme", "c.y", fmt.Sprintf("y%d", i), 10); err != nil {
			t.Fatal(err)
		}
	}
	again, err := inc(src, "acme", "c.x", "k1", 10)
	if err != nil || !again.Replayed || again.Seq != first.Seq || again.Version != 1 || again.Type != "inc" {
		t.Fatalf("again on the source: %+v %v", again, err)
	}
	fence := src.Fence("acme")
	if err := src.Release(ctx, "acme"); err != nil { // writes the snapshot
		t.Fatal(err)
	}
	if sz, err := src.TenantSize(ctx, "acme"); err != nil || sz.Events != 6 || sz.SnapshotSeq != fence || sz.Subjects != 2 {
		t.Fatalf("size after release: %+v %v", sz, err)
	}
	for _, tc := range []struct {
		name      string
		snapshots string
	}{{"snapshot", "counter_snapshots"}, {"replay", ""}} {
		t.Run(tc.name, func(t *testing.T) {
			tgt := newLog(t, st, tc.snapshots)
			if err := tgt.Warm(ctx, "acme", fence); err != nil {
				t.Fatal(err)
			}
			if got := tgt.Applied("acme"); got < fence {
				t.Fatalf("warmed to %d of fence %d", got, fence)
			}
			r, err := inc(tgt, "acme", "c.x", "k1", 10)
			if err != nil || !r.Replayed || r.Seq != first.Seq || r.Version != 1 {
				t.Fatalf("k1 on the new owner: %+v %v", r, err)
			}
			r, err = inc(tgt, "acme", "c.y", "y-new-"+tc.name, 10)
			if err != nil || r.Replayed || r.Version < 6 {
				t.Fatalf("a new command on the new owner: %+v %v", r, err)
			}
		})
	}
}

// A warmed target follows the stream until the handoff, so the source's fence is applied
// without a replay; its first command ends the follow.
func TestWarmTargetFollows(t *testing.T) {
	st := openStore(t)
	ctx := context.Background()
	src, tgt := newLog(t, st, ""), newLog(t, st, "")
	if _, err := inc(src, "acme", "c.x", "k0", 100); err != nil {
		t.Fatal(err)
	}
	if err := tgt.Warm(ctx, "acme", 0); err != nil {
		t.Fatal(err)
	}
	if !tgt.Following("acme") {
		t.Fatal("a target warmed with fence 0 does not follow the tenant")
	}
	for i := range 10 {
		if _, err := inc(src, "acme", "c.x", fmt.Sprintf("k%d", i+1), 100); err != nil {
			t.Fatal(err)
		}
	}
	fence := src.Fence("acme")
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := tgt.Warm(wctx, "acme", fence); err != nil {
		t.Fatal(err)
	}
	if r, err := inc(tgt, "acme", "c.x", "on-target", 100); err != nil || r.Version != 12 {
		t.Fatalf("first command on the target: %+v %v", r, err)
	}
	if tgt.Following("acme") {
		t.Fatal("the new owner still follows after its first command")
	}
}

// A takeover fences the former owner on the stream: once the new owner stored its epoch
// marker, no append of the former owner succeeds, to an old subject or a new one, whatever
// its view of placement says; its reads fail too once it has caught up to the marker; and the
// new owner's state holds every write the former owner made before the marker.
func TestTakeoverFencesTheFormerOwner(t *testing.T) {
	st := openStore(t)
	a, b := newLog(t, st, ""), newLog(t, st, "")
	aEpoch, bEpoch := uint64(1), uint64(0) // a owns acme at epoch 1; b does not own it yet
	a.SetWriteEpoch(func(string) uint64 { return aEpoch })
	b.SetWriteEpoch(func(string) uint64 { return bEpoch })
	for i := range 3 {
		if _, err := inc(a, "acme", "c.x", fmt.Sprintf("a%d", i), 100); err != nil {
			t.Fatal(err)
		}
	}
	ctx := context.Background()
	fence, err := b.Takeover(ctx, "acme", 2)
	if err != nil {
		t.Fatal(err)
	}
	if again, err := b.Takeover(ctx, "acme", 2); err != nil || again != fence {
		t.Fatalf("a second takeover at the same epoch: fence %d (first %d), %v: the marker must be stored once", again, fence, err)
	}
	// a still believes it owns acme at epoch 1 (a frozen process, a view behind): every
	// write fails, to the subject it wrote and to one it never wrote.
	for _, subject := range []string{"c.x", "c.new"} {
		if _, err := inc(a, "acme", subject, "late-"+subject, 100); !errors.Is(err, schema.ErrFenced) {
			t.Fatalf("the former owner's append to %s after the marker: %v, want schema.ErrFenced", subject, err)
		}
	}
	if err := a.Read(ctx, "acme", "", func(*counters, uint64) error { return nil }); !errors.Is(err, schema.ErrFenced) {
		t.Fatalf("the former owner's read after catching up to the marker: %v, want schema.ErrFenced", err)
	}
	// b warms up to the fence and, once it owns acme at epoch 2, has a's writes and writes.
	if err := b.Warm(ctx, "acme", fence); err != nil {
		t.Fatal(err)
	}
	if got := b.Applied("acme"); got < fence {
		t.Fatalf("b applied %d, fence %d", got, fence)
	}
	if _, err := inc(b, "acme", "c.x", "b-before-commit", 100); !errors.Is(err, schema.ErrFenced) {
		t.Fatalf("the new owner before it owns the tenant: %v, want schema.ErrFenced", err)
	}
	bEpoch = 2
	res, err := inc(b, "acme", "c.x", "b0", 100)
	if err != nil || res.Version != 4 {
		t.Fatalf("the new owner's first command: version %d, %v; want version 4 after a's 3", res.Version, err)
	}
	var n int
	if _, err := b.Replay(ctx, "acme", "", 0, func(ev events.Event) error {
		if ev.Subject != events.EpochSubject {
			n++
		}
		return nil
	}); err != nil || n != 4 {
		t.Fatalf("%d events of the service (%v), want a's 3 and b's 1: nothing of a's after the marker", n, err)
	}
	// A later move of the tenant the usual way (drain, no marker) passes the fence: the new
	// owner's epoch is past the marker's.
	aEpoch = 3
	if _, err := inc(a, "acme", "c.x", "a-again", 100); err != nil {
		t.Fatalf("a, owner again at epoch 3: %v", err)
	}
}
