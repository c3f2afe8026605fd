package gateway

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"net/http"

	"github.com/tenantmesh/tenantmesh/gateway/h1"
	"github.com/tenantmesh/tenantmesh/internal/backoff"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// frontEnd is the gateway's own HTTP/1.1 server for plaintext listeners: one goroutine per
// client connection reads request heads into a reused buffer, parses them strictly in place
// (package h1: ambiguous framing is answered 400 and never forwarded), runs the stages and
// writes the answer through a reused buffered writer. Requests it does not serve itself
// (protocol upgrades and the gateway's own endpoints) hand the connection, with the bytes
// already read, to net/http's server (stdfront.go), which serves it from then on.
type frontEnd struct {
	g       *Gateway
	handoff *handoffListener

	mu      sync.Mutex
	conns   map[*clientConn]struct{}
	closing atomic.Bool // written under mu; read without it on every request
	wg      sync.WaitGroup
}

// maxRequestFields bounds the header fields of a request (431 beyond).
const maxRequestFields = 128

func newFrontEnd(g *Gateway, addr net.Addr) *frontEnd {
	return &frontEnd{g: g, handoff: newHandoffListener(addr), conns: map[*clientConn]struct{}{}}
}

// serve accepts connections until ln is closed.
func (f *frontEnd) serve(ln net.Listener) error {
	pauses := backoff.Policy{Initial: 5 * time.Millisecond, Max: time.Second, Jitter: backoff.None}.Pauses()
	for {
		c, err := ln.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				time.Sleep(pauses.Next())
				continue
			}
			return err
		}
		pauses.Reset()
		ip := remoteIP(c)
		if !f.g.conns.acquire(ip) {
			c.Close()
			continue
		}
		cc := &clientConn{f: f, c: c, ip: ip}
		f.mu.Lock()
		if f.closing.Load() {
			f.mu.Unlock()
			f.g.conns.release(ip)
			c.Close()
			continue
		}
		f.conns[cc] = struct{}{}
		f.wg.Add(1)
		f.mu.Unlock()
		go cc.serve()
	}
}

// shutdown closes idle connections, lets busy ones finish their request, and after ctx ends
// closes what is left.
func (f *frontEnd) shutdown(ctx context.Context) error {
	f.mu.Lock()
	f.closing.Store(true)
	for cc := range f.conns {
		if cc.h2 != nil {
			cc.h2.shutdown() // GOAWAY: the streams under way finish
		} else if cc.idle.Load() {
			cc.c.Close()
		}
	}
	f.mu.Unlock()
	done := make(chan struct{})
	go func() { f.wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
	}
	f.mu.Lock()
	for cc := range f.conns {
		cc.c.Close()
	}
	f.mu.Unlock()
	<-done
	return ctx.Err()
}

// clientConn is one client connection of the front end, with its buffers.
type clientConn struct {
	f    *frontEnd
	c    net.Conn
	r    *h1.Reader
	w    *outBuf
	idle atomic.Bool
	h2   *h2server // set (under f.mu) once the connection speaks HTTP/2

	ip     string
	minor  int
	close  bool // close after this exchange
	chunk  bool // this answer's body is chunked
	broken bool // the answer was cut: close without another byte
	expect expectReader
	num    [20]byte

	// The read deadline set on the connection and what it bounds. Changing a deadline is a
	// timer update in the runtime, which costs more than parsing a head, so a waiting
	// connection's idle deadline is renewed only when it would end too early, and a head that
	// arrives whole within it gets no deadline of its own.
	dl     time.Time
	dlKind deadlineKind
	// The body being read (deadline.go): when it began, the bytes read so far, and the
	// reader that renews its deadline before each read.
	bodyStart time.Time
	bodyN     int64
	bodyR     bodyReader
	// wdl is the write deadline, renewed coarsely before writes (deadline.go).
	wdl writeDeadline
}

type deadlineKind uint8

const (
	dlNone deadlineKind = iota
	dlIdle              // waiting for the next request: IdleTimeout, renewed coarsely
	dlHead              // reading a head that did not arrive whole: ReadHeaderTimeout
	dlBody              // reading a body: BodyReadTimeout and MinBodyRate (deadline.go)
)

