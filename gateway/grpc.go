package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2/hpack"

	"github.com/tenantmesh/tenantmesh/gateway/h1"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// gRPC calls (HTTP/2 with a content type of application/grpc) take the same stages as every
// request (admit, place, hold, pick, send, answer) with three differences, all in this file:
//
//   - send: the call goes to the instance over HTTP/2 (h2c with prior knowledge to http://
//     instances, TLS with ALPN h2 to https:// ones), on connections the engine's own HTTP/2
//     client multiplexes (upstream, h2up.go), with flow control per stream; the request
//     stream is not buffered before it is sent (a bidirectional stream would wait for itself)
//     but kept as it goes, up to MaxReplayBody, so an attempt that may be sent again can be
//     (replayBody); what of it has come when the head goes goes in the same write;
//   - answer: headers, messages (each flushed as it comes) and trailers are relayed; a stream
//     that breaks after its headers ends with a grpc-status in the trailers;
//   - errors: the gateway's own answers are gRPC statuses (grpcStatusFields), e.g. no
//     live instance UNAVAILABLE with grpc-retry-pushback-ms, an invalid tenant
//     INVALID_ARGUMENT, a refused token UNAUTHENTICATED, another tenant's token
//     PERMISSION_DENIED.
//
// grpc-timeout bounds the whole call (DEADLINE_EXCEEDED); the kind's upstream timeout bounds
// each attempt's wait for the answer's headers, not a stream's life.

// serveGRPC runs a gRPC call from the hold stage on: the call's deadline (grpc-timeout), the
// hold while its tenant moves, the attempts over HTTP/2, and the answer.
func (g *Gateway) serveGRPC(x *exchange) {
	if d, ok := grpcTimeout(x.fields); ok {
		x.ctx, x.cancel = context.WithTimeout(x.ctx, d)
	} else if !x.streamCtx {
		x.ctx, x.cancel = context.WithCancel(x.ctx)
	}
	if err := g.holdIfMoving(x); err != nil {
		g.answerError(x, err)
		return
	}
	a, err := g.sendGRPC(x)
	if err != nil {
		g.answerError(x, err)
		return
	}
	defer a.done()
	g.answerGRPC(x, a)
}

// sendGRPC is the send stage for a gRPC call: attempts until one is delivered, each judged as
// an HTTP request's attempt is (judgeAttempt, the managed judgement): a refused connection or
// stream, or a call to a kind that only reads or with an idempotency key to an idempotent kind,
// goes again while its request stream is kept whole; a gate refusal (x-tm-refused, 421)
// refreshes the placement and goes to the owner, holding when the tenant moves. What is gRPC's
// own: how an answer shows a refusal (grpcRefusal) and the error given up with (grpcFailure).
func (g *Gateway) sendGRPC(x *exchange) (*grpcAttempt, error) {
	for n := 0; ; n++ {
		if err := g.holdIfMoving(x); err != nil {
			return nil, err
		}
		in, err := x.policy.pick(&g.pe, x, n)
		if in == nil {
			return nil, err
		}
		a, err := g.attemptGRPC(x, in)
		x.replayable = x.rbody.replayable()
		var ref *refusal
		if err == nil {
			ref = grpcRefusal(x, a)
		}
		switch v, err := judgeAttempt(&g.pe, x, in, err, ref, n); v {
		case deliver:
			x.inst, x.code = in, a.s.status
			return a, nil
		case fail:
			return nil, grpcFailure(x, err)
		}
	}
}

// grpcFailure is the error a gRPC call gives up with, which answerError turns into its status:
// past the call's deadline (grpc-timeout) DEADLINE_EXCEEDED, whatever the attempt's failure was
// (a connect the deadline cut short too), as gRPC has it; else the judgement's error.
func grpcFailure(x *exchange, err error) error {
	if errors.Is(x.ctx.Err(), context.DeadlineExceeded) {
		return context.DeadlineExceeded
	}
	return err
}

// hpackGet is the value of the field named name (any case; HTTP/2's are lower case) in
// fields, "" if absent.
func hpackGet(fields []hpack.HeaderField, name string) string {
	for _, f := range fields {
		if len(f.Name) == len(name) && strings.EqualFold(f.Name, name) {
			return f.Value
		}
	}
	return ""
}

