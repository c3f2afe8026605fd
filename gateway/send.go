package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/tenantmesh/tenantmesh/gateway/h1"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// send is the send stage: attempts until the policy delivers one or gives up. Before each
// attempt the request waits in the hold buffer if its tenant is moving (hold.go), and the
// policy picks the instance (the pick stage); the attempt goes out through the engine, and its
// outcome feeds the instance's breaker and latency before the policy judges it.
func (g *Gateway) send(x *exchange) (*upConn, error) {
	for n := 0; ; n++ {
		if err := g.holdIfMoving(x); err != nil {
			return nil, err
		}
		in, err := x.policy.pick(&g.pe, x, n)
		if in == nil {
			return nil, err
		}
		end := traceAttempt(x, in, n)
		up, err := g.attempt(x, in)
		if up != nil {
			end(up.resp.Status, err)
		} else {
			end(0, err)
		}
		v, err := x.policy.judge(&g.pe, x, in, up, err, n)
		switch v {
		case deliver:
			x.inst, x.code = in, up.resp.Status
			return up, nil
		case fail:
			return nil, err
		}
	}
}

// attempt sends x to in once, keeping the instance's counters and breaker.
func (g *Gateway) attempt(x *exchange, in *instance) (*upConn, error) {
	ctx := x.ctx
	if x.aff.timeout > 0 {
		if x.aff.cancel != nil {
			x.aff.cancel()
		}
		ctx, x.aff.cancel = context.WithTimeout(realContext(ctx), x.aff.timeout)
	}
	x.inst = in
	in.inflight.Add(1)
	in.requests.Add(1)
	t0 := time.Now()
	up, err := g.engine.roundTrip(ctx, t0, x, in)
	in.inflight.Add(-1)
	if err != nil {
		var cbe *clientBodyError
		if errors.Is(x.ctx.Err(), context.Canceled) || errors.As(err, &cbe) {
			in.breaker.Abandon() // the client failed, not the instance: a slow body must not open circuits
		} else {
			in.failures.Add(1)
			in.breaker.Failure()
		}
		return nil, err
	}
	in.observe(time.Since(t0))
	in.breaker.Success()
	return up, nil
}

// judgeManaged is the managed and load policies' judgement: a transport failure is tried again
// on another instance of the shard when it is safe (retryable); a gate refusal (421, or
// x-tm-refused) is tried again on the owner after a placement refresh, or on another instance
// when the instance is stopping; anything else is the answer.
func judgeManaged(env *policyEnv, x *exchange, in *instance, up *upConn, err error, n int) (verdict, error) {
	if err != nil {
		if errors.Is(x.ctx.Err(), context.Canceled) {
			return fail, err
		}
		x.lastErr = &upstreamError{inst: in.key, err: err}
		reason, ok := retryable(x, err)
		if !ok || n >= env.retries {
			return fail, x.lastErr
		}
		x.ke.metrics.retry(reason)
		if errors.Is(err, errAbandoned) {
			// The tenant's shard is being taken over: the next attempt waits in the hold for
			// the new owner, as a request arriving now would.
			if e, ok := x.ke.lookup(x.tenant); ok {
				x.entry = e
			}
			x.tried = x.tried[:0]
			return again, nil
		}
		x.tried = append(x.tried, in)
		return again, nil
	}
	refused, _ := h1.Get(up.resp.Fields, tmhttp.HeaderRefused)
	if refused == nil && up.resp.Status != http.StatusMisdirectedRequest {
		return deliver, nil
	}
	// The shard's gate refused before its service saw the request (421, or 503 in a handoff,
	// while stopping, or behind on placement): sending it again is safe.
	status := up.resp.Status
	prob := readProblem(up)
	if !x.replayable || n >= env.retries {
		if status == http.StatusMisdirectedRequest {
			return fail, errMisdirected(x)
		}
		return fail, &tmhttp.Error{Status: status, Type: strings.TrimPrefix(prob.Type, tmhttp.TypeBase), Title: prob.Title,
			Detail: prob.Detail, RetryAfter: time.Duration(max(prob.RetryAfter, 1)) * time.Second}
	}
	switch string(refused) {
	case "closing":
		x.ke.metrics.retry("instance_stopping")
		x.tried = append(x.tried, in) // another instance of the same shard
		return again, nil
	case "unconfirmed":
		// The instance's lease ran out (it cannot confirm its view of placement with NATS):
		// another instance of the shard may still hold one.
		x.ke.metrics.retry("instance_unconfirmed")
		x.tried = append(x.tried, in)
		return again, nil
	}
	x.ke.metrics.retry("misdirected")
	if err := env.refresh(x, prob); err != nil {
		return fail, err
	}
	x.tried = x.tried[:0]
	return again, nil
}

