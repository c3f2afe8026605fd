package kvwatch_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit/kvwatch"
)

// keys records what a follower applied.
type keys struct {
	mu     sync.Mutex
	got    []string
	change chan struct{}
}

func newKeys() *keys { return &keys{change: make(chan struct{}, 1)} }

func (k *keys) Apply(e kvwatch.Entry) {
	k.mu.Lock()
	k.got = append(k.got, e.Key)
	k.mu.Unlock()
	select {
	case k.change <- struct{}{}:
	default:
	}
}

func (k *keys) Synced() {}

// await waits until key was applied, or fails at the deadline.
func (k *keys) await(t *testing.T, key string, within time.Duration) {
	t.Helper()
	deadline := time.NewTimer(within)
	defer deadline.Stop()
	for {
		k.mu.Lock()
		ok := slices.Contains(k.got, key)
		k.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-k.change:
		case <-deadline.C:
			t.Fatalf("%s not applied within %s", key, within)
		}
	}
}

// TestFollowerLeavesAStoppedServer stops the server that holds a follower's consumer (not the
// one the follower is connected to). With heartbeats that would notice after 28 s, more than
// twice the test's wait, only the stream leader advisory that lists the server offline can
// make the follower make its consumer again elsewhere; then it sees the next write.
func TestFollowerLeavesAStoppedServer(t *testing.T) {
	c := natstest.NewCluster(t)
	admin := natstest.Connect(t, c.URLs())
	ajs, err := jetstream.New(admin)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var kv jetstream.KeyValue
	for {
		// Right after start-up, the meta leader may not know every peer yet ("no suitable
		// peers for placement"): polling, no event to await.
		kv, err = ajs.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "leave", Replicas: 3, Storage: jetstream.MemoryStorage})
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if _, err := kv.Put(ctx, "a", []byte("1")); err != nil {
		t.Fatal(err)
	}

	// A follower on one server whose consumer lives on another (placement is random: a few tries).
	var (
		f        *kvwatch.Follower
		h        *keys
		stopped  = -1
		runDone  chan struct{}
		stopRun  context.CancelFunc
		names    = map[string]int{}
		connName string
	)
	for i, s := range c.Servers {
		names[s.Name()] = i
	}
	for try := 0; try < 10 && stopped < 0; try++ {
		if stopRun != nil {
			stopRun()
			<-runDone
		}
		via := try % len(c.Servers)
		nc := natstest.Connect(t, fmt.Sprintf("nats://127.0.0.1:%d", c.Configs[via].Port), nats.NoReconnect())
		connName = nc.ConnectedServerName()
		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		h = newKeys()
		f, err = kvwatch.New(kvwatch.Config{JS: js, Bucket: "leave", Heartbeat: 14 * time.Second}, h)
		if err != nil {
			t.Fatal(err)
		}
		var rctx context.Context
		rctx, stopRun = context.WithCancel(ctx)
		runDone = make(chan struct{})
		go func() {
			defer close(runDone)
			_ = f.Run(rctx)
		}()
		h.await(t, "a", 45*time.Second) // as for "b" below: the heartbeats are the net
		if server := f.Stats().Server; server != "" && server != connName {
			stopped = names[server]
		}
	}
	defer func() {
		stopRun()
		<-runDone
	}()
	if stopped < 0 {
		t.Fatal("no follower had its consumer on another server than its connection's in 10 tries")
	}

	// The stream's leader moves to that server too (if it is not there already), so that its
	// stop elects a new one: the advisory the follower hears.
	if _, err := admin.Request("$JS.API.STREAM.LEADER.STEPDOWN.KV_leave",
		[]byte(`{"placement":{"preferred":"`+c.Servers[stopped].Name()+`"}}`), 5*time.Second); err != nil {
		t.Fatal(err)
	}
	c.Servers[stopped].Stop()
	// The write goes through a connection to a server still up.
	for i := range c.Servers {
		if i == stopped || c.Servers[i].Name() == connName {
			continue
		}
		wnc := natstest.Connect(t, fmt.Sprintf("nats://127.0.0.1:%d", c.Configs[i].Port))
		wjs, _ := jetstream.New(wnc)
		for {
			pctx, pcancel := context.WithTimeout(ctx, 2*time.Second)
			_, err := wjs.Publish(pctx, "$KV.leave.b", []byte("2"))
			pcancel()
			if err == nil {
				break
			}
			if ctx.Err() != nil {
				t.Fatalf("put after the stop: %v", err)
			}
		}
		break
	}
	// The follower left the stopped server: a new consumer elsewhere, sooner than its
	// heartbeats could have told it (polling its stats: no event to await).
	gone := c.Servers[stopped].Name()
	for deadline := time.Now().Add(12 * time.Second); ; {
		got := f.Stats()
		if got.Resumes > 0 && got.Server != "" && got.Server != gone {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("follower did not leave the stopped server within 12s: %+v", got)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// And it goes on. (A consumer made during the cluster's change can miss its first pull;
	// then the heartbeats, the net, make it again: a longer wait.)
	h.await(t, "b", 45*time.Second)
}
