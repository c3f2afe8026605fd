// Package load is the decision logic of the gateway's load policy (the Queen coordinator, the Queen
// coordinator): a soft affinity cache per tenant with a TTL, load scores smoothed by an EMA
// from the instances' telemetry, and the source design's decision table for an existing affinity:
//
//	target load < migrate (0.70)          respect the affinity
//	migrate <= load < break (0.90)        migrate to the least-loaded instance with probability
//	                                      equal to the gain, when the gain is over 0.15
//	load >= break                         break the affinity: go to the least-loaded instance
//
// A new affinity goes to the least-loaded instance, but only when it is better than the
// "local" choice (the gateway's ordinary power-of-two pick) by more than the forward threshold
// (0.10); ties favour the local choice. The clock and the random source are injectable, so the
// table is tested exactly.
package load

import (
	"cmp"
	"math"
	"slices"
	"sync"
	"time"
)

// Config holds the policy's numbers; zero fields take the Queen coordinator's defaults.
type Config struct {
	TTL              time.Duration // affinity cache entry lifetime without use; default 5m
	MigrateThreshold float64       // default 0.70
	BreakThreshold   float64       // default 0.90
	MigrateMinGain   float64       // default 0.15
	ForwardThreshold float64       // default 0.10
	EMAAlpha         float64       // default 0.3
}

func (c Config) withDefaults() Config {
	def := func(v *float64, d float64) {
		if *v <= 0 {
			*v = d
		}
	}
	if c.TTL <= 0 {
		c.TTL = 5 * time.Minute
	}
	def(&c.MigrateThreshold, 0.70)
	def(&c.BreakThreshold, 0.90)
	def(&c.MigrateMinGain, 0.15)
	def(&c.ForwardThreshold, 0.10)
	def(&c.EMAAlpha, 0.3)
	return c
}

// Decision says why Choose chose what it did.
type Decision string

const (
	None    Decision = "none"    // no candidate
	Local   Decision = "local"   // new affinity on the local choice
	Forward Decision = "forward" // new affinity on a peer more than the forward threshold better
	Respect Decision = "respect" // existing affinity kept
	Migrate Decision = "migrate" // existing affinity moved (probabilistic, 70-90%)
	Break   Decision = "break"   // existing affinity broken (>= 90%)
)

// Score is the Queen coordinator's load score: 0.4*(outstanding/100) + 0.3*(queued/200) + 0.3*(cpu/100).
func Score(outstanding, queued int, cpu float64) float64 {
	return 0.4*float64(outstanding)/100 + 0.3*float64(queued)/200 + 0.3*cpu/100
}

// eps absorbs floating-point noise at the thresholds (0.75 - 0.60 is not exactly 0.15).
const eps = 1e-9

type entry struct {
	server   string
	assigned time.Time
	used     time.Time
}

// Tracker is one kind's scores and affinity cache. Safe for concurrent use.
type Tracker struct {
	cfg  Config
	now  func() time.Time
	rand func() float64

	mu     sync.Mutex
	scores map[string]float64 // instance key -> EMA of the load score
	cache  map[string]*entry  // tenant -> affinity
}

// New makes a Tracker. now defaults to time.Now; rnd (uniform in [0,1)) must be set.
func New(cfg Config, now func() time.Time, rnd func() float64) *Tracker {
	if now == nil {
		now = time.Now
	}
	return &Tracker{cfg: cfg.withDefaults(), now: now, rand: rnd, scores: map[string]float64{}, cache: map[string]*entry{}}
}

// SetConfig replaces the numbers (kind config changed).
func (t *Tracker) SetConfig(cfg Config) {
	t.mu.Lock()
	t.cfg = cfg.withDefaults()
	t.mu.Unlock()
}