// grpcRefusal is a delivered attempt's gate refusal, nil if the answer is the service's. The
// gate refuses a gRPC call with a gRPC status (UNAVAILABLE, the answer's HTTP status 200):
// x-tm-refused, the owner in x-tm-owner and x-tm-epoch, grpc-retry-pushback-ms; an instance
// may also answer 421 with a problem body. A refused attempt is ended (a.s is another call's
// from here); its problem, should the gateway give up, is a 503 saying the call did not reach
// the service.
func grpcRefusal(x *exchange, a *grpcAttempt) *refusal {
	s := a.s
	reason := hpackGet(s.head, tmhttp.HeaderRefused)
	if reason == "" && s.status != http.StatusMisdirectedRequest {
		return nil
	}
	r := &refusal{reason: reason, status: s.status}
	if o := hpackGet(s.head, "x-tm-owner"); o != "" {
		r.prob.Owner = o
		r.prob.Epoch, _ = strconv.ParseUint(hpackGet(s.head, "x-tm-epoch"), 10, 64)
	} else if s.status == http.StatusMisdirectedRequest {
		var b []byte
		for len(b) < 16<<10 {
			chunk, eof, err := s.next(x.ctx, true)
			b = append(b, chunk...)
			if eof || err != nil {
				break
			}
		}
		_ = json.Unmarshal(b, &r.prob)
	}
	ms, _ := strconv.Atoi(hpackGet(s.head, tmhttp.HeaderPushback))
	a.done()
	if r.status != http.StatusMisdirectedRequest {
		r.status = http.StatusServiceUnavailable
		r.prob.Type, r.prob.Title = "shard-refused", "Shard refused the call"
		r.prob.Detail = "the tenant's shard refused the call (" + reason + "); it did not reach the service: call again"
		r.prob.RetryAfter = (ms + 999) / 1000
	}
	return r
}

// grpcAttempt is a delivered attempt: its stream, and its place among the instance's calls
// under way (where a takeover or the upstream timeout stops it).
type grpcAttempt struct {
	g     *Gateway
	host  string
	call  h2call
	s     *h2stream
	ended bool
}

// done ends the attempt: it leaves the calls under way, and its stream is reset if still
// open (and serves another call).
func (a *grpcAttempt) done() {
	if a == nil || a.ended {
		return
	}
	a.ended = true
	if a.call.s != nil {
		a.g.up.remove(a.host, &a.call) // nothing stops the call from here: s may go
	}
	if a.s != nil {
		a.s.done()
	}
}

// attemptGRPC sends the call to in once and waits (up to the kind's upstream timeout, which
// the upstream's housekeeping checks) for the answer's headers, keeping the instance's
// counters and breaker.
func (g *Gateway) attemptGRPC(x *exchange, in *instance) (*grpcAttempt, error) {
	u := in.url.Load()
	a := &grpcAttempt{g: g, host: u.Host}
	a.call.tenant = x.tenant
	x.inst = in
	in.inflight.Add(1)
	in.requests.Add(1)
	t0 := time.Now()
	err := g.startGRPC(x, a, u, upNow()+int64(x.policy.timeout(x.ke.config())))
	in.inflight.Add(-1)
	if err != nil {
		a.done()
		if errors.Is(x.ctx.Err(), context.Canceled) || errors.Is(err, errStreamRefused) {
			in.breaker.Abandon()
		} else {
			in.failures.Add(1)
			in.breaker.Failure()
		}
		return nil, err
	}
	in.observe(time.Since(t0))
	in.breaker.Success()
	return a, nil
}

// startGRPC opens the attempt's stream, sends its head and what of the request stream has
// come (in the same write), and waits for the answer's head.
func (g *Gateway) startGRPC(x *exchange, a *grpcAttempt, u *url.URL, deadline int64) error {
	s, err := g.up.open(x.ctx, u)
	if err != nil {
		return err
	}
	a.s, a.call.s = s, s
	a.call.deadline.Store(deadline)
	g.up.add(a.host, &a.call)
	if err := g.sendHead(x, a, u); err != nil {
		return err
	}
	err = s.awaitHead(x.ctx)
	if !a.call.deadline.CompareAndSwap(deadline, 0) {
		return context.DeadlineExceeded // the upstream timeout
	}
	if c := a.call.err(); c != nil {
		return c // abandoned
	}
	return err
}

