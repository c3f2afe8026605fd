package gateway

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tenantmesh/tenantmesh/gateway/h1"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// engine is the gateway's one way to send a request to an instance: HTTP/1.1 over pooled
// connections, on the caller's goroutine. The request head is written from the exchange's fields
// and the response head parsed in place (package h1) into the connection's reused buffers, so
// the fast path allocates nothing per request. It keeps idle connections per instance (LIFO,
// 30 s), probes a reused connection with one non-blocking MSG_PEEK before sending a request that
// may not be sent twice, and sends once more on a fresh connection when a reused one turns out
// closed before any byte of the answer (when the request can be rebuilt and could not have been
// acted on). Instances registered with https:// URLs are reached over TLS.
type engine struct {
	dialer      *net.Dialer
	tls         *tls.Config
	maxIdle     int           // per instance
	idleTimeout time.Duration // idle connections older than this are not reused
	maxHead     int           // response head bound

	mu     sync.Mutex
	idle   map[string][]*upConn
	busy   map[string]map[*upConn]struct{} // connections with an exchange under way, by host
	closed bool
}

// errAbandoned ends an exchange with an instance whose shard was taken over while the request
// was there (abandon): the instance cannot answer it validly any more (it was dead, frozen or
// cut off; if it wakes its gate withholds the answer). Whether the request took effect there is
// unknown, so only a request that is safe to send again goes to the new owner.
var errAbandoned = errors.New("its shard was taken over while the request was there: abandoned")

// upConn is one connection to an instance with its buffers and the response being read on it.
type upConn struct {
	e       *engine
	c       net.Conn
	rw      socketIO // how c is read and written
	r       *h1.Reader
	w       *bufio.Writer
	flushFn func() error // w.Flush, bound once
	key     string       // host:port
	tenant  string       // whose exchange is under way (set by get, under engine.mu)
	used    time.Time
	reused  bool
	dl      time.Time // the deadline set on c

	abandoned atomic.Bool // the exchange under way was abandoned (engine.abandon)

	resp    h1.Response
	head    []byte // the response head (resp's fields point into it)
	left    int64  // body bytes left (length-delimited), or h1.BodyChunked / h1.BodyUntilClose
	chunked h1.ChunkedReader
	stop    func() bool // ends the context watch, nil if none
	keep    bool
	done    bool // released: back in the pool or closed
}

func newEngine(cfg Config) *engine {
	return &engine{
		dialer:      &net.Dialer{Timeout: cfg.ConnectTimeout, KeepAlive: 30 * time.Second},
		tls:         &tls.Config{RootCAs: cfg.UpstreamCAs, MinVersion: tls.VersionTLS12, NextProtos: []string{"http/1.1"}},
		maxIdle:     cfg.MaxIdleConnsPerHost,
		idleTimeout: 30 * time.Second,
		maxHead:     1 << 20,
		idle:        map[string][]*upConn{},
		busy:        map[string]map[*upConn]struct{}{},
	}
}

// checkout records uc as busy. Caller holds e.mu.
func (e *engine) checkout(uc *upConn) {
	m := e.busy[uc.key]
	if m == nil {
		m = map[*upConn]struct{}{}
		e.busy[uc.key] = m
	}
	m[uc] = struct{}{}
}

// checkin forgets uc as busy. Caller holds e.mu.
func (e *engine) checkin(uc *upConn) {
	if m := e.busy[uc.key]; m != nil {
		delete(m, uc)
		if len(m) == 0 {
			delete(e.busy, uc.key)
		}
	}
}

// abandon ends tenant's exchanges under way with the instance at key (their reads and writes
// fail at once with errAbandoned): its shard is being taken over, so no answer of it can be
// used. It returns how many exchanges it ended.
func (e *engine) abandon(key, tenant string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	n := 0
	for uc := range e.busy[key] {
		if uc.tenant != tenant {
			continue
		}
		uc.abandoned.Store(true)
		_ = uc.c.SetDeadline(aLongTimeAgo)
		n++
	}
	return n
}

