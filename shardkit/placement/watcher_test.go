package placement_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// startWatcher runs a watcher until the test ends and waits until it is ready.
func startWatcher(t testing.TB, cfg placement.Config) *placement.Watcher {
	t.Helper()
	w, ready := runWatcher(t, cfg)
	if err := <-ready; err != nil {
		t.Fatal(err)
	}
	return w
}

// runWatcher runs a watcher until the test ends; ready has WaitReady's result (30 s bound).
func runWatcher(t testing.TB, cfg placement.Config) (*placement.Watcher, <-chan error) {
	t.Helper()
	w, err := placement.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	ready := make(chan error, 1)
	go func() {
		rctx, rcancel := context.WithTimeout(ctx, 30*time.Second)
		defer rcancel()
		ready <- w.WaitReady(rctx)
	}()
	return w, ready
}

// changes collects OnChange events on a channel.
func changes(n int) (chan placement.Change, func(placement.Change)) {
	ch := make(chan placement.Change, n)
	return ch, func(c placement.Change) { ch <- c }
}

// waitChange returns the first change of tenant whose new state satisfies ok.
func waitChange(t *testing.T, ch chan placement.Change, tenant string, ok func(placement.Change) bool) placement.Change {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		select {
		case c := <-ch:
			if c.Tenant == tenant && ok(c) {
				return c
			}
		case <-deadline:
			t.Fatalf("no change for %s within 10s", tenant)
		}
	}
}

func TestWatcherFollowsPlacement(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	ctx := context.Background()
	if _, err := st.Placements("aggregate").Create(ctx, schema.Placement{Tenant: "t1", Shard: "aggregate-1"}); err != nil {
		t.Fatal(err)
	}
	ch, onChange := changes(16)
	w := startWatcher(t, placement.Config{Store: st, Kinds: []string{"aggregate", "runner"}, OnChange: onChange})
	e, ok := w.Lookup("aggregate", "t1")
	if !ok || e.Shard != "aggregate-1" || e.Epoch != 1 || e.Phase != schema.PhaseActive {
		t.Fatalf("lookup after ready = %+v, %v", e, ok)
	}
	p, err := st.Placements("aggregate").Get(ctx, "t1")
	if err != nil {
		t.Fatal(err)
	}
	next := p
	next.Phase, next.Target = schema.PhaseWarming, "aggregate-2"
	if _, err := st.Placements(next.Kind).Update(ctx, p, next); err != nil {
		t.Fatal(err)
	}
	c := waitChange(t, ch, "t1", func(c placement.Change) bool { return c.New.Phase != schema.PhaseActive })
	if !c.NewOK || c.New.Phase != schema.PhaseWarming || c.New.Target != "aggregate-2" || c.Old.Phase != schema.PhaseActive || c.Move != "" {
		t.Fatalf("change = %+v", c)
	}
	// A handoff's change names its move, which the table does not keep (the target's commit
	// carries it on without a read).
	p = next
	p.Revision = c.New.Revision
	next.Phase, next.Move = schema.PhaseHandoff, "mv-7"
	if _, err := st.Placements(next.Kind).Update(ctx, p, next); err != nil {
		t.Fatal(err)
	}
	c = waitChange(t, ch, "t1", func(c placement.Change) bool { return c.New.Phase == schema.PhaseHandoff })
	if c.Move != "mv-7" || c.New.Target != "aggregate-2" {
		t.Fatalf("handoff change = %+v, want its move mv-7", c)
	}
	if err := st.Placements("aggregate").Delete(ctx, "t1", 0); err != nil {
		t.Fatal(err)
	}
	waitChange(t, ch, "t1", func(c placement.Change) bool { return !c.NewOK && c.OldOK })
	if _, ok := w.Lookup("aggregate", "t1"); ok {
		t.Fatal("deleted placement still found")
	}
	if _, ok := w.Lookup("nope", "t1"); ok {
		t.Fatal("unknown kind found")
	}
}

