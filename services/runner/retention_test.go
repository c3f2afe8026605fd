package runner

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// A finished run and its effect's delivery marker are removed by JetStream after Retention;
// an unfinished run is not, however old.
func TestFinishedRunsExpire(t *testing.T) {
	st := openStore(t)
	rc := newReceiver(t)
	place(t, st, "acme", "runner-1")
	place(t, st, "initech", "runner-9") // nobody serves it: its job stays pending
	s := startService(t, st, "runner-1", "a", Config{Retention: time.Second})
	waiting := create(t, s, "initech", 1, hookJob(rc.URL, "later"))
	done := create(t, s, "acme", 1, hookJob(rc.URL, "now"))
	r := waitDone(t, s, "acme", done, 10*time.Second)[done[0]]
	if r.Status != StatusSucceeded || len(r.Effects) != 1 {
		t.Fatalf("run %+v, want succeeded with one effect", r)
	}
	ctx := context.Background()
	if _, err := s.outbox.markers.Get(ctx, r.Effects[0]); err != nil {
		t.Fatalf("the effect's marker right after the run: %v", err)
	}
	waitUntil(t, 10*time.Second, "the finished run and its marker removed", func() bool {
		_, err := s.Get(ctx, "acme", r.ID)
		_, merr := s.outbox.markers.Get(ctx, r.Effects[0])
		return errors.Is(err, ErrNoJob) && errors.Is(merr, jetstream.ErrKeyNotFound)
	})
	if w, err := s.store.getLatest(ctx, "initech", waiting[0]); err != nil || w.Status != StatusPending {
		t.Fatalf("the unfinished run: %+v %v, want it pending still", w, err)
	}
}