// get returns an idle connection to key (the host) or dials one, for an exchange of tenant's.
// With check, a reused connection is first probed for a close by the instance.
func (e *engine) get(ctx context.Context, now time.Time, key, scheme, host, tenant string, check bool) (*upConn, error) {
	e.mu.Lock()
	for l := e.idle[key]; len(l) > 0; l = e.idle[key] {
		uc := l[len(l)-1]
		l[len(l)-1] = nil
		e.idle[key] = l[:len(l)-1]
		if now.Sub(uc.used) < e.idleTimeout && (!check || uc.open()) {
			uc.tenant = tenant
			e.checkout(uc)
			e.mu.Unlock()
			uc.reused = true
			return uc, nil
		}
		uc.c.Close()
	}
	e.mu.Unlock()
	ctx = realContext(ctx)
	conn, err := e.dialer.DialContext(ctx, "tcp", host)
	if err != nil {
		return nil, err
	}
	if scheme == "https" {
		cfg := e.tls.Clone()
		cfg.ServerName, _, _ = net.SplitHostPort(host)
		tc := tls.Client(conn, cfg)
		if err := tc.HandshakeContext(ctx); err != nil {
			conn.Close()
			return nil, &net.OpError{Op: "dial", Net: "tcp", Err: err} // never reached the app
		}
		conn = tc
	}
	rw := ioOf(conn)
	uc := &upConn{e: e, c: conn, rw: rw, r: h1.NewReader(rw, 32<<10), w: bufio.NewWriterSize(rw, 8<<10), key: key, tenant: tenant}
	uc.flushFn = uc.w.Flush
	e.mu.Lock()
	e.checkout(uc)
	e.mu.Unlock()
	return uc, nil
}

// open reports whether an idle connection is still open: nothing to read and no EOF.
func (uc *upConn) open() bool {
	if uc.r.Buffered() > 0 {
		return false
	}
	return connOpen(uc.c)
}

// put returns a connection whose exchange finished cleanly to the pool.
func (e *engine) put(uc *upConn) {
	e.mu.Lock()
	e.checkin(uc)
	if !e.closed && len(e.idle[uc.key]) < e.maxIdle && !uc.abandoned.Load() {
		e.idle[uc.key] = append(e.idle[uc.key], uc)
		e.mu.Unlock()
		return
	}
	e.mu.Unlock()
	uc.c.Close()
}

// closeIdle closes every idle connection; with stop, later ones are closed too.
func (e *engine) closeIdle(stop bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for k, l := range e.idle {
		for _, uc := range l {
			uc.c.Close()
		}
		delete(e.idle, k)
	}
	e.closed = e.closed || stop
}

var errReusedClosed = errors.New("reused connection closed before answering")

