package gateway

import (
	"context"
	"time"
)

// serve is the request path of one tenant request, top to bottom. Each stage is a method in its
// own file that fills x for the next or returns the error the answer stage maps to problem+json.
// The send stage repeats three steps per attempt; pick and judge are the kind's policy's
// (policy.go, the interface; each policy's file has both):
//
//	admit    (admit.go)   tenant id, edge identity, route and policy, rate limit
//	place    (place.go)   the tenant's placement; the kind's rule for unplaced tenants
//	hold     (hold.go)    the body buffered for replay; the handoff buffer while the tenant moves
//	send     (send.go)    attempts until one is delivered or the policy gives up, each one:
//	 pick    (policy.go)  the instance: managed.go, loadpolicy.go or affinity.go
//	 attempt (send.go)    sent once by the upstream engine (engine.go): connection reuse, the
//	                      instance's breaker and latency
//	 judge   (policy.go)  deliver, again (retries when safe, 421 refresh) or fail: managed.go
//	                      (also the load policy's) or affinity.go
//	answer   (answer.go)  the instance's response relayed, or the one problem+json mapping
//
// Both front ends (front.go: the gateway's own HTTP/1.1 server; stdfront.go: net/http's, for
// TLS, HTTP/2, upgrades and admin connections) fill an exchange and call serve.
func (g *Gateway) serve(x *exchange) {
	x.start = time.Now()
	traceStart(x)
	defer g.done(x)
	end := traceStage(x, "gateway.admit")
	err := g.admit(x)
	if end(err); err != nil {
		g.answerError(x, err)
		return
	}
	end = traceStage(x, "gateway.place")
	err = g.place(x)
	if end(err); err != nil {
		g.answerError(x, err)
		return
	}
	if x.grpc { // over HTTP/2, with gRPC's deadline and answers (grpc.go)
		g.serveGRPC(x)
		return
	}
	if x.cancelable { // net/http's front end: the client's going away cancels the request
		x.ctx, x.cancel = context.WithTimeout(x.ctx, x.policy.timeout(x.ke.config()))
	} else {
		x.rctx = reqContext{parent: g.reqCtx, deadline: x.start.Add(x.policy.timeout(x.ke.config()))}
		x.ctx = &x.rctx
	}
	end = traceStage(x, "gateway.hold")
	err = g.hold(x)
	if end(err); err != nil {
		g.answerError(x, err)
		return
	}
	up, err := g.send(x)
	g.answer(x, up, err)
}

// done records the request's metrics and ends what is left of it.
func (g *Gateway) done(x *exchange) {
	if x.ticket != nil {
		g.holds.done(x.ke, x.ticket)
		x.ticket = nil
	}
	if x.cancel != nil {
		x.cancel()
	}
	x.rctx.end()
	if x.aff.cancel != nil {
		x.aff.cancel()
	}
	traceEnd(x)
	if x.ke != nil {
		x.ke.metrics.code(x.code)
		x.ke.metrics.duration.Observe(time.Since(x.start).Seconds())
	} else {
		g.metrics.code(x.code)
	}
}