// A watcher's figures (Staleness, Stats) may be read while Run starts its kinds, as a
// gateway's /readyz does from its first request: under -race this failed (the kinds' followers
// and snapshot revisions were written by Run unguarded).
func TestWatcherFiguresWhileStarting(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	w, ready := runWatcher(t, placement.Config{Store: st, Kinds: []string{"aggregate", "runner"}})
	for n := 0; ; n++ {
		_ = w.Staleness()
		_, _ = w.Stats("aggregate")
		select {
		case err := <-ready:
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("read the figures %d times while the watcher started", n+1)
			return
		default:
		}
	}
}

func TestWatcherSkipsCorrupt(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	ctx := context.Background()
	kv, err := st.Placements("aggregate").KV(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for key, val := range map[string]string{
		"bad-json":  "{not json",
		"bad-phase": `{"shard":"a-1","epoch":1,"phase":"sideways"}`,
		"no-epoch":  `{"shard":"a-1","phase":"active"}`,
	} {
		if _, err := kv.Put(ctx, key, []byte(val)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := st.Placements("aggregate").Create(ctx, schema.Placement{Tenant: "good", Shard: "aggregate-1"}); err != nil {
		t.Fatal(err)
	}
	w := startWatcher(t, placement.Config{Store: st, Kinds: []string{"aggregate"}})
	if _, ok := w.Lookup("aggregate", "good"); !ok {
		t.Fatal("good placement missing")
	}
	for _, k := range []string{"bad-json", "bad-phase", "no-epoch"} {
		if e, ok := w.Lookup("aggregate", k); ok {
			t.Fatalf("corrupt %s was applied: %+v", k, e)
		}
	}
	if s, _ := w.Stats("aggregate"); s.Corrupt != 3 || s.Placements != 1 {
		t.Fatalf("stats = %+v, want 3 corrupt and 1 placement", s)
	}
}

func TestSnapshotStartIsEquivalent(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	ctx := context.Background()
	for i := range 300 {
		p := schema.Placement{Kind: "runner", Tenant: fmt.Sprintf("t%03d", i), Shard: fmt.Sprintf("runner-%d", i%3)}
		if _, err := st.Placements(p.Kind).Create(ctx, p); err != nil {
			t.Fatal(err)
		}
	}
	w1 := startWatcher(t, placement.Config{Store: st, Kinds: []string{"runner"}, NoSnapshot: true})
	if err := w1.WriteSnapshot(ctx, "runner"); err != nil {
		t.Fatal(err)
	}
	// Changes after the snapshot: a delete, an update and a create.
	if err := st.Placements("runner").Delete(ctx, "t000", 0); err != nil {
		t.Fatal(err)
	}
	p, _ := st.Placements("runner").Get(ctx, "t001")
	np := p
	np.Shard, np.Epoch = "runner-9", p.Epoch+1
	if _, err := st.Placements(np.Kind).Update(ctx, p, np); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Placements("runner").Create(ctx, schema.Placement{Tenant: "fresh", Shard: "runner-1"}); err != nil {
		t.Fatal(err)
	}
	w2 := startWatcher(t, placement.Config{Store: st, Kinds: []string{"runner"}})
	s2, _ := w2.Stats("runner")
	if s2.SnapshotRevision == 0 {
		t.Fatal("second watcher did not load the snapshot")
	}
	if _, ok := w2.Lookup("runner", "t000"); ok {
		t.Fatal("delete after snapshot not applied")
	}
	if e, _ := w2.Lookup("runner", "t001"); e.Shard != "runner-9" || e.Epoch != 2 {
		t.Fatalf("update after snapshot: %+v", e)
	}
	if _, ok := w2.Lookup("runner", "fresh"); !ok {
		t.Fatal("create after snapshot missing")
	}
	if s2.Placements != 300 {
		t.Fatalf("placements = %d, want 300", s2.Placements)
	}
	n := 0
	w2.Range("runner", func(tenant string, e placement.Entry) bool {
		if e.Shard == "" || tenant == "t000" {
			t.Errorf("Range gave %s = %+v", tenant, e)
		}
		n++
		return true
	})
	if n != 300 {
		t.Fatalf("Range visited %d placements, want 300", n)
	}
	counts := w2.ShardCounts("runner")
	if counts["runner-9"] != 1 || counts["runner-0"] != 99 {
		t.Fatalf("shard counts = %v", counts)
	}
}