// Observe feeds one telemetry report of an instance; the score is EMA-smoothed.
func (t *Tracker) Observe(key string, outstanding, queued int, cpu float64) {
	s := Score(outstanding, queued, cpu)
	t.mu.Lock()
	defer t.mu.Unlock()
	if old, ok := t.scores[key]; ok {
		s = t.cfg.EMAAlpha*s + (1-t.cfg.EMAAlpha)*old
	}
	t.scores[key] = s
}

// Load is an instance's smoothed score (0 if it never reported).
func (t *Tracker) Load(key string) float64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.scores[key]
}

// Forget drops an instance that died: its score and every affinity to it.
func (t *Tracker) Forget(key string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.scores, key)
	for k, e := range t.cache {
		if e.server == key {
			delete(t.cache, k)
		}
	}
}

// Affinity returns tenant's current affinity target, if any and not expired.
func (t *Tracker) Affinity(tenant string) (string, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.cache[tenant]
	if e == nil || t.now().Sub(e.used) > t.cfg.TTL {
		return "", false
	}
	return e.server, true
}

// Sweep drops expired affinities and returns how many are left.
func (t *Tracker) Sweep() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := t.now()
	for k, e := range t.cache {
		if now.Sub(e.used) > t.cfg.TTL {
			delete(t.cache, k)
		}
	}
	return len(t.cache)
}

// Choose picks the instance for tenant among cands (live, circuit available); local is the
// gateway's own choice among them ("" for none), preferred on ties.
func (t *Tracker) Choose(tenant string, cands []string, local string) (string, Decision) {
	if len(cands) == 0 {
		return "", None
	}
	if !slices.Contains(cands, local) {
		local = ""
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	now := t.now()
	e := t.cache[tenant]
	if e != nil && (now.Sub(e.used) > t.cfg.TTL || !slices.Contains(cands, e.server)) {
		delete(t.cache, tenant) // expired, or its instance is gone
		e = nil
	}
	if e == nil {
		best := t.leastLoaded(cands, local)
		d := Forward
		if local != "" && t.scores[local]-t.scores[best] <= t.cfg.ForwardThreshold+eps {
			best, d = local, Local
		} else if best == local {
			d = Local
		}
		t.cache[tenant] = &entry{server: best, assigned: now, used: now}
		return best, d
	}
	e.used = now
	load := t.scores[e.server]
	switch {
	case load < t.cfg.MigrateThreshold-eps:
		return e.server, Respect
	case load >= t.cfg.BreakThreshold-eps:
		best := t.leastLoaded(cands, e.server)
		if best == e.server {
			return e.server, Respect
		}
		e.server, e.assigned = best, now
		return best, Break
	}
	best := t.leastLoaded(cands, e.server)
	gain := load - t.scores[best]
	if gain > t.cfg.MigrateMinGain+eps && t.rand() < gain {
		e.server, e.assigned = best, now
		return best, Migrate
	}
	return e.server, Respect
}

// leastLoaded returns the candidate with the lowest score; prefer wins ties, then key order.
func (t *Tracker) leastLoaded(cands []string, prefer string) string {
	best, bs := "", math.Inf(1)
	for _, c := range cands {
		s := t.scores[c]
		if s < bs || (s == bs && (c == prefer || (best != prefer && cmp.Less(c, best)))) {
			best, bs = c, s
		}
	}
	return best
}

// ServerBalance is one instance in the balance report.
type ServerBalance struct {
	Key       string  `json:"server_id"`
	LoadScore float64 `json:"load_score"`
}

// Balance reports the smoothed scores of keys and the imbalance: max - min of the scores. The
// set is balanced when that is at most the minimum migration gain (no affinity would move).
func (t *Tracker) Balance(keys []string) (servers []ServerBalance, imbalance float64, balanced bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, k := range keys {
		s := t.scores[k]
		servers = append(servers, ServerBalance{Key: k, LoadScore: s})
		lo, hi = math.Min(lo, s), math.Max(hi, s)
	}
	if len(keys) > 0 {
		imbalance = hi - lo
	}
	return servers, imbalance, imbalance <= t.cfg.MigrateMinGain+eps
}
