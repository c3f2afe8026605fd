package gateway

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// HoldLimits bound the hold buffer. Zero fields take the defaults.
type HoldLimits struct {
	// PerTenant is the most requests held for one tenant. Default 256.
	PerTenant int
	// PerTenantBytes is the most buffered body bytes held for one tenant. Default 8 MiB.
	PerTenantBytes int64
	// Total is the most requests held overall. Default 10000.
	Total int
	// TotalBytes is the most buffered body bytes held overall. Default 256 MiB.
	TotalBytes int64
}

func (l HoldLimits) withDefaults() HoldLimits {
	if l.PerTenant <= 0 {
		l.PerTenant = 256
	}
	if l.PerTenantBytes <= 0 {
		l.PerTenantBytes = 8 << 20
	}
	if l.Total <= 0 {
		l.Total = 10000
	}
	if l.TotalBytes <= 0 {
		l.TotalBytes = 256 << 20
	}
	return l
}

// Hold outcomes, the values of tm_gateway_hold_total's outcome label.
const (
	holdReleased = "released" // sent to the owner after the handoff committed
	holdAborted  = "aborted"  // sent to the old owner after the move was aborted
	holdExpired  = "expired"  // the kind's hold budget ran out: 503
	holdOverflow = "overflow" // a bound was reached: 503 at once
	holdCanceled = "canceled" // the client went away while held
)

type holdKey struct{ kind, tenant string }

// holdQueue is one tenant's FIFO of held requests.
type holdQueue struct {
	items     []*held
	bytes     int64
	releasing bool // the handoff ended: items go out one by one, in order
	aborted   bool
	busy      bool // the head was let go and has not finished dispatching
}

// held is one held request.
type held struct {
	key   holdKey
	size  int64
	ready chan struct{}
	let   bool // let go (under hold.mu)
	since time.Time
}

// holdBuffer keeps the requests of tenants in handoff until the move commits or aborts, and then
// lets them go one at a time, in arrival order: each goes once the one before it has its answer
// (or failed), so the new owner sees them in order. Requests that arrive while a tenant's
// backlog is going out queue behind it.
type holdBuffer struct {
	lim     HoldLimits
	metrics *gwMetrics

	active atomic.Int64 // queues; 0 lets the request path skip the lock

	mu     sync.Mutex
	queues map[holdKey]*holdQueue
	count  int
	bytes  int64
}

func newHoldBuffer(lim HoldLimits, m *gwMetrics) *holdBuffer {
	return &holdBuffer{lim: lim.withDefaults(), metrics: m, queues: map[holdKey]*holdQueue{}}
}

// queued reports whether tenant has a queue (held requests or a backlog going out).
func (h *holdBuffer) queued(kind, tenant string) bool {
	if h.active.Load() == 0 {
		return false
	}
	h.mu.Lock()
	_, ok := h.queues[holdKey{kind, tenant}]
	h.mu.Unlock()
	return ok
}

func holdErr(detail string, budget time.Duration) *tmhttp.Error {
	return &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "tenant-moving", Title: "Tenant is moving",
		Detail: detail, RetryAfter: max(budget, time.Second)}
}

