package gateway

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tenantmesh/tenantmesh/gateway/h1"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// gRPC calls (HTTP/2 with a content type of application/grpc) take the same stages as every
// request (admit, place, hold, pick, send, answer) with three differences, all in this file:
//
//   - send: the call goes to the instance over HTTP/2 (h2c with prior knowledge to http://
//     instances, TLS with ALPN h2 to https:// ones), on connections net/http's Transport
//     multiplexes (upstream), with its flow control per stream; the request stream is not
//     buffered before it is sent (a bidirectional stream would wait for itself) but kept as it
//     goes, up to MaxReplayBody, so an attempt that may be sent again can be (replayBody);
//   - answer: headers, messages (each flushed as it comes) and trailers are relayed; a stream
//     that breaks after its headers ends with a grpc-status in the trailers;
//   - errors: the gateway's own answers are gRPC statuses (tmhttp.WriteGRPCProblem), e.g. no
//     live instance UNAVAILABLE with grpc-retry-pushback-ms, an invalid tenant
//     INVALID_ARGUMENT, a refused token UNAUTHENTICATED, another tenant's token
//     PERMISSION_DENIED.
//
// grpc-timeout bounds the whole call (DEADLINE_EXCEEDED); the kind's upstream timeout bounds
// each attempt's wait for the answer's headers, not a stream's life.

// upstream is the send stage's HTTP/2 side: one net/http Transport that speaks h2c with prior
// knowledge to http:// instances and h2 by ALPN to https:// ones, multiplexing calls over a
// connection per instance, and the calls under way, by instance, so that a takeover can
// abandon a tenant's (as engine.abandon does for HTTP/1.1).
type upstream struct {
	t *http.Transport

	mu    sync.Mutex
	calls map[string]map[*h2call]struct{} // by host
}

// h2call is one attempt under way.
type h2call struct {
	tenant string
	cancel context.CancelCauseFunc
}

func newUpstream(cfg Config) *upstream {
	p := new(http.Protocols)
	p.SetUnencryptedHTTP2(true) // http:// instances: HTTP/2 with prior knowledge
	p.SetHTTP2(true)            // https:// instances: ALPN h2
	t := &http.Transport{
		DialContext:            (&net.Dialer{Timeout: cfg.ConnectTimeout, KeepAlive: 30 * time.Second}).DialContext,
		TLSClientConfig:        &tls.Config{RootCAs: cfg.UpstreamCAs, MinVersion: tls.VersionTLS12},
		TLSHandshakeTimeout:    cfg.ConnectTimeout + time.Second,
		ForceAttemptHTTP2:      true,
		DisableCompression:     true, // the call goes as the client sent it (no Accept-Encoding added)
		Protocols:              p,
		IdleConnTimeout:        90 * time.Second,
		MaxResponseHeaderBytes: 1 << 20,
		// A connection that has been silent this long is pinged, and closed when the ping is
		// not answered: a frozen instance's streams end instead of waiting forever.
		HTTP2: &http.HTTP2Config{SendPingTimeout: 15 * time.Second, PingTimeout: 5 * time.Second},
	}
	return &upstream{t: t, calls: map[string]map[*h2call]struct{}{}}
}

func (u *upstream) add(host string, c *h2call) {
	u.mu.Lock()
	m := u.calls[host]
	if m == nil {
		m = map[*h2call]struct{}{}
		u.calls[host] = m
	}
	m[c] = struct{}{}
	u.mu.Unlock()
}

func (u *upstream) remove(host string, c *h2call) {
	u.mu.Lock()
	if m := u.calls[host]; m != nil {
		delete(m, c)
		if len(m) == 0 {
			delete(u.calls, host)
		}
	}
	u.mu.Unlock()
}

// abandon ends tenant's calls under way with the instance at host (errAbandoned).
func (u *upstream) abandon(host, tenant string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	n := 0
	for c := range u.calls[host] {
		if c.tenant == tenant {
			c.cancel(errAbandoned)
			n++
		}
	}
	return n
}

