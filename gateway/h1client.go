package gateway

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"sync"
	"time"
)

// h1Client is the gateway's HTTP/1.1 client to instances. Unlike net/http.Transport, which runs
// a read goroutine and a write goroutine per connection and hands every request and response
// between them and the caller, it writes the request and reads the response on the caller's
// goroutine: two goroutine hand-offs (and their wake-ups) fewer per request, which is where the
// profile of the proxy under load found the time beside the syscalls themselves.
//
// It keeps idle connections per host (LIFO), retries once on a fresh connection when a reused one
// turns out to be closed before any byte of the answer came back (and the request may be sent
// again), and ties every exchange to the request's context. Upgrades (101) are left to
// net/http.Transport.
type h1Client struct {
	dialer      *net.Dialer
	maxIdle     int           // per host
	idleTimeout time.Duration // idle connections older than this are not reused

	mu     sync.Mutex
	idle   map[string][]*h1Conn
	closed bool
}

type h1Conn struct {
	c    net.Conn
	br   *bufio.Reader
	bw   *bufio.Writer
	host string
	used time.Time
}

func newH1Client(cfg Config) *h1Client {
	return &h1Client{
		dialer:      &net.Dialer{Timeout: cfg.ConnectTimeout, KeepAlive: 30 * time.Second},
		maxIdle:     cfg.MaxIdleConnsPerHost,
		idleTimeout: 30 * time.Second,
		idle:        map[string][]*h1Conn{},
	}
}

// get returns an idle connection to host or dials one; reused says which. With check, a reused
// connection is first probed (one non-blocking read) for a close by the instance: requests
// that may not be sent twice only go on connections known to be open.
func (c *h1Client) get(ctx context.Context, host string, check bool) (pc *h1Conn, reused bool, err error) {
	now := time.Now()
	c.mu.Lock()
	for l := c.idle[host]; len(l) > 0; l = c.idle[host] {
		pc = l[len(l)-1]
		l[len(l)-1] = nil
		c.idle[host] = l[:len(l)-1]
		if now.Sub(pc.used) < c.idleTimeout && (!check || pc.open()) {
			c.mu.Unlock()
			return pc, true, nil
		}
		pc.c.Close()
	}
	c.mu.Unlock()
	conn, err := c.dialer.DialContext(ctx, "tcp", host)
	if err != nil {
		return nil, false, err
	}
	return &h1Conn{c: conn, br: bufio.NewReaderSize(conn, 16<<10), bw: bufio.NewWriterSize(conn, 8<<10), host: host}, false, nil
}

// open reports whether an idle connection is still open: nothing to read and no EOF.
func (pc *h1Conn) open() bool {
	if pc.br.Buffered() > 0 {
		return false
	}
	return connOpen(pc.c)
}

// put returns a connection whose exchange finished cleanly.
func (c *h1Client) put(pc *h1Conn) {
	pc.used = time.Now()
	c.mu.Lock()
	if !c.closed && len(c.idle[pc.host]) < c.maxIdle {
		c.idle[pc.host] = append(c.idle[pc.host], pc)
		c.mu.Unlock()
		return
	}
	c.mu.Unlock()
	pc.c.Close()
}

// CloseIdleConnections closes every idle connection; with stop, later ones are closed too.
func (c *h1Client) closeIdle(stop bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for h, l := range c.idle {
		for _, pc := range l {
			pc.c.Close()
		}
		delete(c.idle, h)
	}
	c.closed = c.closed || stop
}

var errReusedClosed = errors.New("reused connection closed before answering")

// RoundTrip sends req and reads the response headers on the calling goroutine.
func (c *h1Client) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	for try := 0; ; try++ {
		pc, reused, err := c.get(ctx, req.URL.Host, !isIdempotent(req.Method))
		if err != nil {
			return nil, err
		}
		resp, err := c.exchange(ctx, pc, req)
		if err == nil {
			return resp, nil
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		// A reused connection the instance had closed: send again on a fresh one if the request
		// can be rebuilt and could not have been acted on.
		if reused && try == 0 && errors.Is(err, errReusedClosed) && (req.Body == nil || req.Body == http.NoBody || req.GetBody != nil) {
			if req.GetBody != nil {
				if req.Body, err = req.GetBody(); err != nil {
					return nil, err
				}
			}
			continue
		}
		return nil, err
	}
}

// exchange writes req on pc and reads the response headers; the body streams from pc and hands
// the connection back when it is read to the end.
func (c *h1Client) exchange(ctx context.Context, pc *h1Conn, req *http.Request) (*http.Response, error) {
	stop := context.AfterFunc(ctx, func() { _ = pc.c.SetDeadline(aLongTimeAgo) })
	fail := func(err error) (*http.Response, error) {
		stop()
		pc.c.Close()
		return nil, err
	}
	if err := req.Write(pc.bw); err != nil {
		return fail(err)
	}
	if err := pc.bw.Flush(); err != nil {
		return fail(errReused(err, true))
	}
	for {
		if _, err := pc.br.Peek(1); err != nil {
			return fail(errReused(err, isIdempotent(req.Method)))
		}
		resp, err := http.ReadResponse(pc.br, req)
		if err != nil {
			return fail(err)
		}
		if resp.StatusCode == http.StatusSwitchingProtocols {
			return fail(errors.New("unexpected 101 Switching Protocols"))
		}
		if resp.StatusCode >= 100 && resp.StatusCode < 200 {
			continue // 100 Continue and other interim answers are not passed on
		}
		keep := !resp.Close && !req.Close
		resp.Body = &h1Body{c: c, pc: pc, rc: resp.Body, stop: stop, keep: keep}
		return resp, nil
	}
}

// errReused marks an error that happened before any byte of the answer arrived; retryable says
// whether sending again is safe (nothing could have been acted on, or the method is idempotent).
func errReused(err error, retryable bool) error {
	if !retryable {
		return err
	}
	return errors.Join(errReusedClosed, err)
}

func isIdempotent(m string) bool {
	switch m {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodPut, http.MethodDelete, http.MethodTrace:
		return true
	}
	return false
}

var aLongTimeAgo = time.Unix(1, 0)

// h1Body is a response body that returns its connection to the pool once read to the end.
type h1Body struct {
	c    *h1Client
	pc   *h1Conn
	rc   io.ReadCloser
	stop func() bool
	keep bool
	done bool
}

func (b *h1Body) Read(p []byte) (int, error) {
	if b.done {
		return 0, io.EOF
	}
	n, err := b.rc.Read(p)
	if err == io.EOF {
		b.finish(true)
	} else if err != nil {
		b.finish(false)
	}
	return n, err
}

func (b *h1Body) Close() error {
	if !b.done {
		b.finish(false)
	}
	return nil
}

func (b *h1Body) finish(eof bool) {
	b.done = true
	ok := b.stop() // false: the context fired and poisoned the connection's deadline
	if eof && b.keep && ok {
		b.c.put(b.pc)
		return
	}
	b.pc.c.Close()
}