// wait holds a request of size body bytes until it is let go, the budget runs out or ctx ends.
// stillHeld is called once the request is queued (under the buffer's lock): if the handoff
// already ended, the queue starts going out at once. On success the caller must call done.
func (h *holdBuffer) wait(ctx context.Context, ke *kindEntry, tenant string, size int64, budget time.Duration, stillHeld func() bool) (*held, error) {
	k := holdKey{ke.name, tenant}
	it := &held{key: k, size: size, ready: make(chan struct{}), since: time.Now()}
	h.mu.Lock()
	q := h.queues[k]
	qlen, qbytes := 0, int64(0)
	if q != nil {
		qlen, qbytes = len(q.items), q.bytes
	}
	if qlen+1 > h.lim.PerTenant || qbytes+size > h.lim.PerTenantBytes || h.count+1 > h.lim.Total || h.bytes+size > h.lim.TotalBytes {
		h.mu.Unlock()
		ke.metrics.hold(holdOverflow)
		return nil, holdErr("the tenant is being moved between shards and the gateway holds as many of its requests as it can; retry shortly", budget)
	}
	if q == nil {
		q = &holdQueue{}
		h.queues[k] = q
		h.active.Add(1)
		if !stillHeld() {
			q.releasing = true
		}
	}
	q.items = append(q.items, it)
	q.bytes += size
	h.count++
	h.bytes += size
	h.metrics.holdQueued.Add(1)
	h.next(q)
	h.mu.Unlock()

	timer := time.NewTimer(budget)
	defer timer.Stop()
	select {
	case <-it.ready:
		return it, nil
	case <-timer.C:
		if h.leave(it) {
			ke.metrics.hold(holdExpired)
			return nil, holdErr("the tenant is being moved between shards and the move took longer than the kind's hold budget; retry shortly", budget)
		}
		return it, nil
	case <-ctx.Done():
		if h.leave(it) {
			ke.metrics.hold(holdCanceled)
			return nil, ctx.Err()
		}
		return it, nil
	}
}

// next lets the head of q go if q is releasing and nothing is dispatching (under mu).
func (h *holdBuffer) next(q *holdQueue) {
	if !q.releasing || q.busy || len(q.items) == 0 {
		return
	}
	head := q.items[0]
	head.let = true
	q.busy = true
	close(head.ready)
}

// leave removes an item that gave up waiting; false if it was let go meanwhile (then it must go).
func (h *holdBuffer) leave(it *held) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if it.let {
		return false
	}
	q := h.queues[it.key]
	if i := slices.Index(q.items, it); i >= 0 {
		q.items = slices.Delete(q.items, i, i+1)
	}
	h.drop(q, it)
	h.next(q)
	return true
}

// drop accounts an item's departure and removes an empty queue (under mu).
func (h *holdBuffer) drop(q *holdQueue, it *held) {
	q.bytes -= it.size
	h.count--
	h.bytes -= it.size
	h.metrics.holdQueued.Add(-1)
	if len(q.items) == 0 && !q.busy {
		delete(h.queues, it.key)
		h.active.Add(-1)
	}
}

// done reports that a let-go request has its answer (or failed); the next one may go.
func (h *holdBuffer) done(ke *kindEntry, it *held) {
	h.mu.Lock()
	defer h.mu.Unlock()
	q := h.queues[it.key]
	if q.aborted {
		ke.metrics.hold(holdAborted)
	} else {
		ke.metrics.hold(holdReleased)
	}
	ke.metrics.holdWait.Observe(time.Since(it.since).Seconds())
	if i := slices.Index(q.items, it); i >= 0 {
		q.items = slices.Delete(q.items, i, i+1)
	}
	q.busy = false
	h.drop(q, it)
	h.next(q)
}