// roundTrip sends x to in and reads the response head; the body is read with uc.Read and the
// connection handed back with uc.release. now is about the time of the call.
func (e *engine) roundTrip(ctx context.Context, now time.Time, x *exchange, in *instance) (*upConn, error) {
	u := in.url.Load()
	for try := 0; ; try++ {
		uc, err := e.get(ctx, now, u.Host, u.Scheme, u.Host, x.tenant, !isIdempotent(x.method))
		if err != nil {
			return nil, err
		}
		err = uc.exchange(ctx, now, x, u.Path)
		if err == nil {
			return uc, nil
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if uc.abandoned.Load() {
			return nil, errAbandoned
		}
		if isTimeout(err) && !uc.dl.IsZero() && !time.Now().Before(uc.dl) {
			return nil, context.DeadlineExceeded // the connection's deadline is the context's
		}
		// A reused connection the instance had closed: once more on a fresh one, if the body
		// can be sent again.
		if uc.reused && try == 0 && errors.Is(err, errReusedClosed) && x.replayable {
			continue
		}
		return nil, err
	}
}

var aLongTimeAgo = time.Unix(1, 0)

// exchange writes the request and reads the response head (skipping interim answers).
func (uc *upConn) exchange(ctx context.Context, now time.Time, x *exchange, base string) error {
	uc.deadline(ctx, now)
	uc.used = now
	uc.stop, uc.done = nil, false
	if x.cancelable {
		uc.stop = context.AfterFunc(ctx, func() { _ = uc.c.SetDeadline(aLongTimeAgo) })
	}
	fail := func(err error) error {
		uc.close()
		return err
	}
	writeRequestHead(uc.w, x, base)
	if err := writeRequestBody(uc.w, x); err != nil {
		return fail(err)
	}
	if err := uc.flush(); err != nil {
		return fail(errReused(err, uc.reused))
	}
	for {
		head, err := uc.r.ReadHead(uc.e.maxHead)
		if err != nil {
			var oe *net.OpError
			if errors.As(err, &oe) && oe.Op == "write" { // the request's last write, sent by the read
				return fail(errReused(err, uc.reused))
			}
			return fail(errReused(err, uc.reused && uc.r.Buffered() == 0 && isIdempotent(x.method)))
		}
		uc.head = append(uc.head[:0], head...)
		if err := h1.ParseResponse(uc.head, &uc.resp, 256); err != nil {
			return fail(err)
		}
		if uc.resp.Status == 101 {
			if !x.upgrade {
				return fail(errors.New("unexpected 101 Switching Protocols"))
			}
			uc.left = h1.BodyUntilClose
			return nil
		}
		if uc.resp.Status >= 100 && uc.resp.Status < 200 {
			continue // 100 Continue and other interim answers are not passed on
		}
		uc.left = uc.resp.BodyLength(x.method == "HEAD")
		uc.keep = !uc.resp.Close && uc.left != h1.BodyUntilClose
		if uc.left == h1.BodyChunked {
			uc.chunked.Reset(uc.r)
		}
		return nil
	}
}

// flush writes the rest of the request. On a raw socket, the last write is made by the read
// of the answer, which then waits without a read that finds nothing (sock.SendThenRead).
func (uc *upConn) flush() error {
	if uc.r.Buffered() > 0 {
		return uc.w.Flush() // the next read may not reach the socket
	}
	return uc.rw.SendThenRead(uc.flushFn)
}

// deadline bounds the exchange by ctx's deadline (zero: none; a pooled connection may carry an
// older one). Changing a deadline is a timer update in the runtime, so a pooled connection keeps
// the one it has when that ends no later than ctx's and no more than 1/32 of the time left
// earlier: at a steady rate, a connection's deadline changes once every few hundred requests.
func (uc *upConn) deadline(ctx context.Context, now time.Time) {
	dl, _ := ctx.Deadline()
	switch {
	case dl.IsZero():
		if uc.dl.IsZero() {
			return
		}
	case !uc.dl.IsZero() && !uc.dl.After(dl) && dl.Sub(uc.dl) <= dl.Sub(now)/32:
		return
	}
	uc.dl = dl
	_ = uc.c.SetDeadline(dl)
}

// Read reads the response body.
func (uc *upConn) Read(p []byte) (int, error) {
	switch {
	case uc.left == 0:
		return 0, io.EOF
	case uc.left == h1.BodyChunked:
		n, err := uc.chunked.Read(p)
		if err == io.EOF {
			uc.left = 0
		}
		return n, err
	case uc.left == h1.BodyUntilClose:
		return uc.r.Read(p)
	}
	if int64(len(p)) > uc.left {
		p = p[:uc.left]
	}
	n, err := uc.r.Read(p)
	uc.left -= int64(n)
	if err == io.EOF && uc.left > 0 {
		err = io.ErrUnexpectedEOF
	}
	return n, err
}

// next returns up to n body bytes without copying (valid until the next call), for
// length-delimited bodies.
func (uc *upConn) next(n int) ([]byte, error) {
	p, err := uc.r.Next(int(min(int64(n), uc.left)))
	uc.left -= int64(len(p))
	if err == io.EOF && uc.left > 0 {
		err = io.ErrUnexpectedEOF
	}
	return p, err
}

// trailer is the trailer section of a chunked body read to its end.
func (uc *upConn) trailer() []h1.Field {
	if uc.resp.Chunked {
		return uc.chunked.Trailer
	}
	return nil
}

// release ends the exchange, once: a connection whose body was read to the end goes back to
// the pool (the response must not be used afterwards).
func (uc *upConn) release(done bool) {
	if uc.done {
		return
	}
	uc.done = true
	ok := true
	if uc.stop != nil {
		ok = uc.stop() // false: the context fired and poisoned the deadline
	}
	if done && uc.left == 0 && uc.keep && ok {
		uc.e.put(uc) // the next exchange sets its own deadline
		return
	}
	uc.close()
}

func (uc *upConn) close() {
	uc.done = true
	if uc.stop != nil {
		uc.stop()
	}
	uc.e.mu.Lock()
	uc.e.checkin(uc)
	uc.e.mu.Unlock()
	uc.c.Close()
}

// errReused marks an error that happened before any byte of the answer arrived; retryable says
// whether sending again is safe.
func errReused(err error, retryable bool) error {
	if !retryable {
		return err
	}
	return errors.Join(errReusedClosed, err)
}

func isIdempotent(m string) bool {
	switch m {
	case "GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE":
		return true
	}
	return false
}

// hopByHop reports request or response fields that apply to one connection only (RFC 9110
// section 7.6.1), which a proxy does not forward.
func hopByHop(name []byte) bool {
	switch len(name) {
	case 2:
		return h1.EqualFold(name, "TE")
	case 7:
		return h1.EqualFold(name, "Upgrade") || h1.EqualFold(name, "Trailer")
	case 10:
		return h1.EqualFold(name, "Connection") || h1.EqualFold(name, "Keep-Alive")
	case 16:
		return h1.EqualFold(name, "Proxy-Connection")
	case 17:
		return h1.EqualFold(name, "Transfer-Encoding")
	case 18:
		return h1.EqualFold(name, "Proxy-Authenticate")
	case 19:
		return h1.EqualFold(name, "Proxy-Authorization")
	}
	return false
}

// namedInConnection reports whether a Connection field of fields names name.
func namedInConnection(fields []h1.Field, name []byte) bool {
	for _, f := range fields {
		if h1.EqualFold(f.Name, "Connection") && hasTokenBytes(f.Value, name) {
			return true
		}
	}
	return false
}

func hasTokenBytes(v, tok []byte) bool {
	for len(v) > 0 {
		i := 0
		for i < len(v) && v[i] != ',' {
			i++
		}
		t := v[:i]
		for len(t) > 0 && (t[0] == ' ' || t[0] == '\t') {
			t = t[1:]
		}
		for len(t) > 0 && (t[len(t)-1] == ' ' || t[len(t)-1] == '\t') {
			t = t[:len(t)-1]
		}
		if len(t) == len(tok) && h1.EqualFold(t, string(tok)) {
			return true
		}
		if i == len(v) {
			break
		}
		v = v[i+1:]
	}
	return false
}

// dropRequestField: fields of the client's request that are not forwarded as they are. Names
// with an underscore go too, as nginx drops them: CGI, WSGI and PHP read x_tenant_id and
// x-tenant-id as the same variable (HTTP_X_TENANT_ID), so an x_tenant_id or x_tm_subject the
// client sent could shadow the gateway's (docs/security.md).
func dropRequestField(x *exchange, f h1.Field) bool {
	n := f.Name
	if hopByHop(n) || h1.HasPrefixFold(n, tmhttp.HeaderPrefixTM) || bytes.IndexByte(n, '_') >= 0 {
		return true
	}
	drop := false
	switch len(n) {
	case 4:
		drop = h1.EqualFold(n, "Host")
	case 6:
		drop = h1.EqualFold(n, "Expect")
	case 9:
		drop = h1.EqualFold(n, "Forwarded")
	case 10:
		drop = x.sc.IsValid() && h1.EqualFold(n, "Tracestate")
	case 11:
		drop = x.sc.IsValid() && h1.EqualFold(n, "Traceparent")
	case 12:
		drop = x.reqID != "" && h1.EqualFold(n, tmhttp.HeaderRequestID)
	case 13:
		drop = x.dropAuthz && h1.EqualFold(n, "Authorization")
	case 14:
		// X-Forwarded-By is shardkit's forward mode's loop guard: only an instance sets it.
		drop = h1.EqualFold(n, "Content-Length") || h1.EqualFold(n, tmhttp.HeaderForwardedBy)
	case 15:
		drop = h1.EqualFold(n, "X-Forwarded-For")
	case 16:
		drop = h1.EqualFold(n, "X-Forwarded-Host")
	case 17:
		drop = h1.EqualFold(n, "X-Forwarded-Proto")
	}
	if drop {
		return true
	}
	return x.connNames && namedInConnection(x.fields, n)
}

// writeRequestHead writes the request line and fields for an attempt: the client's fields less
// hop-by-hop ones (and those its Connection names), every x-tm-* and the forwarding fields it
// sent; then X-Forwarded-For/-Host/-Proto, x-request-id, the tenantmesh fields and the framing.
func writeRequestHead(w *bufio.Writer, x *exchange, base string) {
	w.WriteString(x.method)
	w.WriteByte(' ')
	if base != "" && base != "/" {
		if base[len(base)-1] == '/' {
			base = base[:len(base)-1]
		}
		w.WriteString(base)
	} else {
		base = ""
	}
	w.Write(x.target)
	w.WriteString(" HTTP/1.1\r\nHost: ")
	w.Write(x.host)
	w.WriteString("\r\n")
	for _, f := range x.fields {
		if dropRequestField(x, f) {
			continue
		}
		w.Write(f.Name)
		w.WriteString(": ")
		w.Write(f.Value)
		w.WriteString("\r\n")
	}
	if x.remoteIP != "" {
		w.WriteString("X-Forwarded-For: ")
		w.WriteString(x.remoteIP)
		w.WriteString("\r\n")
	}
	w.WriteString("X-Forwarded-Host: ")
	w.Write(x.host)
	if x.tls {
		w.WriteString("\r\nX-Forwarded-Proto: https\r\n")
	} else {
		w.WriteString("\r\nX-Forwarded-Proto: http\r\n")
	}
	if x.reqID != "" {
		w.WriteString("X-Request-Id: ")
		w.WriteString(x.reqID)
		w.WriteString("\r\n")
	}
	w.WriteString("X-Tm-Kind: ")
	w.WriteString(x.ke.name)
	w.WriteString("\r\n")
	if x.entry.Epoch != 0 {
		w.WriteString("X-Tm-Epoch: ")
		w.Write(strconv.AppendUint(x.num[:0], x.entry.Epoch, 10))
		w.WriteString("\r\nX-Tm-Shard: ")
		w.WriteString(x.entry.Shard)
	} else { // an affinity tenant not placed yet: the instance's own shard
		w.WriteString("X-Tm-Shard: ")
		w.WriteString(x.inst.id.Shard)
	}
	w.WriteString("\r\n")
	if x.sc.IsValid() { // tracing on: the attempt's (or the request's) span is the instance's parent
		writeTraceparent(w, x.sc)
	}
	if x.subject != "" {
		w.WriteString("X-Tm-Subject: ")
		w.WriteString(x.subject)
		w.WriteString("\r\n")
	}
	if x.proof != nil {
		writeProof(w, x, base)
	}
	if x.upgrade {
		up, _ := h1.Get(x.fields, "Upgrade")
		w.WriteString("Connection: Upgrade\r\nUpgrade: ")
		w.Write(up)
		w.WriteString("\r\n")
	}
	switch {
	case x.bodyBuf != nil:
		w.WriteString("Content-Length: ")
		w.Write(strconv.AppendInt(x.num[:0], int64(len(x.bodyBuf)), 10))
		w.WriteString("\r\n")
	case x.body != nil && x.bodyLen >= 0:
		w.WriteString("Content-Length: ")
		w.Write(strconv.AppendInt(x.num[:0], x.bodyLen, 10))
		w.WriteString("\r\n")
	case x.body != nil:
		w.WriteString("Transfer-Encoding: chunked\r\n")
	}
	w.WriteString("\r\n")
}

// writeProof writes X-Tm-Proof: the gateway's proof of the request line and the fields the
// shard's gate acts on (internal/gatesig), as they were just written.
func writeProof(w *bufio.Writer, x *exchange, base string) {
	w.WriteString(tmhttp.HeaderProof + ": ")
	w.Write(proofValue(x, base))
	w.WriteString("\r\n")
}

// proofValue is X-Tm-Proof's value for x's attempt, in x's buffer.
func proofValue(x *exchange, base string) []byte {
	f := &x.pf
	f.Method, f.Base, f.Target, f.Kind, f.Tenant, f.Subject = x.method, base, str(x.target), x.ke.name, x.tenant, x.subject
	if x.entry.Epoch != 0 {
		f.Shard, f.Epoch = x.entry.Shard, str(strconv.AppendUint(x.pnum[:0], x.entry.Epoch, 10))
	} else {
		f.Shard, f.Epoch = x.inst.id.Shard, ""
	}
	return x.proof.Append(x.pbuf[:0], time.Now().Unix(), f)
}

// writeRequestBody writes the buffered body, or streams the body (chunked when its length is
// unknown); a streamed body is read once and never replayed.
func writeRequestBody(w *bufio.Writer, x *exchange) error {
	if x.bodyBuf != nil {
		_, err := w.Write(x.bodyBuf)
		return err
	}
	if x.body == nil {
		return nil
	}
	body := x.body
	x.body = nil // read once
	buf := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(buf)
	var sent int64
	for {
		n, rerr := body.Read(*buf)
		if n > 0 {
			sent += int64(n)
			if x.bodyLen < 0 {
				var num [20]byte
				w.Write(strconv.AppendInt(num[:0], int64(n), 16))
				w.WriteString("\r\n")
			}
			if _, err := w.Write((*buf)[:n]); err != nil {
				return err
			}
			if x.bodyLen < 0 {
				w.WriteString("\r\n")
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return &clientBodyError{rerr}
		}
	}
	if x.bodyLen < 0 {
		_, err := w.WriteString("0\r\n\r\n")
		return err
	}
	if sent != x.bodyLen {
		return &clientBodyError{io.ErrUnexpectedEOF}
	}
	return nil
}

// clientBodyError: reading the client's body failed while streaming it to the instance.
type clientBodyError struct{ err error }

func (e *clientBodyError) Error() string { return "reading the request body: " + e.err.Error() }
func (e *clientBodyError) Unwrap() error { return e.err }

// copyBufs lends 32 KiB copy buffers.
var copyBufs = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}
