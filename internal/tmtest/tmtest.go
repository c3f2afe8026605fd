// Package tmtest holds test helpers several packages share: a schema store on a fresh embedded
// nats-server, and a running shardkit instance. Everything it starts stops when the test ends.
package tmtest

import (
	"context"
	"errors"
	"net/http"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// ResourceCheck fails the test if it leaves goroutines behind: at the very end of the test
// (after every other cleanup, which stops what the test started), the goroutines that did not
// exist when ResourceCheck was called must be gone within a few seconds (go.uber.org/goleak;
// Tailscale's tstest.ResourceCheck is the same idea). Idle keep-alive connections of HTTP
// clients are not counted: net/http owns and reaps them. Nor is the one goroutine nats.go
// (v1.55.0) can strand per object-store Put: ObjectStore.Put starts a private publisher whose
// resetPendingAcksOnReconnect goroutine reads its status channel under a lock, and the Put's
// deferred cleanup may clear that channel first, leaving the goroutine on a nil channel for
// good. It is a library race, not ours; it showed in CI once under load.
func ResourceCheck(t testing.TB) {
	t.Helper()
	opts := []goleak.Option{goleak.IgnoreCurrent(),
		goleak.IgnoreAnyFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreAnyFunction("net/http.(*persistConn).writeLoop"),
		goleak.IgnoreTopFunction("github.com/nats-io/nats.go/jetstream.(*jetStream).resetPendingAcksOnReconnect")}
	t.Cleanup(func() {
		if t.Failed() {
			return // the failure says more than the goroutines it left
		}
		var err error
		for deadline := time.Now().Add(leakWait); time.Now().Before(deadline); {
			if err = goleak.Find(opts...); err == nil { // Find itself retries for about 2 s
				return
			}
		}
		t.Errorf("goroutines left behind by the test:\n%v", err)
	})
}

// leakWait is how long ResourceCheck waits for a test's goroutines to end.
var leakWait = 10 * time.Second

// Store starts an embedded JetStream server and opens a store on it; URL is the server's. The
// test is checked for goroutines it leaves behind (ResourceCheck).
func Store(t testing.TB) (st *schema.Store, url string) {
	t.Helper()
	ResourceCheck(t)
	srv := natstest.Server(t)
	return StoreAt(t, srv.URL()), srv.URL()
}

// StoreAt opens a store on the server at url, with a connection of its own.
func StoreAt(t testing.TB, url string) *schema.Store {
	t.Helper()
	nc := natstest.Connect(t, url)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := schema.Open(ctx, nc, schema.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// Shard runs a shardkit instance until the test ends and returns it once it serves. Zero fields
// get test defaults: URL http://127.0.0.1:9 (nothing listens; moves and signals need no HTTP),
// heartbeat 200ms, drain bound 2s, instance "i1".
func Shard(t testing.TB, cfg shardkit.Config) *shardkit.Shard {
	t.Helper()
	if cfg.URL == "" {
		cfg.URL = "http://127.0.0.1:9"
	}
	if cfg.Heartbeat == 0 {
		cfg.Heartbeat = 200 * time.Millisecond
	}
	if cfg.DrainTimeout == 0 {
		cfg.DrainTimeout = 2 * time.Second
	}
	if cfg.ID.Instance == "" {
		cfg.ID.Instance = "i1"
	}
	sk, err := shardkit.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = sk.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	select {
	case <-sk.Running():
	case <-time.After(20 * time.Second):
		t.Fatal("shard did not start")
	}
	return sk
}

// Commit ends the handoff prev (a placement in handoff to shard to) as a test driving the move
// protocol by hand: it writes the commit, draining on to at the next epoch, unless the target
// committed first (shardkit commits once the target is at the fence), and returns the
// committed placement.
func Commit(t testing.TB, st *schema.Store, prev schema.Placement, to string) schema.Placement {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	next := schema.Placement{Kind: prev.Kind, Tenant: prev.Tenant, Shard: to, Epoch: prev.Epoch + 1,
		Phase: schema.PhaseDraining, Source: prev.Shard, Move: prev.Move, Pinned: prev.Pinned}
	got, err := st.UpdatePlacement(ctx, prev, next)
	if err == nil {
		return got
	}
	if !errors.As(err, new(*schema.ConflictError)) {
		t.Fatal(err)
	}
	got, err = st.LatestPlacement(ctx, prev.Kind, prev.Tenant)
	if err != nil {
		t.Fatal(err)
	}
	if got.Phase != schema.PhaseDraining || got.Shard != to || got.Source != prev.Shard || got.Epoch != prev.Epoch+1 {
		t.Fatalf("committing %s/%s to %s: the placement changed to %s@%d %s", prev.Kind, prev.Tenant, to, got.Shard, got.Epoch, got.Phase)
	}
	return got
}

// WaitFor polls cond until it returns nil or within passes, then fails the test with cond's
// last error, so a timeout says what was still missing. It is for state no event announces
// (snapshots of NATS state, a process's view); every wait has its deadline. It polls every
// 5 ms (a condition may count consecutive observations).
func WaitFor(t testing.TB, within time.Duration, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("still waiting after %v: %v", within, err)
			return
		}
		time.Sleep(5 * time.Millisecond) // polling: the condition has no event to await
	}
}

// Until is WaitFor's condition for a bool: what names the state waited for.
func Until(what string, cond func() bool) func() error {
	return func() error {
		if cond() {
			return nil
		}
		return errors.New(what + ": not yet")
	}
}

// HTTP is the client tests use for the servers they start: every call is bounded, so a server
// that hangs fails the test at the bound, with the call named, instead of at go test's timeout.
// A stream that stays open longer (server-sent events) takes a request context instead.
var HTTP = &http.Client{Timeout: 30 * time.Second}