// release ends tenant's hold: the handoff committed (aborted false) or the move was aborted.
func (h *holdBuffer) release(kind, tenant string, aborted bool) {
	if h.active.Load() == 0 {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	q := h.queues[holdKey{kind, tenant}]
	if q == nil || q.releasing {
		return
	}
	q.releasing, q.aborted = true, aborted
	h.next(q)
}

// stats returns the requests and bytes held now.
func (h *holdBuffer) stats() (int, int64, int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.count, h.bytes, len(h.queues)
}

// hold is the third stage: the body is buffered, up to MaxReplayBody, so the request can be held
// and sent again (a larger one is streamed and never replayed); then, while the tenant is in
// handoff (or its queue is going out), the request waits in the tenant's FIFO.
func (g *Gateway) hold(x *exchange) error {
	if err := g.bufferBody(x); err != nil {
		return err
	}
	return g.holdIfMoving(x)
}

// holdIfMoving holds x while its tenant moves, once per request; the send stage calls it again
// before each attempt, since a refreshed placement may be in handoff.
func (g *Gateway) holdIfMoving(x *exchange) error {
	if x.ticket != nil || !x.policy.holds() {
		return nil
	}
	if !holding(x.entry, x.ke.config().Overlap) && !g.holds.queued(x.ke.name, x.tenant) {
		return nil
	}
	t, err := g.holds.wait(x.ctx, x.ke, x.tenant, int64(len(x.bodyBuf)), x.ke.config().HoldBudget.D(), func() bool {
		e, ok := x.ke.lookup(x.tenant)
		return ok && e.Phase.Moving()
	})
	if err != nil {
		return err
	}
	x.ticket = t
	if e, ok := x.ke.lookup(x.tenant); ok {
		x.entry = e
	}
	return nil
}

// holding reports whether a tenant placed at e has its requests held: in a handoff (unless its
// kind only reads, overlap: the source serves until the commit), and always in a takeover,
// where no instance serves it until the commit.
func holding(e placement.Entry, overlap bool) bool {
	return e.Phase == schema.PhaseTakeover || e.Phase == schema.PhaseHandoff && !overlap
}

// bufferBody reads a body of up to MaxReplayBody bytes into x.bodyBuf; a larger one (or one of
// unknown length that turns out larger) is left to stream, and x is not replayable.
func (g *Gateway) bufferBody(x *exchange) error {
	if x.body == nil || x.bodyLen == 0 {
		x.body = nil
		return nil
	}
	tooLarge := &tmhttp.Error{Status: http.StatusRequestEntityTooLarge, Type: "body-too-large", Title: "Request body too large",
		Detail: "the request body is larger than the gateway accepts (" + strconv.FormatInt(g.cfg.MaxBodyBytes, 10) + " bytes)"}
	if g.cfg.MaxBodyBytes > 0 {
		if x.bodyLen > g.cfg.MaxBodyBytes {
			return tooLarge
		}
		if x.bodyLen < 0 {
			x.body = &maxBytesReader{r: x.body, n: g.cfg.MaxBodyBytes, err: tooLarge}
		}
	}
	limit := g.cfg.MaxReplayBody
	if x.bodyLen > limit {
		x.replayable = false
		return nil
	}
	// The buffer grows as bytes arrive: a Content-Length whose body never comes costs no
	// more than its first read.
	n := min(x.bodyLen, 16<<10)
	if n < 0 {
		n = 512
	}
	buf := x.bodyMem[:0]
	if int64(cap(buf)) < n {
		buf = make([]byte, 0, n)
	}
	for int64(len(buf)) <= limit {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		m, err := x.body.Read(buf[len(buf):min(cap(buf), int(limit)+1)])
		buf = buf[:len(buf)+m]
		if err == io.EOF {
			break
		}
		if err != nil {
			var te *tmhttp.Error
			if errors.As(err, &te) {
				return te
			}
			return &tmhttp.Error{Status: http.StatusBadRequest, Type: "bad-body", Title: "Bad request body", Detail: "reading the request body failed", Err: err}
		}
		if x.bodyLen >= 0 && int64(len(buf)) == x.bodyLen {
			break
		}
	}
	x.bodyMem = buf
	if int64(len(buf)) > limit {
		// Unknown length and larger than the replay limit: stream what was read, then the rest.
		x.replayable = false
		x.body = io.MultiReader(bytes.NewReader(buf), x.body)
		return nil
	}
	x.bodyBuf, x.body = buf, nil
	return nil
}

// maxBytesReader fails with err once more than n bytes were read.
type maxBytesReader struct {
	r   io.Reader
	n   int64
	err error
}

func (m *maxBytesReader) Read(p []byte) (int, error) {
	if m.n < 0 {
		return 0, m.err
	}
	if int64(len(p)) > m.n+1 {
		p = p[:m.n+1]
	}
	n, err := m.r.Read(p)
	if m.n -= int64(n); m.n < 0 {
		return n, m.err
	}
	return n, err
}
