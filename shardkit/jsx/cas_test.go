package jsx_test

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
)

// TestCompareAndSetAfterAWatchedWrite plays a move's commit on a 3-node cluster: two writers
// take turns on one key, each writing by compare-and-set as soon as its watch (connected to
// its own server) shows the other's write, as a move's target commits the handoff its watcher
// just applied. Nobody else writes, so every write must win. A follower may apply a write, and
// deliver it to a watch, before the stream leader has: the leader then still counts the key as
// written in flight and refuses the next compare-and-set with JetStream's "wrong last
// sequence" without a number (err_code 10164), which is not a lost race. Taken for one, a
// move's targets gave up their commit and the handoff waited 2 s for the rebalancer's.
func TestCompareAndSetAfterAWatchedWrite(t *testing.T) {
	cl := natstest.NewCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	type value struct{ N int }
	var writers [2]*jsx.Records
	var watches [2]jetstream.KeyWatcher
	for i := range writers {
		c, err := jsx.New(natstest.Connect(t, "nats://127.0.0.1:"+strconv.Itoa(cl.Configs[i].Port)), jsx.Options{Replicas: 3})
		if err != nil {
			t.Fatal(err)
		}
		var kv jetstream.KeyValue
		for {
			// Right after start-up the meta leader may not know every peer ("no suitable
			// peers for placement"): polling, no event to await.
			if kv, err = c.EnsureSharedKV(ctx, jsx.KVSpec{Bucket: "turns", History: 1}); err == nil || ctx.Err() != nil {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if err != nil {
			t.Fatal(err)
		}
		writers[i] = c.Records(kv)
		if watches[i], err = kv.Watch(ctx, "k", jetstream.UpdatesOnly()); err != nil {
			t.Fatal(err)
		}
		defer watches[i].Stop()
	}
	rev, err := writers[0].CompareAndSet(ctx, "k", 0, value{0})
	if err != nil {
		t.Fatal(err)
	}
	const turns = 1000
	for n := 1; n <= turns; n++ {
		me := n % 2
		// This writer's watch shows the write before (the other's, or the first).
		for seen := uint64(0); seen < rev; {
			select {
			case e := <-watches[me].Updates():
				if e != nil {
					seen = e.Revision()
				}
			case <-ctx.Done():
				t.Fatalf("turn %d: the watch never showed revision %d", n, rev)
			}
		}
		if rev, err = writers[me].CompareAndSet(ctx, "k", rev, value{n}); err != nil {
			t.Fatalf("turn %d of %d, with no other writer: %v (%v)", n, turns, err, errors.Unwrap(err))
		}
	}
}
