package gateway

import (
	"math/rand/v2"
	"slices"

	"github.com/tenantmesh/tenantmesh/gateway/breaker"
	"github.com/tenantmesh/tenantmesh/gateway/policy/load"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// loadPolicy is the load policy (the Queen coordinator's): the managed path, whose placement,
// holds, timeout and judgement it keeps, with its own choice of the instance of the tenant's
// shard: a soft affinity cache with a TTL and the Queen coordinator's decision table on
// smoothed load scores (the kind's load tracker), with the power-of-two pick as the "local"
// choice; a producer route's request then goes where consumers wait for its key (producer.go).
type loadPolicy struct {
	managedPolicy
	ke *kindEntry // the kind: its load tracker and metrics
}

func (p loadPolicy) pick(env *policyEnv, x *exchange, n int) (*instance, error) {
	return pickInShard(env, x, n, p.choose)
}

// choose is the load policy's choice among insts, the instances of the tenant's shard.
func (p loadPolicy) choose(x *exchange, insts, tried []*instance) *instance {
	in := p.chooseByScore(x, insts, tried)
	if x.rt.producer != nil {
		return p.ke.producerTarget(x, insts, tried, in)
	}
	return in
}

// chooseByScore is choose's choice by the affinity cache and load scores; the cache is keyed
// by the tenant, or on a consumer route by the request's affinity key (consumer.go).
func (p loadPolicy) chooseByScore(x *exchange, insts, tried []*instance) *instance {
	ke := p.ke
	var candArr [16]string
	cands := candArr[:0]
	for _, in := range insts {
		if !slices.Contains(tried, in) && in.breaker.Available() {
			cands = append(cands, in.key)
		}
	}
	local := localPick(insts, tried)
	lk := ""
	if local != nil {
		lk = local.key
	}
	affKey := x.tenant
	switch {
	case x.rt.consumer != nil:
		affKey = x.rt.consumer.affinityKey(x, x.rt.prefix)
	case x.rt.producerKeyed:
		affKey = producerAffinityKey(x)
	}
	key, d := ke.lt.Choose(affKey, cands, lk)
	ke.metrics.m.loadDecisions.WithLabelValues(ke.name, string(d)).Inc()
	for _, in := range insts {
		if in.key == key {
			if in.breaker.Allow() {
				return in
			}
			return choosePowerOfTwo(x, insts, append(tried, in))
		}
	}
	return choosePowerOfTwo(x, insts, tried)
}

// localPick is pick's power-of-two choice without taking a half-open probe.
func localPick(insts []*instance, tried []*instance) *instance {
	var candArr [16]*instance
	cand := candArr[:0]
	for _, in := range insts {
		if !slices.Contains(tried, in) && in.breaker.Available() {
			cand = append(cand, in)
		}
	}
	switch len(cand) {
	case 0:
		return nil
	case 1:
		return cand[0]
	}
	i := rand.IntN(len(cand))
	j := rand.IntN(len(cand) - 1)
	if j >= i {
		j++
	}
	if cand[j].score() < cand[i].score() {
		return cand[j]
	}
	return cand[i]
}

// loadConfig maps a kind's LoadConfig to the load policy's numbers.
func loadConfig(c *schema.LoadConfig) load.Config {
	return load.Config{TTL: c.AffinityTTL.D(), MigrateThreshold: c.MigrateThreshold, BreakThreshold: c.BreakThreshold,
		MigrateMinGain: c.MigrateMinGain, ForwardThreshold: c.ForwardThreshold, EMAAlpha: c.EMAAlpha}
}

// breakerConfig is the breaker of an instance of a kind: the gateway's, or for load kinds the
// circuit numbers of the kind's LoadConfig (the Queen coordinator's; fixed when the instance first appears).
func breakerConfig(base breaker.Config, kc schema.KindConfig) breaker.Config {
	if kc.Policy != schema.PolicyLoad || kc.Load == nil {
		return base
	}
	base.Failures, base.Wait, base.MaxWait = kc.Load.CircuitFailures, kc.Load.CircuitRetry.D(), kc.Load.CircuitMaxRetry.D()
	return base
}

// ServerLoad is one instance in /admin/balance's view from the Queen coordinator.
type ServerLoad struct {
	ServerID  string           `json:"server_id"`
	Kind      string           `json:"kind"`
	URL       string           `json:"url"`
	LoadScore float64          `json:"load_score"`
	Healthy   bool             `json:"healthy"`
	Circuit   breaker.Snapshot `json:"circuit"`
}

// loadBalance fills the Queen coordinator's fields of /admin/balance: every live instance's smoothed load
// score, and per kind the spread (max - min) of the scores; the worst kind's is the imbalance
// score, balanced when no kind's spread exceeds its minimum migration gain.
func (g *Gateway) loadBalance(b *Balance) {
	snap := g.reg.snap.Load()
	b.Balanced = true
	b.Servers = []ServerLoad{}
	for name, ke := range snap.kinds {
		var keys []string
		for _, s := range snap.shards[name] {
			for _, in := range s.instances {
				keys = append(keys, in.key)
				sl := ServerLoad{ServerID: in.key, Kind: name, LoadScore: ke.lt.Load(in.key),
					Healthy: in.breaker.Available(), Circuit: in.breaker.Snapshot()}
				if u := in.url.Load(); u != nil {
					sl.URL = u.String()
				}
				b.Servers = append(b.Servers, sl)
			}
		}
		_, imb, ok := ke.lt.Balance(keys)
		b.ImbalanceScore = max(b.ImbalanceScore, imb)
		b.Balanced = b.Balanced && ok
	}
}

// forgetGone drops, from their kinds' load trackers, the instances that were live in the
// previous snapshot and are not now (they died, drained or left the directory): their scores
// and every affinity to them (the Queen coordinator: "server dies -> all its affinities
// invalidated"), so a tenant whose instance left is assigned afresh rather than kept on a stale
// entry, and an instance that comes back starts from its own new reports, not the old score.
func (r *registry) forgetGone(prev, live map[string]*instance) {
	for key, in := range prev {
		if _, ok := live[key]; ok {
			continue
		}
		if ke := r.kinds[in.id.Kind]; ke != nil {
			ke.lt.Forget(key)
		}
	}
}
