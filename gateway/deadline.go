package gateway

import (
	"io"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// Deadlines on every phase of a client connection (Envoy's and nginx's hardening defaults):
// the head (ReadHeaderTimeout, front.go), the body (BodyReadTimeout and MinBodyRate, here),
// each write of the answer (WriteTimeout, here), the wait for the next request (IdleTimeout,
// front.go) and an upgraded connection's silence (TunnelIdleTimeout, here). Changing a
// deadline is a timer update in the runtime, so each is renewed only when the one set would
// end too early, by more than an eighth of its length.

// errBodyTooSlow answers a body that stopped arriving, or arrives slower than MinBodyRate.
var errBodyTooSlow = &tmhttp.Error{Status: http.StatusRequestTimeout, Type: "body-too-slow", Title: "Request body too slow",
	Detail: "the request body stopped arriving or arrived too slowly; send it at once"}

// bodyReader reads a request body from the own front end's connection, with the body's read
// deadline renewed before each read.
type bodyReader struct {
	cc *clientConn
	r  io.Reader
}

func (b *bodyReader) Read(p []byte) (int, error) {
	cc := b.cc
	if cc.r.Buffered() == 0 {
		cc.bodyDeadline()
	}
	n, err := b.r.Read(p)
	cc.bodyN += int64(n)
	if err != nil && isTimeout(err) {
		cc.f.g.metrics.slow.WithLabelValues("body").Inc()
		return n, errBodyTooSlow
	}
	return n, err
}

// bodyDeadline bounds the next read of a body: BodyReadTimeout from now, and no later than
// the body's average rate allows (MinBodyRate after the first BodyReadTimeout).
func (cc *clientConn) bodyDeadline() {
	cfg := &cc.f.g.cfg
	now := time.Now()
	dl := bodyDeadlineAt(now, cc.bodyStart, cc.bodyN, cfg.BodyReadTimeout, cfg.MinBodyRate)
	if cc.dlKind == dlBody && !cc.dl.After(dl) && dl.Sub(cc.dl) <= cfg.BodyReadTimeout/8 {
		return
	}
	cc.dl, cc.dlKind = dl, dlBody
	_ = cc.c.SetReadDeadline(dl)
}

// bodyDeadlineAt is when the next byte of a body that began at start, with n bytes read, must
// have arrived.
func bodyDeadlineAt(now, start time.Time, n int64, idle time.Duration, rate int64) time.Time {
	dl := now.Add(idle)
	if rate > 0 {
		if r := start.Add(idle + time.Duration(n)*time.Second/time.Duration(rate)); r.Before(dl) {
			dl = r
		}
	}
	return dl
}

// writeDeadline bounds each write to a client connection by WriteTimeout (at least seven
// eighths of it).
type writeDeadline struct {
	c    interface{ SetWriteDeadline(time.Time) error }
	d    time.Duration
	at   time.Time // the deadline set
	slow *prometheus.CounterVec
}

// renew sets the deadline before a write, if the one set would leave it less than 7/8 of d.
func (w *writeDeadline) renew() {
	if w == nil || w.c == nil {
		return
	}
	now := time.Now()
	if w.at.Sub(now) > w.d-w.d/8 {
		return
	}
	w.at = now.Add(w.d)
	_ = w.c.SetWriteDeadline(w.at)
}

// check counts a write cut by the deadline.
func (w *writeDeadline) check(err error) error {
	if err != nil && w != nil && w.slow != nil && isTimeout(err) {
		w.slow.WithLabelValues("write").Inc()
	}
	return err
}

// stdBody is bodyReader for net/http's front end (TLS, HTTP/2): the deadline is the
// request's own, through http.ResponseController.
type stdBody struct {
	rc          *http.ResponseController
	r           io.Reader
	start, dl   time.Time
	n           int64
	idle        time.Duration
	rate        int64
	slow        *prometheus.CounterVec
	unsupported bool
}

func (b *stdBody) Read(p []byte) (int, error) {
	if !b.unsupported {
		now := time.Now()
		dl := bodyDeadlineAt(now, b.start, b.n, b.idle, b.rate)
		if b.dl.After(dl) || dl.Sub(b.dl) > b.idle/8 {
			b.dl = dl
			b.unsupported = b.rc.SetReadDeadline(dl) != nil
		}
	}
	n, err := b.r.Read(p)
	b.n += int64(n)
	if err != nil && isTimeout(err) {
		b.slow.WithLabelValues("body").Inc()
		return n, errBodyTooSlow
	}
	return n, err
}

// rcDeadline adapts http.ResponseController to writeDeadline.
type rcDeadline struct{ rc *http.ResponseController }

func (r rcDeadline) SetWriteDeadline(t time.Time) error { return r.rc.SetWriteDeadline(t) }

// tunnel joins an upgraded client connection and its instance's until either side closes or
// neither has sent a byte for idle.
type tunnel struct {
	idle time.Duration
	last atomic.Int64 // unix nanoseconds of the last byte either way
	slow *prometheus.CounterVec
}

// pipe copies src to dst; a read that waits idle ends it unless the other direction moved
// meanwhile, and a write the peer does not take within idle ends it.
func (t *tunnel) pipe(dst io.Writer, src io.Reader, dl func(time.Time) error) error {
	bp := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(bp)
	for {
		_ = dl(time.Now().Add(t.idle))
		n, err := src.Read(*bp)
		if n > 0 {
			t.last.Store(time.Now().UnixNano())
			if wd, ok := dst.(interface{ SetWriteDeadline(time.Time) error }); ok {
				_ = wd.SetWriteDeadline(time.Now().Add(t.idle)) // a peer that stops reading is idle too
			}
			if _, werr := dst.Write((*bp)[:n]); werr != nil {
				return werr
			}
		}
		if err != nil {
			if isTimeout(err) && time.Since(time.Unix(0, t.last.Load())) < t.idle {
				continue // the other direction is busy: wait again
			}
			if isTimeout(err) {
				t.slow.WithLabelValues("tunnel").Inc()
			}
			return err
		}
	}
}

// readDeadlineOf returns how to set c's read deadline (a no-op if it has none).
func readDeadlineOf(c any) func(time.Time) error {
	if d, ok := c.(interface{ SetReadDeadline(time.Time) error }); ok {
		return d.SetReadDeadline
	}
	return func(time.Time) error { return nil }
}
