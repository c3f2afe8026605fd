package placement_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// recorder keeps every change the watcher applied, in order.
type recorder struct {
	mu   sync.Mutex
	revs []uint64
	seen chan uint64
}

func newRecorder() *recorder { return &recorder{seen: make(chan uint64, 4096)} }

func (r *recorder) onChange(c placement.Change) {
	if !c.NewOK {
		return
	}
	r.mu.Lock()
	r.revs = append(r.revs, c.New.Revision)
	r.mu.Unlock()
	r.seen <- c.New.Revision
}

// await waits until revision rev has been applied.
func (r *recorder) await(t *testing.T, rev uint64, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	deadline := time.After(within)
	for {
		r.mu.Lock()
		for _, v := range r.revs {
			if v >= rev {
				r.mu.Unlock()
				return time.Since(start)
			}
		}
		r.mu.Unlock()
		select {
		case <-r.seen:
		case <-deadline:
			t.Fatalf("revision %d not applied within %s", rev, within)
		}
	}
}

// check asserts the applied revisions are exactly want, in order: no gap, no duplicate.
func (r *recorder) check(t *testing.T, want []uint64) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.revs) != len(want) {
		t.Fatalf("applied %d changes, want %d (applied %v)", len(r.revs), len(want), r.revs)
	}
	for i := range want {
		if r.revs[i] != want[i] {
			t.Fatalf("change %d has revision %d, want %d", i, r.revs[i], want[i])
		}
	}
}

// put writes placement i, retrying while the cluster elects leaders. Writes below 30 cycle
// over 20 keys (so the initial values are the last per key); later writes use a key each, so
// none is superseded and every one of their revisions must reach the watcher.
func put(t *testing.T, kv jetstream.KeyValue, i int) uint64 {
	t.Helper()
	key := fmt.Sprintf("t%d", i)
	if i < 30 {
		key = fmt.Sprintf("t%d", i%20)
	}
	val := fmt.Sprintf(`{"kind":"aggregate","tenant":%q,"shard":"aggregate-%d","epoch":%d,"phase":"active"}`, key, i%4, i+1)
	deadline := time.Now().Add(20 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		rev, err := kv.Put(ctx, key, []byte(val))
		cancel()
		if err == nil {
			return rev
		}
		if time.Now().After(deadline) {
			t.Fatalf("put %d: %v", i, err)
		}
	}
}

func TestWatcherSurvivesServerRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("integration: restarts nats-server")
	}
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	ctx := context.Background()
	kv, err := st.Placements("aggregate").KV(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var want []uint64
	for i := range 30 {
		want = append(want, put(t, kv, i))
	}
	rec := newRecorder()
	w := startWatcher(t, placement.Config{Store: st, Kinds: []string{"aggregate"}, OnChange: rec.onChange})
	// Initial values: the last revision of each of the 20 keys.
	initial := want[10:]
	rec.await(t, want[len(want)-1], 10*time.Second)
	rec.check(t, initial)

	cfg := srv.Config()
	srv.Stop()
	srv2 := natstest.Restart(t, cfg)
	reachable := time.Now()
	_ = srv2
	var after []uint64
	for i := 30; i < 60; i++ {
		after = append(after, put(t, kv, i))
	}
	resumed := rec.await(t, after[len(after)-1], 15*time.Second)
	t.Logf("all post-restart changes applied %s after the server was reachable (%s after the last put)",
		time.Since(reachable).Round(time.Millisecond), resumed.Round(time.Millisecond))
	rec.check(t, append(initial, after...))
	if s, _ := w.Stats("aggregate"); s.Resumes == 0 {
		t.Fatalf("expected the watch to have been resumed, stats %+v", s)
	}
	if got, _ := w.Lookup("aggregate", "t59"); got.Epoch != 60 {
		t.Fatalf("t59 = %+v, want epoch 60", got)
	}
}

func TestWatcherSurvivesClusterNodeLoss(t *testing.T) {
	if testing.Short() {
		t.Skip("integration: 3-node cluster")
	}
	c := natstest.NewCluster(t)
	nc := natstest.Connect(t, c.URLs())
	ctx := context.Background()
	octx, cancel := context.WithTimeout(ctx, 30*time.Second)
	st, err := schema.OpenRetry(octx, nc, schema.Options{Replicas: 3}) // peers may still be joining the meta group
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	kv, err := st.Placements("aggregate").KV(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var want []uint64
	for i := range 20 {
		want = append(want, put(t, kv, i))
	}
	rec := newRecorder()
	w := startWatcher(t, placement.Config{Store: st, Kinds: []string{"aggregate"}, OnChange: rec.onChange})
	rec.await(t, want[len(want)-1], 10*time.Second)

	// Find the node that holds the watcher's consumer and kill it.
	stream, err := st.JS().JetStream().Stream(ctx, schema.PlacementStream("aggregate"))
	if err != nil {
		t.Fatal(err)
	}
	var holder string
	for ci := range stream.ListConsumers(ctx).Info() {
		if ci.Cluster != nil {
			holder = ci.Cluster.Leader
		}
	}
	if holder == "" {
		t.Fatal("no consumer found for the watcher")
	}
	for _, s := range c.Servers {
		if s.Name() == holder {
			s.Stop()
		}
	}
	t.Logf("stopped %s, which held the watch", holder)
	killed := time.Now()
	var after []uint64
	for i := 30; i < 50; i++ {
		after = append(after, put(t, kv, i))
	}
	rec.await(t, after[len(after)-1], 20*time.Second)
	t.Logf("all changes after the node loss applied %s after it", time.Since(killed).Round(time.Millisecond))
	rec.check(t, append(want, after...))
	if s, _ := w.Stats("aggregate"); s.Resumes == 0 || s.Placements != 40 {
		t.Fatalf("stats %+v: want a resume and 40 placements", s)
	}
}
