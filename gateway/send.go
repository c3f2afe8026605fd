package gateway

import (
	"context"
	"errors"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// send is the send stage: attempts until the policy delivers one or gives up. Before each
// attempt the request waits in the hold buffer if its tenant is moving (hold.go); then the
// policy picks the instance, the attempt goes out through the engine (its outcome feeding the
// instance's breaker and latency), and the policy judges the outcome.
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