// serveGRPC runs a gRPC call from the hold stage on: the call's deadline (grpc-timeout), the
// hold while its tenant moves, the attempts over HTTP/2, and the answer.
func (g *Gateway) serveGRPC(x *exchange) {
	if d, ok := grpcTimeout(x.fields); ok {
		x.ctx, x.cancel = context.WithTimeout(x.ctx, d)
	} else {
		x.ctx, x.cancel = context.WithCancel(x.ctx)
	}
	if err := g.holdIfMoving(x); err != nil {
		g.answerError(x, err)
		return
	}
	resp, call, err := g.sendGRPC(x)
	if err != nil {
		g.answerError(x, err)
		return
	}
	defer call.done()
	g.answerGRPC(x, resp, call)
}

// sendGRPC is the send stage for a gRPC call: attempts until one is delivered, with the
// managed policy's rules (judgeManaged): a refused connection, or a call to a kind that only
// reads or with an idempotency key to an idempotent kind, goes again while its request stream
// is kept whole; a gate refusal (x-tm-refused, 421) refreshes the placement and goes to the
// owner, holding when the tenant moves.
func (g *Gateway) sendGRPC(x *exchange) (*http.Response, *grpcAttempt, error) {
	for n := 0; ; n++ {
		if err := g.holdIfMoving(x); err != nil {
			return nil, nil, err
		}
		in, err := x.policy.pick(g, x, n)
		if in == nil {
			return nil, nil, err
		}
		resp, a, err := g.attemptGRPC(x, in)
		x.replayable = x.rbody.replayable()
		if err != nil {
			if errors.Is(x.ctx.Err(), context.Canceled) {
				return nil, nil, err
			}
			if x.ctx.Err() != nil {
				return nil, nil, context.DeadlineExceeded
			}
			x.lastErr = &upstreamError{inst: in.key, err: err}
			reason, ok := g.retryable(x, err)
			if !ok || n >= g.cfg.Retries {
				return nil, nil, x.lastErr
			}
			x.ke.metrics.retry(reason)
			if errors.Is(err, errAbandoned) {
				if e, ok := x.ke.lookup(x.tenant); ok {
					x.entry = e
				}
				x.tried = x.tried[:0]
			} else {
				x.tried = append(x.tried, in)
			}
			continue
		}
		refused := resp.Header.Get(tmhttp.HeaderRefused)
		if refused == "" && resp.StatusCode != http.StatusMisdirectedRequest {
			x.inst, x.code = in, resp.StatusCode
			return resp, a, nil
		}
		prob := refusalOf(resp)
		a.done()
		if !x.replayable || n >= g.cfg.Retries {
			if resp.StatusCode == http.StatusMisdirectedRequest || refused == "not_owner" || refused == "unplaced" || refused == "stale_epoch" {
				return nil, nil, errMisdirected(x)
			}
			return nil, nil, &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "shard-refused", Title: "Shard refused the call",
				Detail: "the tenant's shard refused the call (" + refused + "); it did not reach the service: call again", RetryAfter: time.Second}
		}
		switch refused {
		case "closing", "unconfirmed": // this instance cannot serve now; another of the shard may
			if refused == "closing" {
				x.ke.metrics.retry("instance_stopping")
			} else {
				x.ke.metrics.retry("instance_unconfirmed")
			}
			x.tried = append(x.tried, in)
			continue
		}
		x.ke.metrics.retry("misdirected")
		if err := g.refresh(x, prob); err != nil {
			return nil, nil, err
		}
		x.tried = x.tried[:0]
	}
}

// refusalOf reads the owner a gate refusal names: x-tm-owner and x-tm-epoch of a gRPC status,
// or a 421's problem body.
func refusalOf(resp *http.Response) tmhttp.Problem {
	var p tmhttp.Problem
	if o := resp.Header.Get(tmhttp.HeaderOwner); o != "" {
		p.Owner = o
		p.Epoch, _ = strconv.ParseUint(resp.Header.Get(tmhttp.HeaderEpoch), 10, 64)
		return p
	}
	if resp.StatusCode == http.StatusMisdirectedRequest {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 16<<10))
		_ = json.Unmarshal(b, &p)
	}
	return p
}