// idleDeadline bounds the wait for the next request by the idle timeout, within an eighth of it.
func (cc *clientConn) idleDeadline() {
	d := cc.f.g.cfg.IdleTimeout
	now := time.Now()
	if cc.dlKind == dlIdle && cc.dl.Sub(now) > d-d/8 {
		return
	}
	cc.dl, cc.dlKind = now.Add(d), dlIdle
	_ = cc.c.SetReadDeadline(cc.dl)
}

// headDeadline bounds reading the rest of a head that did not arrive whole (h1.Reader calls it
// before it reads more of a head).
func (cc *clientConn) headDeadline() {
	if cc.dlKind != dlHead {
		cc.dl, cc.dlKind = time.Now().Add(cc.f.g.cfg.ReadHeaderTimeout), dlHead
		_ = cc.c.SetReadDeadline(cc.dl)
	}
}

var (
	readers = sync.Pool{New: func() any { return h1.NewReader(nil, 8<<10) }}
	writers = sync.Pool{New: func() any { return &outBuf{} }}
)

func (cc *clientConn) serve() {
	f := cc.f
	handedOff := false
	defer func() {
		if !handedOff {
			cc.c.Close()
			f.g.conns.release(cc.ip)
		}
		f.mu.Lock()
		delete(f.conns, cc)
		f.mu.Unlock()
		f.wg.Done()
	}()
	rw := ioOf(cc.c)
	cc.r = readers.Get().(*h1.Reader)
	cc.r.Reset(rw)
	cc.r.BeforeHeadRead = cc.headDeadline
	cc.wdl = writeDeadline{c: cc.c, d: f.g.cfg.WriteTimeout, slow: f.g.metrics.slow}
	cc.w = writers.Get().(*outBuf)
	cc.w.reset(rw)
	cc.w.dl = &cc.wdl
	defer func() {
		cc.r.Reset(nil)
		readers.Put(cc.r)
		cc.w.reset(nil)
		writers.Put(cc.w)
	}()
	cfg := &f.g.cfg
	for {
		cc.idle.Store(true)
		if f.closing.Load() {
			return
		}
		if cc.r.Buffered() == 0 {
			cc.idleDeadline()
			if err := cc.r.Wait(); err != nil {
				return
			}
		}
		cc.idle.Store(false)
		head, err := cc.r.ReadHead(cfg.MaxHeaderBytes)
		if err != nil {
			cc.refuse(err)
			return
		}
		x := getExchange()
		x.head = append(x.head[:0], head...)
		if err := h1.ParseRequest(x.head, &x.req, maxRequestFields); err != nil {
			if bytes.Equal(x.head, h2Preface[:18]) {
				// HTTP/2 with prior knowledge (h2c, gRPC): the engine's own HTTP/2 server
				// (h2front.go) serves the connection from here on.
				putExchange(x)
				cc.serveH2()
				return
			}
			putExchange(x)
			cc.refuse(err)
			return
		}
		if cc.handOff(x) {
			handedOff = true
			putExchange(x)
			return
		}
		keep := cc.exchange(x)
		putExchange(x)
		if !keep {
			return
		}
	}
}

// handOff passes the connection to net/http's server when x is not the front end's: an
// upgrade, or one of the gateway's own endpoints.
func (cc *clientConn) handOff(x *exchange) bool {
	r := &x.req
	target := str(r.Target)
	if !r.Upgrade {
		path, _, _ := strings.Cut(target, "?")
		if _, n := h1.Get(r.Fields, tmhttp.HeaderTenant); n > 0 || !isAdminPath(path) {
			return false
		}
	}
	return cc.give(x.head)
}

// h2Preface opens every HTTP/2 connection (RFC 9113 section 3.4); the own front end reads its
// first 18 bytes as a request head that does not parse as HTTP/1.1, and its HTTP/2 server
// (h2front.go) checks the rest.
var h2Preface = []byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")