// sendHead sends the attempt's head and what of the request stream has come (in the same
// write).
func (g *Gateway) sendHead(x *exchange, a *grpcAttempt, u *url.URL) error {
	s := a.s
	blk := g.grpcHead(x, u)
	if x.rbody == nil {
		if err := s.writeHead(blk, true); err != nil {
			return err
		}
		if err := s.flush(); err != nil {
			return err
		}
	} else {
		if err := s.writeHead(blk, false); err != nil {
			return err
		}
		ab := x.rbody.attempt().(*attemptBody)
		s.sendBody(ab, ab.ready)
	}
	return nil
}

// grpcHead encodes the attempt's header block: the client's fields less those the gateway
// does not forward (dropRequestField, as for HTTP/1.1), then the forwarding fields, the
// tenantmesh fields and the proof. No dynamic table: nothing is kept from the exchange.
func (g *Gateway) grpcHead(x *exchange, u *url.URL) []byte {
	hb := headerBlock{b: x.h2blk[:0]}
	switch x.method {
	case "POST":
		hb.indexed(3)
	case "GET":
		hb.indexed(2)
	default:
		hb.fieldStr(":method", x.method)
	}
	if u.Scheme == "https" {
		hb.indexed(7)
	} else {
		hb.indexed(6)
	}
	hb.field(str2b(":authority"), x.host)
	base := u.Path
	if base == "/" {
		base = ""
	}
	base = strings.TrimSuffix(base, "/")
	if base == "" {
		hb.field(str2b(":path"), x.target)
	} else {
		x.h2path = append(append(x.h2path[:0], base...), x.target...)
		hb.field(str2b(":path"), x.h2path)
	}
	for _, f := range x.fields {
		if !dropRequestField(x, f) && !h2Forbidden(f.Name) {
			hb.field(f.Name, f.Value)
		}
	}
	hb.fieldStr("te", "trailers")
	if x.remoteIP != "" {
		hb.fieldStr("x-forwarded-for", x.remoteIP)
	}
	hb.field(str2b("x-forwarded-host"), x.host)
	if x.tls {
		hb.fieldStr("x-forwarded-proto", "https")
	} else {
		hb.fieldStr("x-forwarded-proto", "http")
	}
	if x.reqID != "" {
		hb.fieldStr("x-request-id", x.reqID)
	}
	hb.fieldStr("x-tm-kind", x.ke.name)
	if x.entry.Epoch != 0 {
		hb.field(str2b("x-tm-epoch"), strconv.AppendUint(x.num[:0], x.entry.Epoch, 10))
		hb.fieldStr("x-tm-shard", x.entry.Shard)
	} else {
		hb.fieldStr("x-tm-shard", x.inst.id.Shard)
	}
	if x.subject != "" {
		hb.fieldStr("x-tm-subject", x.subject)
	}
	if x.proof != nil {
		hb.field(str2b("x-tm-proof"), proofValue(x, base))
	}
	if x.sc.IsValid() {
		tp, ts := traceparentValue(x.sc)
		hb.fieldStr("traceparent", tp)
		if ts != "" {
			hb.fieldStr("tracestate", ts)
		}
	}
	x.h2blk = hb.b
	return hb.b
}

