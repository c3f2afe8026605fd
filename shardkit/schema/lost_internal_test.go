package schema

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
)

// relay is a TCP relay between a NATS client and the server that can hold back what the server
// sends: a write reaches the server and is stored, and its answer is lost to the client.
type relay struct {
	ln     net.Listener
	target string

	mu   sync.Mutex
	cond *sync.Cond
	held bool
	wg   sync.WaitGroup
}

func newRelay(t *testing.T, target string) *relay {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &relay{ln: ln, target: target}
	r.cond = sync.NewCond(&r.mu)
	r.wg.Go(r.accept)
	t.Cleanup(func() {
		r.hold(false)
		_ = ln.Close()
		r.wg.Wait()
	})
	return r
}

func (r *relay) url() string { return "nats://" + r.ln.Addr().String() }

func (r *relay) hold(on bool) {
	r.mu.Lock()
	r.held = on
	r.mu.Unlock()
	r.cond.Broadcast()
}

func (r *relay) accept() {
	for {
		c, err := r.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.DialTimeout("tcp", r.target, 2*time.Second)
		if err != nil {
			_ = c.Close()
			continue
		}
		r.wg.Go(func() { _, _ = io.Copy(s, c); _ = s.Close() })
		r.wg.Go(func() { r.down(c, s); _ = c.Close() })
	}
}

// down copies server -> client, waiting while the relay holds.
func (r *relay) down(c, s net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := s.Read(buf)
		if n > 0 {
			r.mu.Lock()
			for r.held {
				r.cond.Wait()
			}
			r.mu.Unlock()
			if _, werr := c.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// loseAnswers holds the server's answers for one write attempt and a little more, so the
// attempt times out after the server stored it; the next attempt's answer comes through.
func loseAnswers(r *relay) {
	r.hold(true)
	time.AfterFunc(jsx.WriteTry+150*time.Millisecond, func() { r.hold(false) })
}

// A compare-and-set, a create, a delete and an audit publish whose answers are lost are
// recognised as ours on the next attempt instead of failing (the compare-and-set and create
// would be conflicts with themselves) or being stored twice (the audit event).
func TestLostWriteAnswersRecognised(t *testing.T) {
	srv := natstest.Server(t)
	ctx := context.Background()
	if _, err := Open(ctx, natstest.Connect(t, srv.URL()), Options{}); err != nil {
		t.Fatal(err)
	}
	r := newRelay(t, srv.Addr().String())
	st, err := Open(ctx, natstest.Connect(t, r.url()), Options{Attach: true})
	if err != nil {
		t.Fatal(err)
	}
	// Open the placement bucket before answers get lost.
	if _, err := st.Placements("aggregate").Get(ctx, "acme"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("reading an absent placement: %v", err)
	}

	loseAnswers(r)
	p, err := st.Placements("aggregate").Create(ctx, Placement{Tenant: "acme", Shard: "s-1"})
	if err != nil {
		t.Fatalf("create whose answer was lost: %v", err)
	}

	loseAnswers(r)
	next := p
	next.Phase, next.Target, next.Move = PhaseWarming, "s-2", "plan/1"
	got, err := st.Placements(next.Kind).Update(ctx, p, next)
	if err != nil {
		t.Fatalf("compare-and-set whose answer was lost: %v", err)
	}
	if read, err := st.Placements("aggregate").Get(ctx, "acme"); err != nil || read.Revision != got.Revision || read.Phase != PhaseWarming {
		t.Fatalf("after the write: %+v (%v), want revision %d warming", read, err, got.Revision)
	}

	// Someone else's write is still a conflict.
	other := p
	other.Phase, other.Target, other.Move = PhaseWarming, "s-3", "plan/2"
	if _, err := st.Placements(other.Kind).Update(ctx, p, other); !errors.As(err, new(*ConflictError)) {
		t.Fatalf("stale compare-and-set: %v, want a conflict", err)
	}

	loseAnswers(r)
	if err := st.Placements("aggregate").Delete(ctx, "acme", got.Revision); err != nil {
		t.Fatalf("delete whose answer was lost: %v", err)
	}

	loseAnswers(r)
	if err := st.Audit().Append(ctx, AuditEvent{Actor: "test", Action: "test.lost", Kind: "aggregate", Tenant: "acme"}); err != nil {
		t.Fatalf("audit whose answer was lost: %v", err)
	}
	evs, err := st.Audit().Read(ctx, AuditQuery{Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 1 {
		t.Fatalf("audit journal has %d events, want 1", len(evs))
	}
}
