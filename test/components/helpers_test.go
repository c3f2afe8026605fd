// Package components_test holds the tests that put components side by side in one process: a
// service, shardkit or a shard's sidecar behind a real gateway, moved by the rebalancer's engine.
// They were in the unit packages' tests, where one component's tests may not import another
// (docs/design.md, "Floors and imports").
package components_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/gateway"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// adminToken is the admin token of the gateways, shards and rebalancers the tests start.
const adminToken = "test-admin-token"

// startGateway runs a gateway on st (cfg's Store, Listener and, when zero, ShutdownTimeout set
// here) until the test ends, and returns its base URL once it is ready.
func startGateway(t testing.TB, st *schema.Store, cfg gateway.Config) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Store, cfg.Listener = st, ln
	if cfg.ShutdownTimeout == 0 {
		cfg.ShutdownTimeout = 5 * time.Second
	}
	g, err := gateway.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			t.Error("gateway did not stop")
		}
	})
	select {
	case <-g.Ready():
	case err := <-done:
		t.Fatalf("gateway: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("gateway not ready")
	}
	return "http://" + ln.Addr().String()
}

// runService runs a service's Run until the test ends, and waits for it to return then.
func runService(t testing.TB, run func(context.Context) error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
}