// give hands the connection to net/http's server with head and what was read after it.
func (cc *clientConn) give(head []byte) bool {
	pending := make([]byte, 0, len(head)+cc.r.Buffered())
	pending = append(pending, head...)
	for cc.r.Buffered() > 0 {
		p, _ := cc.r.Next(cc.r.Buffered())
		pending = append(pending, p...)
	}
	ip := cc.ip
	_ = cc.c.SetWriteDeadline(time.Time{}) // net/http's server sets its own
	return cc.f.handoff.give(&replayConn{Conn: cc.c, pending: pending, release: func() { cc.f.g.conns.release(ip) }})
}

// exchange runs one request through the stages; false: close the connection.
func (cc *clientConn) exchange(x *exchange) bool {
	r := &x.req
	x.method = methodString(r.Method)
	x.target, x.host, x.fields = r.Target, r.Host, r.Fields
	x.path, _, _ = strings.Cut(str(r.Target), "?")
	x.remoteIP = cc.ip
	_, nc := h1.Get(r.Fields, "Connection")
	x.connNames = nc > 0
	cc.minor, cc.close, cc.broken = r.Minor, r.Close, false
	cc.expect = expectReader{}
	switch {
	case r.Chunked:
		x.chunked.Reset(cc.r)
		x.body, x.bodyLen = &x.chunked, -1
	case r.ContentLength > 0:
		x.lim = io.LimitedReader{R: cc.r, N: r.ContentLength}
		x.body, x.bodyLen = &x.lim, r.ContentLength
	}
	if x.body != nil {
		cc.bodyStart, cc.bodyN = time.Now(), 0
		cc.bodyR = bodyReader{cc: cc, r: x.body}
		x.body = &cc.bodyR
	}
	if x.body != nil && r.Expect100 {
		cc.expect = expectReader{cc: cc, r: x.body}
		x.body = &cc.expect
	}
	body := x.body
	x.out = cc
	cc.f.g.serve(x)
	if cc.broken {
		return false
	}
	if cc.expect.r != nil && !cc.expect.sent {
		cc.close = true // answered without the body: the client never sends it
	}
	if body != nil && !cc.close {
		// What the stages did not read of the body is read and dropped, up to a bound.
		if n, err := io.CopyN(io.Discard, body, 256<<10); err != io.EOF || n == 256<<10 {
			cc.close = true
		}
	}
	if cc.close || cc.r.Buffered() == 0 {
		if err := cc.w.Flush(); err != nil {
			return false
		}
	}
	return !cc.close
}

// refuse answers a head that cannot be served (400, 431, 417) and ends the connection.
func (cc *clientConn) refuse(err error) {
	status := h1.StatusOf(err)
	if status == 0 {
		return // the connection failed or closed
	}
	p := tmhttp.Problem{Type: tmhttp.TypeBase + "bad-request", Title: "Bad request", Status: status,
		Detail: "the request is not acceptable HTTP/1.1 (" + err.Error() + "); it was not forwarded"}
	if status == 431 {
		p.Type, p.Title = tmhttp.TypeBase+"header-too-large", "Request header fields too large"
	}
	cc.close = true
	body, _ := jsonLine(p)
	cc.problem(status, body, 0)
	_ = cc.w.Flush()
	cc.f.g.metrics.code(status)
}

// writeHead writes the status line, the fields and the framing of the body.
func (cc *clientConn) writeHead(status int, fields []h1.Field, n int64, noBody bool) error {
	w := cc.w
	cc.statusLine(status)
	for _, f := range fields {
		w.Write(f.Name)
		w.WriteString(": ")
		w.Write(f.Value)
		w.WriteString("\r\n")
	}
	cc.chunk = false
	switch {
	case noBody:
	case n >= 0:
		w.WriteString("Content-Length: ")
		w.Write(strconv.AppendInt(cc.num[:0], n, 10))
		w.WriteString("\r\n")
	case cc.minor == 1:
		cc.chunk = true
		w.WriteString("Transfer-Encoding: chunked\r\n")
	default:
		cc.close = true // HTTP/1.0: the body ends with the connection
	}
	cc.connection()
	_, err := w.WriteString("\r\n")
	return err
}

// connection says whether the connection stays open: close, or keep-alive to an HTTP/1.0
// client that asked for it.
func (cc *clientConn) connection() {
	switch {
	case cc.close:
		cc.w.WriteString("Connection: close\r\n")
	case cc.minor == 0:
		cc.w.WriteString("Connection: keep-alive\r\n")
	}
}

