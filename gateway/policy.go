package gateway

import (
	"log/slog"
	"math/rand/v2"
	"net/http"
	"slices"
	"sync/atomic"
	"time"

	"github.com/tenantmesh/tenantmesh/gateway/policy/load"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// policy is a kind's way of choosing instances: the pick stage asks it for the instance of
// each attempt, and the send stage asks it what an attempt's outcome means. Each kind's policy
// is made once from its config (policyFor); the request path never asks which one it has. Its
// methods get the request and a policyEnv, never the gateway.
type policy interface {
	// placesTenants: the policy places unplaced tenants itself; the place stage leaves them.
	placesTenants() bool
	// holds: requests wait in the hold buffer while their tenant is in handoff.
	holds() bool
	// timeout bounds one request of a kind with this config.
	timeout(cfg *schema.KindConfig) time.Duration
	// pick chooses the instance for attempt n (0 first); nil with the error to answer when no
	// instance is left.
	pick(env *policyEnv, x *exchange, n int) (*instance, error)
	// judge decides what an attempt's outcome means: deliver it, try again, or fail with the
	// error returned.
	judge(env *policyEnv, x *exchange, in *instance, up *upConn, err error, n int) (verdict, error)
}

// policyEnv is what a policy gets from the gateway besides the request: the newest snapshot
// (routes, kinds and their live instances), the retry budget, the placement refresh after a
// gate refusal, the affinity owners' writes and the log. The gateway makes one in New; a test
// can make its own, with no gateway.
type policyEnv struct {
	snap        *atomic.Pointer[snapshot]                    // the registry's newest snapshot
	retries     int                                          // Config.Retries: attempts after the first
	refreshWait time.Duration                                // Config.RefreshWait: the bound on waiting for a newer placement
	refresh     func(x *exchange, prob tmhttp.Problem) error // the tenant's owner after a gate refusal
	owners      affinityOwners                               // the affinity policy's owner writes
	log         *slog.Logger
}

// verdict is a policy's judgement of one attempt.
type verdict int

const (
	deliver verdict = iota // answer the client with this response
	again                  // pick again and send another attempt
	fail                   // answer with the error
)

// policyFor makes the policy a kind's config names: the one place that maps the name to an
// implementation.
func policyFor(ke *kindEntry, cfg *schema.KindConfig) policy {
	switch cfg.Policy {
	case schema.PolicyAffinity:
		return affinityPolicy{}
	case schema.PolicyLoad:
		return managedPolicy{choose: ke.chooseByLoad}
	}
	return managedPolicy{choose: choosePowerOfTwo}
}

// managedPolicy is the managed path: the tenant's shard from its placement, an instance of it
// chosen by choose (power of two choices, or the load policy's decision table), the tenant's
// writer for single-writer kinds; retries as the send stage allows them.
type managedPolicy struct {
	choose func(x *exchange, insts, tried []*instance) *instance
}

func (managedPolicy) placesTenants() bool { return false }
func (managedPolicy) holds() bool         { return true }

func (managedPolicy) timeout(cfg *schema.KindConfig) time.Duration { return cfg.UpstreamTimeout.D() }

func (p managedPolicy) pick(env *policyEnv, x *exchange, n int) (*instance, error) {
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
		in = p.choose(x, insts, x.tried)
	}
	if in != nil {
		return in, nil
	}
	if x.lastErr != nil {
		// The attempt that failed was safe to send again (judgeManaged set lastErr only then),
		// and no other instance of the shard is left to send it to: the shard may be dead, and
		// the client may send it again once it is taken over.
		return nil, &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "no-live-instance", Title: "No live instance",
			Detail:     "no other live instance of shard " + x.entry.Shard + " after " + x.lastErr.Error() + "; the request is safe to send again: retry after Retry-After",
			RetryAfter: time.Second}
	}
	return nil, &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "no-live-instance", Title: "No live instance",
		Detail: "shard " + x.entry.Shard + " has no live instance serving this route (or all its circuits are open)", RetryAfter: time.Second}
}

func (managedPolicy) judge(env *policyEnv, x *exchange, in *instance, up *upConn, err error, n int) (verdict, error) {
	return judgeManaged(env, x, in, up, err, n)
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

// loadConfig maps a kind's LoadConfig to the load policy's numbers.
func loadConfig(c *schema.LoadConfig) load.Config {
	return load.Config{TTL: c.AffinityTTL.D(), MigrateThreshold: c.MigrateThreshold, BreakThreshold: c.BreakThreshold,
		MigrateMinGain: c.MigrateMinGain, ForwardThreshold: c.ForwardThreshold, EMAAlpha: c.EMAAlpha}
}
