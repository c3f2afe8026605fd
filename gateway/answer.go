package gateway

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"time"
	"unsafe"

	"github.com/tenantmesh/tenantmesh/gateway/h1"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// Response headers of the affinity policy: the server that answered and the tenant (realm) it
// answered for. The prerender manager's own names for them, x-boxel-prerender-target and
// x-boxel-prerender-realm, are sent too, with the same values; an instance's answer carrying
// any of the four has them replaced.
const (
	HeaderTarget       = "X-Tm-Target"
	HeaderTargetTenant = "X-Tm-Tenant"
	HeaderSeedTarget   = "X-Boxel-Prerender-Target"
	HeaderSeedRealm    = "X-Boxel-Prerender-Realm"
)

// upstreamError is a failed attempt on an instance.
type upstreamError struct {
	inst string
	err  error
}

func (e *upstreamError) Error() string { return "instance " + e.inst + ": " + e.err.Error() }
func (e *upstreamError) Unwrap() error { return e.err }

// errMisdirected: the shard kept saying it is not the owner and no newer owner turned up. The
// client never sees 421; it is told to come back shortly.
func errMisdirected(x *exchange) error {
	return &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "owner-unknown", Title: "Tenant owner unknown",
		Detail:     "shard " + x.entry.Shard + " is not the tenant's owner and the gateway has not learned the new owner yet; retry shortly",
		RetryAfter: time.Second}
}

func isTimeout(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	var te interface{ Timeout() bool }
	return errors.As(err, &te) && te.Timeout()
}

