package gateway

import (
	"context"
	"errors"
	"net"
	"net/http"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
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
func errMisdirected(st *reqState) error {
	return &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "owner-unknown", Title: "Tenant owner unknown",
		Detail:     "shard " + st.entry.Shard + " is not the tenant's owner and the gateway has not learned the new owner yet; retry shortly",
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

// proxyError is ReverseProxy's ErrorHandler.
func (g *Gateway) proxyError(w http.ResponseWriter, r *http.Request, err error) {
	st := stateOf(r.Context())
	p := problemFor(err)
	if st != nil {
		st.code = p.Status
		p.Tenant, p.Kind = st.tenant, st.ke.name
		if st.reqID != "" {
			p.RequestID = st.reqID
		}
	}
	if p.Status == statusClientClosed {
		w.WriteHeader(p.Status)
		return
	}
	if p.Status >= 500 && p.Status != http.StatusServiceUnavailable {
		g.log.Warn("proxy error", "status", p.Status, "kind", p.Kind, "err", err)
	}
	tmhttp.WriteProblem(w, r, p)
}
