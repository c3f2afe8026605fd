package rebalancer

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// The running moves share one directory view: three moves hold it and the directory's stream
// has one consumer (before, each move listed the directory every 500ms); an instance whose
// heartbeats stop leaves the live set as it ages past the threshold, with no change to wake on.
func TestDirViewSharedByMoves(t *testing.T) {
	st := openStore(t)
	e := newEngine(t, st, Config{Thresholds: schema.Thresholds{DegradedAfter: 500 * time.Millisecond, OfflineAfter: 1500 * time.Millisecond}})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	a := schema.Instance{InstanceID: schema.InstanceID{Kind: "aggregate", Shard: "s-1", Instance: "a"}, URL: "http://127.0.0.1:9"}
	b := schema.Instance{InstanceID: schema.InstanceID{Kind: "aggregate", Shard: "s-2", Instance: "b"}, URL: "http://127.0.0.1:9"}
	for _, i := range []schema.Instance{a, b} {
		if _, err := st.Register(ctx, i); err != nil {
			t.Fatal(err)
		}
	}
	for range 3 {
		e.dir.acquire()
	}
	t.Cleanup(func() {
		for range 3 {
			e.dir.release()
		}
	})

	liveKeys := func() []string {
		live, ok, _ := e.dir.live("aggregate", "s-1", "s-2")
		if !ok {
			return nil
		}
		out := append(live["s-1"], live["s-2"]...)
		slices.Sort(out)
		return out
	}
	tmtest.WaitFor(t, 10*time.Second, func() error {
		if got := liveKeys(); !slices.Equal(got, []string{a.Key(), b.Key()}) {
			return fmt.Errorf("live %v", got)
		}
		return nil
	})
	info, err := st.JetStream().Stream(ctx, schema.KVStream(schema.BucketInstances))
	if err != nil {
		t.Fatal(err)
	}
	si, err := info.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if si.State.Consumers != 1 {
		t.Fatalf("3 moves hold the view: %d consumers on the directory, want 1", si.State.Consumers)
	}

	// a keeps heartbeating, b stops: b ages out, a stays.
	tmtest.WaitFor(t, 15*time.Second, func() error {
		if _, err := st.Heartbeat(ctx, a); err != nil {
			return err
		}
		if got := liveKeys(); !slices.Equal(got, []string{a.Key()}) {
			return fmt.Errorf("live %v", got)
		}
		return nil
	})
}