// grpcAttempt is a delivered attempt: its context (ended by done) and its place among the
// instance's calls under way.
type grpcAttempt struct {
	g     *Gateway
	host  string
	call  *h2call
	ctx   context.Context
	resp  *http.Response
	ended bool
}

// done ends the attempt: its stream is reset if still open, and it leaves the calls under way.
func (a *grpcAttempt) done() {
	if a == nil || a.ended {
		return
	}
	a.ended = true
	if a.resp != nil {
		a.resp.Body.Close()
	}
	a.call.cancel(context.Canceled)
	a.g.up.remove(a.host, a.call)
}

// attemptGRPC sends the call to in once and waits (up to the kind's upstream timeout) for the
// answer's headers, keeping the instance's counters and breaker.
func (g *Gateway) attemptGRPC(x *exchange, in *instance) (*http.Response, *grpcAttempt, error) {
	u := in.url.Load()
	ctx, cancel := context.WithCancelCause(x.ctx)
	call := &h2call{tenant: x.tenant, cancel: cancel}
	a := &grpcAttempt{g: g, host: u.Host, call: call, ctx: ctx}
	g.up.add(u.Host, call)
	x.inst = in
	req := g.grpcRequest(ctx, x, u)
	in.inflight.Add(1)
	in.requests.Add(1)
	t0 := time.Now()
	timer := time.AfterFunc(x.policy.timeout(x.ke.config()), func() { cancel(context.DeadlineExceeded) })
	resp, err := g.up.t.RoundTrip(req)
	timedOut := !timer.Stop()
	in.inflight.Add(-1)
	if err == nil && (timedOut || ctx.Err() != nil) {
		resp.Body.Close()
		err = context.Cause(ctx)
	}
	if err != nil {
		if c := context.Cause(ctx); c != nil && !errors.Is(c, context.Canceled) {
			err = c // abandoned, or the upstream timeout
		}
		a.done()
		if errors.Is(x.ctx.Err(), context.Canceled) {
			in.breaker.Abandon()
		} else {
			in.failures.Add(1)
			in.breaker.Failure()
		}
		return nil, nil, err
	}
	in.observe(time.Since(t0))
	in.breaker.Success()
	a.resp = resp
	return resp, a, nil
}

// grpcRequest is the attempt's request: the client's fields less those the gateway does not
// forward (dropRequestField, as for HTTP/1.1), then the forwarding fields, the tenantmesh
// fields and the proof.
func (g *Gateway) grpcRequest(ctx context.Context, x *exchange, u *url.URL) *http.Request {
	h := make(http.Header, len(x.fields)+10)
	for _, f := range x.fields {
		if !dropRequestField(x, f) {
			k := http.CanonicalHeaderKey(string(f.Name))
			h[k] = append(h[k], string(f.Value))
		}
	}
	h["Te"] = []string{"trailers"}
	if x.remoteIP != "" {
		h["X-Forwarded-For"] = []string{x.remoteIP}
	}
	h["X-Forwarded-Host"] = []string{string(x.host)}
	if x.tls {
		h["X-Forwarded-Proto"] = []string{"https"}
	} else {
		h["X-Forwarded-Proto"] = []string{"http"}
	}
	if x.reqID != "" {
		// A copy: x.reqID is a view of the pooled exchange, and HPACK keeps what it encodes.
		h[tmhttp.HeaderRequestID] = []string{strings.Clone(x.reqID)}
	}
	h[tmhttp.HeaderKind] = []string{x.ke.name}
	if x.entry.Epoch != 0 {
		h[tmhttp.HeaderEpoch] = []string{strconv.FormatUint(x.entry.Epoch, 10)}
		h[tmhttp.HeaderShard] = []string{x.entry.Shard}
	} else {
		h[tmhttp.HeaderShard] = []string{x.inst.id.Shard}
	}
	if x.subject != "" {
		h[tmhttp.HeaderSubject] = []string{x.subject}
	}
	base := u.Path
	if base == "/" {
		base = ""
	}
	base = strings.TrimSuffix(base, "/")
	if x.proof != nil {
		h[tmhttp.HeaderProof] = []string{string(proofValue(x, base))}
	}
	if x.sc.IsValid() {
		tp, ts := traceparentValue(x.sc)
		h[tmhttp.HeaderTraceparent] = []string{tp}
		if ts != "" {
			h["Tracestate"] = []string{ts}
		}
	}
	// Every string handed to the transport is a copy: HPACK keeps what it encodes, and the
	// exchange's views are reused by the next request.
	req := &http.Request{Method: x.method, URL: &url.URL{Scheme: u.Scheme, Host: u.Host, Opaque: base + string(x.target)},
		Proto: "HTTP/2.0", ProtoMajor: 2, Header: h, Body: x.rbody.attempt(), ContentLength: -1, Host: string(x.host)}
	return req.WithContext(ctx)
}

