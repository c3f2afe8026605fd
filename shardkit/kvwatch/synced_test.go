package kvwatch_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit/kvwatch"
)

// syncKeys records the keys applied before Synced.
type syncKeys struct {
	mu       sync.Mutex
	got      map[string]bool
	atSynced map[string]bool
	synced   chan struct{}
}

func (k *syncKeys) Apply(e kvwatch.Entry) {
	k.mu.Lock()
	k.got[e.Key] = true
	k.mu.Unlock()
}

func (k *syncKeys) Synced() {
	k.mu.Lock()
	k.atSynced = make(map[string]bool, len(k.got))
	for key := range k.got {
		k.atSynced[key] = true
	}
	k.mu.Unlock()
	close(k.synced)
}

// TestSyncedHasEveryKey starts followers of a bucket of history 1 while one of its keys is
// written again and again. Synced must come only once every key is in: a follower that
// trusted its consumer's count of what is left said synced without the key being rewritten
// (the count drops the replaced message at once and adds its successor a moment later).
func TestSyncedHasEveryKey(t *testing.T) {
	nc := natstest.Connect(t, natstest.Server(t).URL())
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const followers = 100
	early := 0
	for i := range followers {
		bucket := fmt.Sprintf("synced%d", i)
		kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket, History: 1})
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range []string{"a", "b"} {
			if _, err := kv.Put(ctx, k, []byte("0")); err != nil {
				t.Fatal(err)
			}
		}
		wctx, stopWrites := context.WithCancel(ctx)
		wrote := make(chan error, 1)
		go func() {
			for wctx.Err() == nil {
				if _, err := kv.Put(wctx, "a", []byte("1")); err != nil && wctx.Err() == nil {
					wrote <- err
					return
				}
			}
			wrote <- nil
		}()
		h := &syncKeys{got: map[string]bool{}, synced: make(chan struct{})}
		f, err := kvwatch.New(kvwatch.Config{JS: js, Bucket: bucket}, h)
		if err != nil {
			t.Fatal(err)
		}
		rctx, stopRun := context.WithCancel(ctx)
		ran := make(chan error, 1)
		go func() { ran <- f.Run(rctx) }()
		select {
		case <-h.synced:
		case <-time.After(10 * time.Second):
			t.Fatalf("follower %d: not synced within 10s", i)
		}
		stopRun()
		<-ran
		stopWrites()
		if err := <-wrote; err != nil {
			t.Fatal(err)
		}
		h.mu.Lock()
		if !h.atSynced["a"] || !h.atSynced["b"] {
			early++
			t.Errorf("follower %d: synced with %v, want a and b", i, h.atSynced)
		}
		h.mu.Unlock()
	}
	if early > 0 {
		t.Errorf("%d followers of %d said synced before every key was in", early, followers)
	}
}