// answerGRPC relays a delivered call: the headers (hop-by-hop fields and every x-tm-* one
// removed, x-served-by and x-request-id set), the messages as they come (flushed whenever the
// instance has sent nothing more yet), then the trailers. A stream that breaks after its
// headers ends with a status in the trailers: UNAVAILABLE (call again) when its shard was
// taken over or the instance went away, DEADLINE_EXCEEDED past grpc-timeout.
func (g *Gateway) answerGRPC(x *exchange, a *grpcAttempt) {
	if x.ticket != nil { // the next held request may go: this one has its answer
		g.holds.done(x.ke, x.ticket)
		x.ticket = nil
	}
	s, out := a.s, x.out
	fields := x.rfields[:0]
	for _, f := range s.head {
		n := str2b(f.Name)
		if hopByHop(n) || h1.HasPrefixFold(n, tmhttp.HeaderPrefixTM) || h1.EqualFold(n, "Content-Length") || h1.EqualFold(n, tmhttp.HeaderServedBy) ||
			(x.reqID != "" && h1.EqualFold(n, tmhttp.HeaderRequestID)) {
			continue
		}
		fields = append(fields, h1.Field{Name: n, Value: str2b(f.Value)})
	}
	fields = append(fields, h1.Field{Name: hdrServedBy, Value: str2b(x.inst.key)})
	if x.reqID != "" {
		fields = append(fields, h1.Field{Name: hdrRequestID, Value: str2b(x.reqID)})
	}
	x.rfields = fields
	p, eof, err := s.next(x.ctx, false)
	if eof && len(p) == 0 && !s.gotTrailer { // trailers-only: the status is in the head
		_ = out.writeHead(s.status, fields, 0, true)
		g.metrics.grpcCall(x.ke.name, grpcStatusOf(s))
		return
	}
	if out.writeHead(s.status, fields, -1, false) != nil {
		x.code = statusClientClosed
		return
	}
	for {
		if len(p) > 0 {
			if out.write(p) != nil {
				x.code = statusClientClosed
				return // the client went away: done resets the stream to the instance
			}
			p, eof, err = s.next(x.ctx, false)
			continue
		}
		if eof {
			break
		}
		if err != nil {
			if x.ctx.Err() != nil && errors.Is(x.ctx.Err(), context.Canceled) {
				x.code = statusClientClosed
				return
			}
			pr := brokenStatus(x, a, err)
			_ = out.finish(grpcStatusFields(x.rfields[len(x.rfields):], pr, false))
			g.metrics.grpcCall(x.ke.name, tmhttp.GRPCCode(pr))
			return
		}
		if out.flush() != nil {
			x.code = statusClientClosed
			return
		}
		p, eof, err = s.next(x.ctx, true)
	}
	tr := x.rfields[len(x.rfields):]
	for _, f := range s.trailer {
		tr = append(tr, h1.Field{Name: str2b(f.Name), Value: str2b(f.Value)})
	}
	_ = out.finish(tr)
	g.metrics.grpcCall(x.ke.name, grpcStatusOf(s))
}

// grpcStatusOf is the grpc-status of a relayed answer (trailers, or the header block of a
// trailers-only one); UNKNOWN without one.
func grpcStatusOf(s *h2stream) int {
	v := hpackGet(s.trailer, "grpc-status")
	if v == "" {
		v = hpackGet(s.head, "grpc-status")
	}
	if n, err := strconv.Atoi(v); err == nil {
		return n
	}
	return tmhttp.GRPCUnknown
}

// brokenStatus is the status of a stream that broke after its headers.
func brokenStatus(x *exchange, a *grpcAttempt, err error) tmhttp.Problem {
	cause := a.call.err()
	switch {
	case errors.Is(cause, errAbandoned):
		return tmhttp.Problem{Status: http.StatusServiceUnavailable, Title: "Stream abandoned",
			Detail: "the tenant's shard is being taken over; call again (the gateway sends the call to the new owner)", RetryAfter: 1}
	case errors.Is(x.ctx.Err(), context.DeadlineExceeded):
		return tmhttp.Problem{Status: http.StatusGatewayTimeout, Title: "Deadline exceeded", Detail: "grpc-timeout ran out"}
	}
	x.ke.metrics.code(http.StatusBadGateway)
	return tmhttp.Problem{Status: http.StatusServiceUnavailable, Title: "Stream broken",
		Detail: "the stream to instance " + x.inst.key + " broke (" + err.Error() + "); call again", RetryAfter: 1}
}

// grpcStatusFields appends p as a gRPC status: grpc-status, grpc-message, and for UNAVAILABLE
// and RESOURCE_EXHAUSTED grpc-retry-pushback-ms; with head (a trailers-only answer) the
// content type and the owner a refusal names too (tmhttp.WriteGRPCProblem's fields).
func grpcStatusFields(dst []h1.Field, p tmhttp.Problem, head bool) []h1.Field {
	if head {
		dst = append(dst, h1.Field{Name: []byte("content-type"), Value: []byte("application/grpc")})
	}
	code := tmhttp.GRPCCode(p)
	msg := p.Title
	if p.Detail != "" {
		msg += ": " + p.Detail
	}
	dst = append(dst, h1.Field{Name: []byte("grpc-status"), Value: strconv.AppendInt(nil, int64(code), 10)},
		h1.Field{Name: []byte("grpc-message"), Value: []byte(tmhttp.EncodeGRPCMessage(msg))})
	if p.RetryAfter > 0 && (code == tmhttp.GRPCUnavailable || code == tmhttp.GRPCResourceExhausted) {
		dst = append(dst, h1.Field{Name: []byte(tmhttp.HeaderPushback), Value: strconv.AppendInt(nil, int64(p.RetryAfter)*1000, 10)})
	}
	if head && p.Owner != "" {
		dst = append(dst, h1.Field{Name: []byte(tmhttp.HeaderOwner), Value: []byte(p.Owner)})
	}
	if head && p.Epoch != 0 {
		dst = append(dst, h1.Field{Name: []byte(tmhttp.HeaderEpoch), Value: strconv.AppendUint(nil, p.Epoch, 10)})
	}
	return dst
}

