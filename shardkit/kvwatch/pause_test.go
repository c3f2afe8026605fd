package kvwatch_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit/kvwatch"
)

// relay carries one client's TCP connections to a server; hold stops what the server sends
// from reaching the client (the client sees a silent server: a paused or starved process)
// until release.
type relay struct {
	ln   net.Listener
	gate sync.RWMutex // held: the server's bytes wait
}

func newRelay(t *testing.T, to string) *relay {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &relay{ln: ln}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.DialTimeout("tcp", to, 5*time.Second)
			if err != nil {
				c.Close()
				continue
			}
			wg.Go(func() { _, _ = io.Copy(s, c); s.Close(); c.Close() })
			wg.Go(func() { r.serverToClient(c, s); s.Close(); c.Close() })
		}
	})
	t.Cleanup(func() { ln.Close() })
	return r
}

func (r *relay) serverToClient(c, s net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := s.Read(buf)
		if n > 0 {
			r.gate.RLock()
			_, werr := c.Write(buf[:n])
			r.gate.RUnlock()
			if werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// syncedKeys is keys that says when the follower is synced.
type syncedKeys struct {
	*keys
	synced chan struct{}
}

func (k *syncedKeys) Synced() { close(k.synced) }

func (r *relay) url() string { return "nats://" + r.ln.Addr().String() }
func (r *relay) hold()       { r.gate.Lock() }
func (r *relay) release()    { r.gate.Unlock() }

// A server that goes silent for several heartbeats, its consumer intact, costs the follower a
// pull, not a consumer: it asks the server whether its consumer is still there and pulls from
// it again (no resume: no create and delete through the meta leader, which a whole fleet
// doing at once after a pause kept a cluster too busy to recover). A write made while the
// server was silent still arrives, whether it went to the silent pull or to the next.
func TestFollowerKeepsItsConsumerThroughASilentServer(t *testing.T) {
	srv := natstest.Server(t)
	admin := natstest.Connect(t, srv.URL())
	ajs, err := jetstream.New(admin)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	kv, err := ajs.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "silent", Storage: jetstream.MemoryStorage})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "a", []byte("1")); err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	r := newRelay(t, u.Host)
	js, err := jetstream.New(natstest.Connect(t, r.url()))
	if err != nil {
		t.Fatal(err)
	}
	h := &syncedKeys{keys: newKeys(), synced: make(chan struct{})}
	f, err := kvwatch.New(kvwatch.Config{JS: js, Bucket: "silent", Heartbeat: 500 * time.Millisecond}, h)
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- f.Run(rctx) }()
	defer func() {
		stop()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("Run: %v", err)
		}
	}()
	select {
	case <-h.synced:
	case <-time.After(10 * time.Second):
		t.Fatal("follower not synced within 10s")
	}

	for round := range 3 {
		// The fault: the server silent to this client for six heartbeats (the pull notices
		// after two). Writes in the first
		// round land before the pull misses its heartbeats (sent to the silent pull), in the
		// others after.
		r.hold()
		if round == 0 {
			if _, err := kv.Put(ctx, "b0", []byte("2")); err != nil {
				t.Fatal(err)
			}
		}
		time.Sleep(3 * time.Second) // the fault's length
		if round > 0 {
			if _, err := kv.Put(ctx, "b"+string(rune('0'+round)), []byte("2")); err != nil {
				t.Fatal(err)
			}
		}
		r.release()
		h.await(t, "b"+string(rune('0'+round)), 10*time.Second)
	}
	s := f.Stats()
	t.Logf("after three silent spells: %+v", s)
	if s.Repulls < 3 {
		t.Errorf("pulled again from the same consumer %d times after three silent spells, want at least 3 (stats %+v)", s.Repulls, s)
	}
	if s.Resumes != 0 {
		t.Errorf("made a new consumer %d times after a silent server whose consumer was there, want 0 (stats %+v)", s.Resumes, s)
	}
}
