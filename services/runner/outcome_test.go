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
	place(t, st, "acme", "runner-1")
	started, release := make(chan struct{}), make(chan struct{})
	gate := func(ctx context.Context, r Run) (Output, error) {
		close(started)
		select {
		case <-release:
		case <-ctx.Done():
		}
		return Output{Result: []byte(`{"ok":true}`)}, nil
	}
	retrying := signalHandler{prefix: "recording job outcome", once: &sync.Once{}, seen: make(chan struct{})}
	// A 30 s run timeout gives a 35 s lease: the job must finish long before that.
	s := startService(t, st, "runner-1", "a", Config{OpTimeout: 300 * time.Millisecond, Logger: slog.New(retrying),
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
	case <-retrying.seen:
	case <-time.After(10 * time.Second):
		t.Fatal("no attempt to record the outcome failed while NATS was away")
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
}
