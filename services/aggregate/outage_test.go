package aggregate

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// A command whose append finds NATS away is tried again, within its CommandTimeout, once NATS
// is back, and applies once: it used to fail at the first refused try (or, when a stream
// leader died before answering, after waiting all of its time).
func TestCommandAppendsAfterNATSComesBack(t *testing.T) {
	srv := natstest.Server(t)
	// No reconnect buffer: a publish made while the server is away fails at once, like one a
	// stream without a leader refuses, instead of being sent after the reconnect.
	nc := natstest.Connect(t, srv.URL(), nats.ReconnectBufSize(-1))
	ctx := context.Background()
	st, err := schema.Open(ctx, nc, schema.Options{})
	if err != nil {
		t.Fatal(err)
	}
	s := newService(t, st, Config{CommandTimeout: 30 * time.Second})
	do(t, s, "acme", cmd("acc1", CmdOpen, 0, "open"))
	cfg := srv.Config()
	srv.Stop()
	done := make(chan error, 1)
	go func() {
		_, err := s.Handle(ctx, "acme", cmd("acc1", CmdDeposit, 10, "dep-1"))
		done <- err
	}()
	deadline := time.Now().Add(10 * time.Second)
	for testutil.ToFloat64(s.m.log.AppendRetries) == 0 {
		select {
		case err := <-done:
			t.Fatalf("the command ended while NATS was away, without a retry: %v", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("no append retried within 10s of NATS going away")
		}
		time.Sleep(5 * time.Millisecond) // polling a counter
	}
	natstest.Restart(t, cfg)
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("command after NATS came back: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the command did not finish within 20s of NATS coming back")
	}
	if n, bal := checkHistory(t, s, "acme", "acc1"); n != 2 || bal != 10 {
		t.Fatalf("history %d events, balance %d; want 2 and 10", n, bal)
	}
}
