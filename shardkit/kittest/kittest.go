// Package kittest holds the test helpers that need shardkit: a schema store on a fresh embedded
// nats-server, a running shardkit instance or shard binary main (shardmain), and a hand-driven move commit. Everything it starts
// stops when the test ends. The helpers that need nothing above internal/ (ResourceCheck,
// WaitFor, HTTP) are in internal/tmtest.
//
// shardkit's own packages use it from their external tests (package x_test), which may import a
// package that imports x.
package kittest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/natsperm"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/shardmain"
)

// The built-in roles run on scoped keys in tests as in a deployment: their credentials carry a
// name and a tag, and the server fills in their permissions.
func init() { natstest.KeepScopes(natsperm.Scopes()...) }

// Store starts an embedded JetStream server and opens a store on it; URL is the server's. The
// test is checked for goroutines it leaves behind (ResourceCheck).
func Store(t testing.TB) (st *schema.Store, url string) {
	t.Helper()
	tmtest.ResourceCheck(t)
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
	Run(t, sk)
	return sk
}

// Run runs sk until the test ends and waits (up to 20 s) until it is running.
func Run(t testing.TB, sk *shardkit.Shard) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = sk.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	select {
	case <-sk.Running():
	case <-time.After(20 * time.Second):
		t.Fatalf("shard %s did not start within 20 s", sk.ID().Key())
	}
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
	got, err := st.Placements(next.Kind).Update(ctx, prev, next)
	if err == nil {
		return got
	}
	if !errors.As(err, new(*schema.ConflictError)) {
		t.Fatal(err)
	}
	got, err = st.Placements(prev.Kind).Latest(ctx, prev.Tenant)
	if err != nil {
		t.Fatal(err)
	}
	if got.Phase != schema.PhaseDraining || got.Shard != to || got.Source != prev.Shard || got.Epoch != prev.Epoch+1 {
		t.Fatalf("committing %s/%s to %s: the placement changed to %s@%d %s", prev.Kind, prev.Tenant, to, got.Shard, got.Epoch, got.Phase)
	}
	return got
}

// Main runs m, a shard binary's main in process, with build until the test ends, and returns
// its URL once it listens.
func Main(t testing.TB, m *shardmain.Main, build shardmain.Builder) string {
	t.Helper()
	ready := m.Listening()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	var runErr error
	go func() { defer close(done); runErr = m.Run(ctx, build) }()
	t.Cleanup(func() { cancel(); <-done })
	select {
	case url := <-ready:
		return url
	case <-done:
		t.Fatalf("%s/%s stopped before serving: %v", m.Kind, m.Shard, runErr)
	case <-time.After(30 * time.Second):
		t.Fatalf("%s/%s not serving within 30s", m.Kind, m.Shard)
	}
	return ""
}

// AwaitPlacement waits until tenant's placement of kind satisfies ok (WaitPlacement) and returns
// it; within bounds the wait, after which the test fails with the placement last seen.
func AwaitPlacement(t testing.TB, st *schema.Store, kind, tenant string, within time.Duration, what string, ok func(schema.Placement) bool) schema.Placement {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	p, err := WaitPlacement(ctx, st, kind, tenant, ok)
	if err != nil {
		t.Fatalf("placement %s/%s not %s within %v: %v", kind, tenant, what, within, err)
	}
	return p
}

// WaitPlacement waits until tenant's placement of kind satisfies ok, following the bucket's key
// (each change is an event: no polling), and returns it; when ctx ends first, the error names
// the placement last seen.
func WaitPlacement(ctx context.Context, st *schema.Store, kind, tenant string, ok func(schema.Placement) bool) (schema.Placement, error) {
	kv, err := st.Placements(kind).KV(ctx)
	if err != nil {
		return schema.Placement{}, err
	}
	w, err := kv.Watch(ctx, tenant)
	if err != nil {
		return schema.Placement{}, err
	}
	defer func() { _ = w.Stop() }()
	var last schema.Placement
	for {
		select {
		case e := <-w.Updates():
			if e == nil || e.Operation() != jetstream.KeyValuePut {
				continue // nil: the watch's first values are in
			}
			var p schema.Placement
			if err := json.Unmarshal(e.Value(), &p); err != nil {
				return last, fmt.Errorf("placement %s/%s: %w", kind, tenant, err)
			}
			p.Revision = e.Revision()
			if last = p; ok(p) {
				return p, nil
			}
		case <-ctx.Done():
			return last, fmt.Errorf("%w; last seen: %+v", ctx.Err(), last)
		}
	}
}