// grpcTimeout parses the call's grpc-timeout (1 to 8 digits and a unit: H, M, S, m, u, n).
func grpcTimeout(fields []h1.Field) (time.Duration, bool) {
	v, n := h1.Get(fields, "Grpc-Timeout")
	if n != 1 || len(v) < 2 || len(v) > 9 {
		return 0, false
	}
	d, err := strconv.ParseUint(string(v[:len(v)-1]), 10, 64)
	if err != nil {
		return 0, false
	}
	unit := map[byte]time.Duration{'H': time.Hour, 'M': time.Minute, 'S': time.Second, 'm': time.Millisecond, 'u': time.Microsecond, 'n': time.Nanosecond}[v[len(v)-1]]
	if unit == 0 {
		return 0, false
	}
	return time.Duration(d) * unit, true
}

// replayBody lets a gRPC call's request stream go to more than one attempt without being
// buffered before the first: what the attempts read from the client is kept, up to limit, and
// a later attempt reads that again, then the rest. Once more than limit was read the start is
// lost, and the call can no longer be replayed.
type replayBody struct {
	mu    sync.Mutex
	src   io.Reader
	buf   []byte
	limit int
	total int   // bytes read from src
	over  bool  // more than limit read: buf is not the whole start
	err   error // src's last error (io.EOF at its end)
}

func newReplayBody(src io.Reader, limit int64) *replayBody {
	return &replayBody{src: src, limit: int(limit)}
}

// replayable: an attempt from now on would send the whole stream.
func (rb *replayBody) replayable() bool {
	if rb == nil {
		return true
	}
	rb.mu.Lock()
	defer rb.mu.Unlock()
	return !rb.over
}

// attempt is a reader for the next attempt (nil without a body).
func (rb *replayBody) attempt() io.ReadCloser {
	if rb == nil {
		return http.NoBody
	}
	return &attemptBody{rb: rb}
}

var errReplayLost = errors.New("the request stream is longer than the gateway keeps for a replay")

// attemptBody is one attempt's view of the request stream. Close (from the transport, maybe
// after the attempt ended) stops it; a read that was waiting for the client when the attempt
// ended still keeps what it got for the next attempt.
type attemptBody struct {
	rb     *replayBody
	pos    int
	closed atomic.Bool
}

func (a *attemptBody) Read(p []byte) (int, error) {
	rb := a.rb
	rb.mu.Lock()
	defer rb.mu.Unlock()
	if a.closed.Load() {
		return 0, io.ErrClosedPipe
	}
	if a.pos < len(rb.buf) {
		n := copy(p, rb.buf[a.pos:])
		a.pos += n
		return n, nil
	}
	if a.pos < rb.total {
		return 0, errReplayLost
	}
	if rb.err != nil {
		return 0, rb.err
	}
	n, err := rb.src.Read(p)
	rb.total += n
	if !rb.over && len(rb.buf)+n <= rb.limit {
		rb.buf = append(rb.buf, p[:n]...)
	} else {
		rb.over = true
	}
	a.pos += n
	if err != nil {
		rb.err = err
	}
	return n, err
}

// ready: a Read would not wait (the kept start, the stream's end, or bytes the client's
// stream has buffered, when it can tell: h2body).
func (a *attemptBody) ready() bool {
	rb := a.rb
	if !rb.mu.TryLock() {
		return false
	}
	defer rb.mu.Unlock()
	if a.closed.Load() || a.pos < rb.total || rb.err != nil {
		return true
	}
	r, ok := rb.src.(interface{ ready() bool })
	return ok && r.ready()
}

// Close ends the attempt's view (it does not wait for a read under way).
func (a *attemptBody) Close() error {
	a.closed.Store(true)
	return nil
}