func (cc *clientConn) statusLine(status int) {
	cc.w.WriteString("HTTP/1.1 ")
	cc.w.Write(strconv.AppendInt(cc.num[:0], int64(status), 10))
	cc.w.WriteByte(' ')
	cc.w.WriteString(http.StatusText(status))
	cc.w.WriteString("\r\n")
}

func (cc *clientConn) write(p []byte) error {
	if !cc.chunk {
		_, err := cc.w.Write(p)
		return err
	}
	cc.w.Write(strconv.AppendInt(cc.num[:0], int64(len(p)), 16))
	cc.w.WriteString("\r\n")
	cc.w.Write(p)
	_, err := cc.w.WriteString("\r\n")
	return err
}

func (cc *clientConn) flush() error { return cc.w.Flush() }

func (cc *clientConn) finish(trailer []h1.Field) error {
	if !cc.chunk {
		return nil
	}
	cc.w.WriteString("0\r\n")
	for _, f := range trailer {
		cc.w.Write(f.Name)
		cc.w.WriteString(": ")
		cc.w.Write(f.Value)
		cc.w.WriteString("\r\n")
	}
	_, err := cc.w.WriteString("\r\n")
	return err
}

func (cc *clientConn) abort() {
	cc.broken = true
	_ = cc.w.Flush()
}

func (cc *clientConn) problem(status int, body []byte, retryAfter int, extra ...h1.Field) {
	if body == nil {
		cc.broken = true // the client went away: nothing to say
		return
	}
	w := cc.w
	cc.statusLine(status)
	w.WriteString("Content-Type: " + tmhttp.ContentTypeProblem + "\r\nCache-Control: no-store\r\n")
	if retryAfter > 0 {
		w.WriteString("Retry-After: ")
		w.Write(strconv.AppendInt(cc.num[:0], int64(retryAfter), 10))
		w.WriteString("\r\n")
	}
	for _, f := range extra {
		w.Write(f.Name)
		w.WriteString(": ")
		w.Write(f.Value)
		w.WriteString("\r\n")
	}
	cc.connection()
	w.WriteString("Content-Length: ")
	w.Write(strconv.AppendInt(cc.num[:0], int64(len(body)), 10))
	w.WriteString("\r\n\r\n")
	w.Write(body)
}

func (cc *clientConn) hijack() (io.ReadWriteCloser, error) {
	return nil, errors.New("upgrades are served by net/http's front end")
}

// expectReader answers 100 Continue before the body's first read (Expect: 100-continue).
type expectReader struct {
	cc   *clientConn
	r    io.Reader
	sent bool
}

func (e *expectReader) Read(p []byte) (int, error) {
	if !e.sent {
		e.sent = true
		e.cc.w.WriteString("HTTP/1.1 100 Continue\r\n\r\n")
		if err := e.cc.w.Flush(); err != nil {
			return 0, err
		}
	}
	return e.r.Read(p)
}

// handoffListener hands connections from the front end to net/http's server.
type handoffListener struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
	addr  net.Addr
}

func newHandoffListener(addr net.Addr) *handoffListener {
	return &handoffListener{conns: make(chan net.Conn), done: make(chan struct{}), addr: addr}
}

// give passes c to the server; false if it is closed.
func (l *handoffListener) give(c net.Conn) bool {
	select {
	case l.conns <- c:
		return true
	case <-l.done:
		return false
	}
}

func (l *handoffListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *handoffListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *handoffListener) Addr() net.Addr { return l.addr }

// replayConn reads the bytes the front end had read before the connection's own; it uncounts
// the connection (connLimiter) once, when net/http's server closes it.
type replayConn struct {
	net.Conn
	pending []byte
	release func()
	once    sync.Once
}

func (c *replayConn) Close() error {
	c.once.Do(c.release)
	return c.Conn.Close()
}

func (c *replayConn) Read(p []byte) (int, error) {
	if len(c.pending) > 0 {
		n := copy(p, c.pending)
		c.pending = c.pending[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}
