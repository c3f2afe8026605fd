package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/tenantmesh/tenantmesh/gateway/h1"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// managedPolicy is the managed path: the tenant's shard from its placement, an instance of it
// chosen by power of two choices on in-flight requests and latency, the tenant's writer for
// single-writer kinds; a refused or failed attempt sent again when it is safe (judge). The load
// policy (loadpolicy.go) is this path with its own choice.
type managedPolicy struct{}

func (managedPolicy) placesTenants() bool { return false }
func (managedPolicy) holds() bool         { return true }

func (managedPolicy) timeout(cfg *schema.KindConfig) time.Duration { return cfg.UpstreamTimeout.D() }

func (managedPolicy) pick(env *policyEnv, x *exchange, n int) (*instance, error) {
	return pickInShard(env, x, n, choosePowerOfTwo)
}

// pickInShard is the managed path's pick with choose as its choice among the instances of the
// tenant's shard serving the route: the tenant's writer instead for a single-writer kind; the
// 503 to answer when none is left.
func pickInShard(env *policyEnv, x *exchange, n int, choose func(x *exchange, insts, tried []*instance) *instance) (*instance, error) {
	if n > 0 || x.ticket != nil {
		// A retry, or a request held through a move: the routes may have changed meanwhile.
		if nr := env.snap.Load().match(x.method, x.path); nr != nil && nr.kind == x.rt.kind {
			x.rt = nr
		}
	}
	insts := x.rt.byShard[x.entry.Shard]
	var in *instance
	if c := x.ke.config(); c != nil && c.SingleWriter {
		in = pickWriter(insts, x.tried, x.tenant)
	} else {
		in = choose(x, insts, x.tried)
	}
	if in != nil {
		return in, nil
	}
	if x.lastErr != nil {
		// The attempt that failed was safe to send again (judge set lastErr only then),
		// and no other instance of the shard is left to send it to: the shard may be dead, and
		// the client may send it again once it is taken over.
		return nil, &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "no-live-instance", Title: "No live instance",
			Detail:     "no other live instance of shard " + x.entry.Shard + " after " + x.lastErr.Error() + "; the request is safe to send again: retry after Retry-After",
			RetryAfter: time.Second}
	}
	return nil, &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "no-live-instance", Title: "No live instance",
		Detail: "shard " + x.entry.Shard + " has no live instance serving this route (or all its circuits are open)", RetryAfter: time.Second}
}

// judge is the managed and load policies' judgement of an HTTP attempt: the answer is
// delivered unless it is a gate refusal (x-tm-refused, or 421), which judgeAttempt weighs with
// its problem body, as it does a failure.
func (managedPolicy) judge(env *policyEnv, x *exchange, in *instance, up *upConn, err error, n int) (verdict, error) {
	if err != nil {
		return judgeAttempt(env, x, in, err, nil, n)
	}
	refused, _ := h1.Get(up.resp.Fields, tmhttp.HeaderRefused)
	if refused == nil && up.resp.Status != http.StatusMisdirectedRequest {
		return deliver, nil
	}
	return judgeAttempt(env, x, in, nil, &refusal{reason: string(refused), status: up.resp.Status, prob: readProblem(up)}, n)
}

// refusal is a shard gate's refusal of an attempt as either protocol carries it: the
// x-tm-refused reason ("" for a bare 421), the answer's status, and its problem (the owner it
// names; what the client is told if the gateway gives up).
type refusal struct {
	reason string
	status int
	prob   tmhttp.Problem
}

// judgeAttempt is the managed judgement of one attempt's outcome, the one both send loops
// (HTTP's through managedPolicy.judge, gRPC's sendGRPC) use: err, the attempt's failure, is
// tried again on another instance of the shard when it is safe (retryable); a refusal (the
// gate refused before the service saw the request, so sending it again is safe) goes to the
// owner after a placement refresh, or to another instance when the instance is stopping or
// unconfirmed; with neither, the answer is delivered.
func judgeAttempt(env *policyEnv, x *exchange, in *instance, err error, ref *refusal, n int) (verdict, error) {
	if err != nil {
		return judgeFailure(env, x, in, err, n)
	}
	if ref == nil {
		return deliver, nil
	}
	if !x.replayable || n >= env.retries {
		if ref.misdirected() {
			return fail, errMisdirected(x)
		}
		p := ref.prob
		return fail, &tmhttp.Error{Status: ref.status, Type: strings.TrimPrefix(p.Type, tmhttp.TypeBase), Title: p.Title,
			Detail: p.Detail, RetryAfter: time.Duration(max(p.RetryAfter, 1)) * time.Second}
	}
	switch ref.reason {
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
	if err := env.refresh(x, ref.prob); err != nil {
		return fail, err
	}
	x.tried = x.tried[:0]
	return again, nil
}

// misdirected: the shard is not the tenant's owner (a 421, or over gRPC, where the gate's
// refusals are all UNAVAILABLE, its reason). Given up on, it is errMisdirected: the client never
// sees 421.
func (r *refusal) misdirected() bool {
	switch r.reason {
	case "not_owner", "unplaced", "stale_epoch":
		return true
	}
	return r.status == http.StatusMisdirectedRequest
}

// judgeFailure is judgeAttempt's judgement of a failed attempt: sent again when retryable,
// to another instance of the shard, or after a takeover to the new owner; a refused stream to
// the same instance too (it is not at fault: its connection was going away, or it was busy).
func judgeFailure(env *policyEnv, x *exchange, in *instance, err error, n int) (verdict, error) {
	if errors.Is(x.ctx.Err(), context.Canceled) {
		return fail, err
	}
	x.lastErr = &upstreamError{inst: in.key, err: err}
	reason, ok := retryable(x, err)
	if !ok || n >= env.retries {
		return fail, x.lastErr
	}
	x.ke.metrics.retry(reason)
	switch {
	case errors.Is(err, errAbandoned):
		// The tenant's shard is being taken over: the next attempt waits in the hold for
		// the new owner, as a request arriving now would.
		if e, ok := x.ke.lookup(x.tenant); ok {
			x.entry = e
		}
		x.tried = x.tried[:0]
	case errors.Is(err, errStreamRefused):
		// The instance may take the call again, on another connection.
	default:
		x.tried = append(x.tried, in)
	}
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

// choosePowerOfTwo chooses among live instances by power of two choices on in-flight requests
// and latency, skipping tried instances and open circuits.
func choosePowerOfTwo(_ *exchange, insts, tried []*instance) *instance {
	var candArr [16]*instance
	cand := candArr[:0]
	for _, in := range insts {
		if !slices.Contains(tried, in) && in.breaker.Available() {
			cand = append(cand, in)
		}
	}
	for len(cand) > 0 {
		var c *instance
		i := 0
		if len(cand) == 1 {
			c = cand[0]
		} else {
			i = rand.IntN(len(cand))
			j := rand.IntN(len(cand) - 1)
			if j >= i {
				j++
			}
			if cand[j].score() < cand[i].score() {
				i = j
			}
			c = cand[i]
		}
		if c.breaker.Allow() {
			return c
		}
		cand = append(cand[:i], cand[i+1:]...) // a probe is already out
	}
	return nil
}

// readProblem reads a refusal's problem body (bounded) and ends the exchange.
func readProblem(up *upConn) tmhttp.Problem {
	var p tmhttp.Problem
	b, err := io.ReadAll(io.LimitReader(up, 16<<10))
	up.release(err == nil)
	_ = json.Unmarshal(b, &p)
	return p
}
