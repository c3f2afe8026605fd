package rebalancer

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// The running moves share one directory view and one signal follower: three moves hold them and
// the directory's and the signals' streams have one consumer each (before, each move listed the
// directory every 500ms and made a consumer of its own on the signals); an instance whose
// heartbeats stop leaves the live set as it ages past the threshold, with no change to wake on.
func TestMovesShareTheirViews(t *testing.T) {
	st := openStore(t)
	e := newEngine(t, st, Config{Thresholds: schema.Thresholds{DegradedAfter: 500 * time.Millisecond, OfflineAfter: 1500 * time.Millisecond}})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	a := schema.Instance{InstanceID: schema.InstanceID{Kind: "aggregate", Shard: "s-1", Instance: "a"}, URL: "http://127.0.0.1:9"}
	b := schema.Instance{InstanceID: schema.InstanceID{Kind: "aggregate", Shard: "s-2", Instance: "b"}, URL: "http://127.0.0.1:9"}
	for _, i := range []schema.Instance{a, b} {
		if _, err := st.Directory().Register(ctx, i); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 3 {
		w := e.newSignalWatch(&MoveRecord{Plan: "p", ID: fmt.Sprint(i), Move: planner.Move{Kind: "aggregate", Tenant: fmt.Sprint("t", i), From: "s-1", To: "s-2"}})
		w.run()
		t.Cleanup(w.stop)
	}

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
	for _, b := range []string{schema.BucketInstances, schema.BucketTenantState} {
		tmtest.WaitFor(t, 10*time.Second, func() error {
			str, err := st.JS().JetStream().Stream(ctx, jsx.KVStream(b))
			if err != nil {
				return err
			}
			si, err := str.Info(ctx)
			if err != nil {
				return err
			}
			if si.State.Consumers != 1 {
				return fmt.Errorf("3 moves run: %d consumers on %s, want 1", si.State.Consumers, b)
			}
			return nil
		})
	}

	// a keeps heartbeating, b stops: b ages out, a stays.
	tmtest.WaitFor(t, 15*time.Second, func() error {
		if _, err := st.Directory().Heartbeat(ctx, a); err != nil {
			return err
		}
		if got := liveKeys(); !slices.Equal(got, []string{a.Key()}) {
			return fmt.Errorf("live %v", got)
		}
		return nil
	})
}
