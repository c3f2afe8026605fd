package runner

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// signalHandler is a slog handler that closes seen the first time a record's message starts
// with prefix.
type signalHandler struct {
	prefix string
	once   *sync.Once
	seen   chan struct{}
}

func (h signalHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h signalHandler) Handle(_ context.Context, r slog.Record) error {
	if strings.HasPrefix(r.Message, h.prefix) {
		h.once.Do(func() { close(h.seen) })
	}
	return nil
}
func (h signalHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h signalHandler) WithGroup(string) slog.Handler      { return h }

// A run that ends while NATS is away records its outcome once NATS is back, within its lease,
// instead of staying "running" until the lease runs out and another claim picks it up.
func TestOutcomeRecordedAfterNATSComesBack(t *testing.T) {
	runAcrossNATSOutage(t, "recording job outcome", false)
}

// A run whose effects are recorded and delivered while NATS is away does that once NATS is
// back, in the same attempt: each outbox and marker call is tried again on its own short
// timeout, where a call that found no server (or whose answer was lost in a leader election)
// used to fail the attempt or hold it for the run's whole 30 s.
func TestEffectsRecordedAfterNATSComesBack(t *testing.T) {
	runAcrossNATSOutage(t, "recording an effect", true)
}

// runAcrossNATSOutage stops NATS while a job runs, lets the run end, waits for the log line
// (retrying) that says a NATS call failed and is being tried again, restarts NATS and checks
// that the job succeeded at its first attempt, long before its lease ran out, with its effect
// (withEffect) delivered once.
func runAcrossNATSOutage(t *testing.T, retrying string, withEffect bool) {
	srv := natstest.Server(t)
	// No reconnect buffer: a request made while the server is away fails at once instead of
	// being sent (and applied) after the reconnect, like one a stream without a leader refuses.
	reconnected := make(chan struct{}, 1)
	nc := natstest.Connect(t, srv.URL(), nats.ReconnectBufSize(-1), nats.ReconnectHandler(func(*nats.Conn) {
		select {
		case reconnected <- struct{}{}:
		default:
		}
	}))
	st, err := schema.Open(context.Background(), nc, schema.Options{})
	if err != nil {
		t.Fatal(err)
	}
	rc := newReceiver(t)
	place(t, st, "acme", "runner-1")
	started, release := make(chan struct{}), make(chan struct{})
	gate := func(ctx context.Context, r Run) (Output, error) {
		close(started)
		select {
		case <-release:
		case <-ctx.Done():
		}
		out := Output{Result: []byte(`{"ok":true}`)}
		if withEffect {
			out.Effects = []Request{{Effect: "webhook", To: rc.URL, Body: []byte(`{"n":1}`)}}
		}
		return out, nil
	}
	seen := signalHandler{prefix: retrying, once: &sync.Once{}, seen: make(chan struct{})}
	// A 30 s run timeout gives a 35 s lease: the job must finish long before that.
	s := startService(t, st, "runner-1", "a", Config{OpTimeout: 300 * time.Millisecond, Logger: slog.New(seen),
		Handlers: map[string]Handler{"gate": gate}})
	owning(t, s, "acme", true)
	ids := create(t, s, "acme", 1, NewJob{Type: "gate"})
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the job did not start within 10s")
	}
	cfg := srv.Config()
	srv.Stop()
	close(release) // the run ends while NATS is away
	select {
	case <-seen.seen:
	case <-time.After(10 * time.Second):
		t.Fatalf("no %q retry logged while NATS was away", retrying)
	}
	natstest.Restart(t, cfg)
	select {
	case <-reconnected:
	case <-time.After(10 * time.Second):
		t.Fatal("no reconnect within 10s of the restart")
	}
	var r Run
	waitUntil(t, 10*time.Second, "the job's outcome recorded (its lease runs 35s)", func() bool {
		var err error
		r, err = s.Get(context.Background(), "acme", ids[0])
		return err == nil && r.Status.done()
	})
	if r.Status != StatusSucceeded || r.Attempts != 1 || r.RanOn != "a" {
		t.Fatalf("run %+v, want succeeded at the first attempt", r)
	}
	if withEffect {
		if counts, total := rc.snapshot(); total != 1 || len(r.Effects) != 1 || counts[r.Effects[0]] != 1 {
			t.Fatalf("deliveries %v for effects %v: want the one effect, once", counts, r.Effects)
		}
	}
}

// A write stored by a try whose answer was lost makes the next try conflict: reading the run
// back tells our own write (go on) from another instance's (a real conflict).
func TestLostRunWriteRecognised(t *testing.T) {
	st := openStore(t)
	place(t, st, "acme", "runner-9") // queued while no instance serves it
	s := startService(t, st, "runner-1", "a", Config{})
	ctx := context.Background()
	ids := create(t, s, "acme", 2, NewJob{Type: "log"})
	claimed := func(id, by string) Run {
		r, err := s.store.getLatest(ctx, "acme", id)
		if err != nil {
			t.Fatal(err)
		}
		now, lease := time.Now().UTC(), time.Now().UTC().Add(time.Minute)
		r.Status, r.Attempts, r.RanOn, r.StartedAt, r.LeaseUntil = StatusRunning, 1, by, &now, &lease
		return r
	}
	// Ours landed though its answer was lost: the try again (on the old revision) succeeds.
	ours := claimed(ids[0], "a")
	landed := ours
	if err := s.store.putRun(ctx, &landed); err != nil {
		t.Fatal(err)
	}
	if err := s.exec.putRunRetrying(ctx, &ours, "test"); err != nil || ours.rev != landed.rev {
		t.Fatalf("retrying a write that landed: %v (revision %d, want %d)", err, ours.rev, landed.rev)
	}
	// A sibling's claim landed first: ours conflicts.
	sibling, mine := claimed(ids[1], "b"), claimed(ids[1], "a")
	if err := s.store.putRun(ctx, &sibling); err != nil {
		t.Fatal(err)
	}
	if err := s.exec.putRunRetrying(ctx, &mine, "test"); !schema.IsConflict(err) {
		t.Fatalf("claiming a job a sibling claimed first: %v, want a conflict", err)
	}
}