// answerGRPC relays a delivered call: the headers (hop-by-hop fields and every x-tm-* one
// removed, x-served-by and x-request-id set), each message as it comes, then the trailers. A
// stream that breaks after its headers ends with a status in the trailers: UNAVAILABLE (call
// again) when its shard was taken over or the instance went away, DEADLINE_EXCEEDED past
// grpc-timeout.
func (g *Gateway) answerGRPC(x *exchange, resp *http.Response, a *grpcAttempt) {
	if x.ticket != nil { // the next held request may go: this one has its answer
		g.holds.done(x.ke, x.ticket)
		x.ticket = nil
	}
	out := x.out.(*stdResponder)
	h := out.w.Header()
	for k, vv := range resp.Header {
		if hopByHop(str2b(k)) || strings.HasPrefix(k, tmhttp.HeaderPrefixTM) || k == "Content-Length" || k == tmhttp.HeaderServedBy {
			continue
		}
		h[k] = vv
	}
	h[tmhttp.HeaderServedBy] = []string{x.inst.key}
	if x.reqID != "" {
		h[tmhttp.HeaderRequestID] = []string{strings.Clone(x.reqID)} // x.reqID is the pooled exchange's
	}
	out.w.WriteHeader(resp.StatusCode)
	bp := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(bp)
	for {
		n, err := resp.Body.Read(*bp)
		if n > 0 {
			if out.write((*bp)[:n]) != nil || out.flush() != nil {
				x.code = statusClientClosed
				return // the client went away: done resets the stream to the instance
			}
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			if x.ctx.Err() != nil && errors.Is(x.ctx.Err(), context.Canceled) {
				x.code = statusClientClosed
				return
			}
			p := brokenStatus(x, a, err)
			setGRPCTrailer(h, p)
			g.metrics.grpcCall(x.ke.name, tmhttp.GRPCCode(p))
			return
		}
	}
	for k, vv := range resp.Trailer {
		h[http.TrailerPrefix+k] = vv
	}
	g.metrics.grpcCall(x.ke.name, grpcStatusOf(resp))
}

// grpcStatusOf is the grpc-status of a relayed answer (trailers, or the header block of a
// trailers-only one); UNKNOWN without one.
func grpcStatusOf(resp *http.Response) int {
	v := resp.Trailer.Get("Grpc-Status")
	if v == "" {
		v = resp.Header.Get("Grpc-Status")
	}
	if n, err := strconv.Atoi(v); err == nil {
		return n
	}
	return tmhttp.GRPCUnknown
}

// brokenStatus is the status of a stream that broke after its headers.
func brokenStatus(x *exchange, a *grpcAttempt, err error) tmhttp.Problem {
	cause := context.Cause(a.ctx)
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

// setGRPCTrailer sets p's status as the answer's trailers.
func setGRPCTrailer(h http.Header, p tmhttp.Problem) {
	h[http.TrailerPrefix+"Grpc-Status"] = []string{strconv.Itoa(tmhttp.GRPCCode(p))}
	h[http.TrailerPrefix+"Grpc-Message"] = []string{tmhttp.EncodeGRPCMessage(p.Title + ": " + p.Detail)}
	if p.RetryAfter > 0 {
		h[http.TrailerPrefix+tmhttp.HeaderPushback] = []string{strconv.Itoa(p.RetryAfter * 1000)}
	}
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

// Close ends the attempt's view (it does not wait for a read under way).
func (a *attemptBody) Close() error {
	a.closed.Store(true)
	return nil
}