func isDialError(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// statusClientClosed is what the access metrics record when the client went away (nginx's 499).
const statusClientClosed = 499

// problemFor is the one place that maps a proxying error to the client's answer: the gateway's
// own errors as they say, the client going away 499, an upstream timeout 504, any other upstream
// failure 502.
func problemFor(err error) tmhttp.Problem {
	var te *tmhttp.Error
	switch {
	case errors.As(err, &te):
		return tmhttp.FromError(err)
	case errors.Is(err, context.Canceled):
		return tmhttp.Problem{Type: tmhttp.TypeBase + "client-closed", Title: "Client closed request", Status: statusClientClosed}
	case isDialError(err):
		// The connection was never made (refused, or its connect timed out across a
		// partition): the request reached nothing, so the client may send it again. Not a 504:
		// the fault harness's 2|1 split found connect timeouts answered as upstream timeouts.
		return tmhttp.Problem{Type: tmhttp.TypeBase + "upstream-unreachable", Title: "Upstream unreachable", Status: http.StatusServiceUnavailable,
			Detail: "the gateway could not connect to the shard's instance; the request did not reach it: retry after Retry-After", RetryAfter: 1}
	case isTimeout(err):
		return tmhttp.Problem{Type: tmhttp.TypeBase + "upstream-timeout", Title: "Upstream timeout", Status: http.StatusGatewayTimeout,
			Detail: "the shard did not answer within the kind's upstream timeout"}
	}
	p := tmhttp.Problem{Type: tmhttp.TypeBase + "upstream-failed", Title: "Upstream failed", Status: http.StatusBadGateway,
		Detail: "the request to the shard failed"}
	var ue *upstreamError
	if errors.As(err, &ue) {
		p.Detail += " (" + ue.inst + ")"
	}
	return p
}

// answerError answers x with the problem+json for err (nothing for a client that went away).
func (g *Gateway) answerError(x *exchange, err error) {
	p := problemFor(err)
	x.code = p.Status
	p.Tenant = x.tenant
	if x.ke != nil {
		p.Kind = x.ke.name
	}
	p.RequestID = x.reqID
	if p.RequestID == "" {
		if id, _ := h1.Get(x.fields, tmhttp.HeaderRequestID); validRequestID(id) {
			p.RequestID = string(id)
		}
	}
	if p.Status == statusClientClosed {
		x.out.problem(p.Status, nil, 0)
		return
	}
	if x.grpc {
		if p.Status >= 500 && p.Status != http.StatusServiceUnavailable {
			g.log.Warn("proxy error", "status", p.Status, "kind", p.Kind, "err", err)
		}
		g.metrics.grpcCall(cmp.Or(p.Kind, "-"), tmhttp.GRPCCode(p))
		x.rfields = grpcStatusFields(x.rfields[:0], p, true)
		_ = x.out.writeHead(http.StatusOK, x.rfields, 0, true)
		return
	}
	if p.Status >= 500 && p.Status != http.StatusServiceUnavailable {
		g.log.Warn("proxy error", "status", p.Status, "kind", p.Kind, "err", err)
	}
	body, _ := json.Marshal(p)
	var extra []h1.Field
	var tr *tokenRefusal
	if errors.As(err, &tr) {
		extra = append(extra, h1.Field{Name: []byte("WWW-Authenticate"), Value: []byte(tr.challenge)})
	}
	x.out.problem(p.Status, append(body, '\n'), p.RetryAfter, extra...)
}

// answer is the last stage: the instance's response goes to the client with its hop-by-hop
// fields removed and x-served-by and x-request-id set; the body is relayed as it arrives
// (flushed whenever the instance has sent nothing more yet), chunked bodies with their trailers.
// An upgrade (101) joins the two connections. An error is answered by answerError.
func (g *Gateway) answer(x *exchange, up *upConn, err error) {
	if err != nil {
		g.answerError(x, err)
		return
	}
	if x.ticket != nil { // the next held request may go: this one has its answer
		g.holds.done(x.ke, x.ticket)
		x.ticket = nil
	}
	if up.resp.Status == http.StatusSwitchingProtocols {
		g.switchProtocols(x, up)
		return
	}
	noBody := x.method == "HEAD" || up.resp.Status < 200 || up.resp.Status == 204 || up.resp.Status == 304
	fields := responseFields(x, up, !noBody)
	n := up.left
	if n == h1.BodyUntilClose {
		n = h1.BodyChunked
	}
	if err := x.out.writeHead(up.resp.Status, fields, n, noBody); err != nil {
		up.release(false)
		return
	}
	if noBody || up.left == 0 {
		up.release(true)
		_ = x.out.finish(nil)
		return
	}
	if err := relay(x.out, up); err != nil {
		up.release(false)
		if !errors.Is(err, errClientWrite) {
			g.log.Debug("relaying the response failed", "kind", x.ke.name, "err", err)
		}
		x.out.abort()
		return
	}
	_ = x.out.finish(up.trailer())
	up.release(true)
}

var errClientWrite = errors.New("writing to the client failed")

// relay copies the body from the instance to the client as it comes: length-delimited bodies
// straight from the connection's buffer, others through a pooled buffer.
func relay(out responder, up *upConn) error {
	if up.left > 0 {
		for up.left > 0 {
			if up.r.Buffered() == 0 {
				if err := out.flush(); err != nil {
					return errClientWrite
				}
			}
			p, err := up.next(32 << 10)
			if len(p) > 0 {
				if werr := out.write(p); werr != nil {
					return errClientWrite
				}
			}
			if err != nil && up.left > 0 {
				return err
			}
		}
		return nil
	}
	bp := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(bp)
	for {
		if up.r.Buffered() == 0 {
			if err := out.flush(); err != nil {
				return errClientWrite
			}
		}
		n, err := up.Read(*bp)
		if n > 0 {
			if werr := out.write((*bp)[:n]); werr != nil {
				return errClientWrite
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// responseFields are the instance's response fields as the client gets them: hop-by-hop ones
// (and those Connection names) removed, x-served-by and x-request-id set, the affinity policy's
// x-tm-target and x-tm-tenant (and the prerender manager's names for them). framed: the front end frames the body, so the instance's
// Content-Length goes (a chunked body's Trailer declaration stays).
func responseFields(x *exchange, up *upConn, framed bool) []h1.Field {
	out := x.rfields[:0]
	conn := false
	for _, f := range up.resp.Fields {
		conn = conn || h1.EqualFold(f.Name, "Connection")
	}
	for _, f := range up.resp.Fields {
		n := f.Name
		switch {
		case h1.EqualFold(n, "Trailer"):
			if !up.resp.Chunked || !framed {
				continue
			}
		case hopByHop(n),
			framed && h1.EqualFold(n, "Content-Length"),
			h1.EqualFold(n, tmhttp.HeaderServedBy),
			x.reqID != "" && h1.EqualFold(n, tmhttp.HeaderRequestID),
			x.affinityAnswer && isAffinityHeader(n),
			conn && namedInConnection(up.resp.Fields, n):
			continue
		}
		out = append(out, f)
	}
	out = append(out, h1.Field{Name: hdrServedBy, Value: str2b(x.inst.key)})
	if x.reqID != "" {
		out = append(out, h1.Field{Name: hdrRequestID, Value: str2b(x.reqID)})
	}
	if x.affinityAnswer {
		out = append(out, h1.Field{Name: hdrTarget, Value: str2b(x.inst.key)}, h1.Field{Name: hdrTargetTenant, Value: str2b(x.tenant)},
			h1.Field{Name: hdrSeedTarget, Value: str2b(x.inst.key)}, h1.Field{Name: hdrSeedRealm, Value: str2b(x.tenant)})
	}
	x.rfields = out
	return out
}

var (
	hdrServedBy     = []byte(tmhttp.HeaderServedBy)
	hdrRequestID    = []byte(tmhttp.HeaderRequestID)
	hdrTarget       = []byte(HeaderTarget)
	hdrTargetTenant = []byte(HeaderTargetTenant)
	hdrSeedTarget   = []byte(HeaderSeedTarget)
	hdrSeedRealm    = []byte(HeaderSeedRealm)
)

// isAffinityHeader reports whether n is one of the affinity answer's headers (any spelling).
func isAffinityHeader(n []byte) bool {
	return h1.EqualFold(n, HeaderTarget) || h1.EqualFold(n, HeaderTargetTenant) || h1.EqualFold(n, HeaderSeedTarget) || h1.EqualFold(n, HeaderSeedRealm)
}

// str2b is a read-only byte view of s.
func str2b(s string) []byte { return unsafe.Slice(unsafe.StringData(s), len(s)) }

// switchProtocols answers a 101 and joins the client's connection and the instance's until
// either side closes (WebSocket and other upgrades).
func (g *Gateway) switchProtocols(x *exchange, up *upConn) {
	client, err := x.out.hijack()
	if err != nil {
		up.release(false)
		x.code = http.StatusBadGateway
		return
	}
	x.code = http.StatusSwitchingProtocols
	if up.stop != nil {
		up.stop()
		up.stop = nil
	}
	_ = up.c.SetDeadline(time.Time{})
	var head []byte
	head = append(head, "HTTP/1.1 101 Switching Protocols\r\n"...)
	for _, f := range up.resp.Fields {
		head = append(append(append(append(head, f.Name...), ": "...), f.Value...), "\r\n"...)
	}
	head = append(head, "\r\n"...)
	if _, err := client.Write(head); err != nil {
		client.Close()
		up.close()
		return
	}
	t := &tunnel{idle: g.cfg.TunnelIdleTimeout, slow: g.metrics.slow}
	t.last.Store(time.Now().UnixNano())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = t.pipe(up.c, client, readDeadlineOf(client))
		if cw, ok := up.c.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		}
	}()
	_ = t.pipe(client, up.r, up.c.SetReadDeadline)
	client.Close()
	up.close()
	<-done
}

// jsonLine is v as JSON with a newline, as json.Encoder writes it.
func jsonLine(v any) ([]byte, error) {
	b, err := json.Marshal(v)
	return append(b, '\n'), err
}