// retryable says whether a failed attempt may be sent again to another instance, and why.
// A refused connection provably never reached the application, so any method may go again (if
// its body is buffered); other failures only for GET, HEAD and OPTIONS, for any request to a
// kind that only reads (KindConfig.Overlap: the projection's POST queries), or for a request
// with an Idempotency-Key to a kind whose services honour it (KindConfig.Idempotent: applied
// once however often it is sent); a timeout never, unless it was the connect's: a connection
// that was never made (refused, or its SYN unanswered, as across a partition) carried nothing.
func retryable(x *exchange, err error) (string, bool) {
	if !x.replayable || x.ctx.Err() != nil {
		return "", false
	}
	if isDialError(err) || errors.Is(err, errStreamRefused) {
		return "unreachable", true
	}
	if isTimeout(err) {
		return "", false
	}
	switch x.method {
	case http.MethodGet, http.MethodHead, http.MethodOptions:
		return "failed", true
	}
	c := x.ke.config()
	if c != nil && c.Overlap {
		return "read", true
	}
	if c != nil && c.Idempotent {
		if key, n := h1.Get(x.fields, "Idempotency-Key"); n == 1 && len(key) > 0 {
			return "idempotent", true
		}
	}
	return "", false
}

// refresh finds the tenant's owner after a 421 or another gate refusal: the watcher's newer
// placement (a handoff there makes the next attempt wait in the hold buffer), else the owner the
// shard named if its epoch is newer, else it waits (bounded) for the watcher to catch up.
func (g *Gateway) refresh(x *exchange, prob tmhttp.Problem) error {
	old := x.entry
	newer := func() bool {
		e, ok := x.ke.lookup(x.tenant)
		if ok && (e.Epoch > old.Epoch || e.Shard != old.Shard || e.Phase != old.Phase) {
			x.entry = e
			return true
		}
		return false
	}
	if newer() {
		return nil
	}
	if prob.Owner != "" && prob.Epoch > old.Epoch && schema.CheckName("shard", prob.Owner) == nil {
		x.entry = placement.Entry{Shard: prob.Owner, Epoch: prob.Epoch, Phase: schema.PhaseActive}
		return nil
	}
	g.waiters.Add(1)
	defer g.waiters.Add(-1)
	timer := time.NewTimer(g.cfg.RefreshWait)
	defer timer.Stop()
	for {
		ch := *g.changed.Load()
		if newer() {
			return nil
		}
		select {
		case <-ch:
		case <-timer.C:
			return errMisdirected(x)
		case <-x.ctx.Done():
			return x.ctx.Err()
		}
	}
}

// readProblem reads a refusal's problem body (bounded) and ends the exchange.
func readProblem(up *upConn) tmhttp.Problem {
	var p tmhttp.Problem
	b, err := io.ReadAll(io.LimitReader(up, 16<<10))
	up.release(err == nil)
	_ = json.Unmarshal(b, &p)
	return p
}

// discard reads and drops a response's body (bounded) and ends the exchange.
func discard(up *upConn) {
	_, err := io.Copy(io.Discard, io.LimitReader(up, 64<<10))
	up.release(err == nil)
}
