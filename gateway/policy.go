package gateway

import (
	"log/slog"
	"sync/atomic"
	"time"

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
	refresh     func(x *exchange, prob tmhttp.Problem) error // the tenant's owner after a gate refusal (send.go)
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
		return loadPolicy{ke: ke}
	}
	return managedPolicy{}
}
