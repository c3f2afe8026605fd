package gateway

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tenantmesh/tenantmesh/gateway/breaker"
	"github.com/tenantmesh/tenantmesh/gateway/policy/affinity"
	"github.com/tenantmesh/tenantmesh/gateway/policy/load"
	"github.com/tenantmesh/tenantmesh/shardkit/kvwatch"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// instance is one shard process as the gateway sees it. It lives as long as the gateway knows its
// key, across snapshots, so its counters and breaker survive route and directory changes.
type instance struct {
	key     string // <kind>.<shard>.<instance>, also sent as x-served-by
	id      schema.InstanceID
	url     atomic.Pointer[url.URL]
	rawURL  string    // what url was parsed from (the rebuilder's only)
	started time.Time // when its process registered (the rebuilder's only): a new one resets the breaker
	breaker *breaker.Breaker

	inflight atomic.Int64
	ewmaNS   atomic.Int64 // EWMA of response-header latency, ns
	requests atomic.Uint64
	failures atomic.Uint64
	load     atomic.Pointer[schema.LoadReport]
	capacity atomic.Int64 // registered capacity (0: the kind's default)
	external atomic.Bool  // registered through the gateway's HTTP API (no shardkit gate)
	// consumers are the waiting consumers its newest load report announced (producer routes).
	consumers atomic.Pointer[consumerSet]
}

// ewmaAlpha weighs a new latency sample (the Queen coordinator smooths with 0.3).
const ewmaAlpha = 0.3

func (in *instance) observe(d time.Duration) {
	for {
		old := in.ewmaNS.Load()
		nv := int64(d)
		if old != 0 {
			nv = int64(ewmaAlpha*float64(d) + (1-ewmaAlpha)*float64(old))
		}
		if in.ewmaNS.CompareAndSwap(old, nv) {
			return
		}
	}
}

// score is lower for a better choice: in-flight requests weighted by smoothed latency.
func (in *instance) score() float64 {
	lat := float64(in.ewmaNS.Load())
	if lat < float64(50*time.Microsecond) {
		lat = float64(50 * time.Microsecond)
	}
	return float64(in.inflight.Load()+1) * lat
}

// route is one entry of the route table with, per shard, the live instances that serve it.
type route struct {
	method, prefix, kind string
	byShard              map[string][]*instance
	producer             *producerSpec // nil: not a producer route
	consumer             *consumerSpec // nil: not a consumer route
	producerKeyed        bool          // a producer route of a kind with consumer routes (consumer.go)
}

// kindEntry is one kind's configuration and per-kind machinery. It lives as long as the gateway.
type kindEntry struct {
	name    string
	kindHdr []string // {name}, shared as the x-tm-kind header value
	cfg     atomic.Pointer[schema.KindConfig]
	w       atomic.Pointer[placement.Watcher] // nil until the kind's watcher is made
	limiter atomic.Pointer[tenantLimiter]     // nil: no rate limit
	metrics *kindMetrics
	aff     *affinity.Selector // the affinity policy's state (fed for every kind, used by affinity kinds)
	lt      *load.Tracker      // the load policy's scores and affinity cache
	pol     atomic.Pointer[policy]
}

func (k *kindEntry) config() *schema.KindConfig { return k.cfg.Load() }

// policy is the kind's policy, made from its config.
func (k *kindEntry) policy() policy { return *k.pol.Load() }

// lookup reads the placement of tenant; ok is false if unplaced or the kind is not followed yet.
func (k *kindEntry) lookup(tenant string) (placement.Entry, bool) {
	w := k.w.Load()
	if w == nil {
		return placement.Entry{}, false
	}
	return w.Lookup(k.name, tenant)
}

// placementsIn reports whether the kind's placement map has been read (its watcher synced):
// before, a tenant missing from it may well be placed.
func (k *kindEntry) placementsIn() bool {
	w := k.w.Load()
	if w == nil {
		return false
	}
	select {
	case <-w.Ready():
		return true
	default:
		return false
	}
}

// cutOff reports whether the kind's watcher cannot follow the placements now (cut off from
// NATS, or its consumer lost): a tenant missing from its view may be placed.
func (k *kindEntry) cutOff() bool {
	w := k.w.Load()
	return w == nil || w.Staleness() > 0
}

// shardInfo describes one shard of a kind for assignment and /admin/balance.
type shardInfo struct {
	name      string
	capacity  int
	instances []*instance // live
}

// snapshot is the immutable routing view; a new one replaces it whenever the registry, the
// directory or the kinds change, and once a second (heartbeat ages).
type snapshot struct {
	routes []*route // longest prefix first; an exact method before "*"
	kinds  map[string]*kindEntry
	shards map[string][]shardInfo // kind -> live shards, by name
	built  time.Time
	// live counts the instances with a live status; total those in the directory.
	live, total int
}

// match returns the route for method and path: the longest prefix whose method matches.
func (s *snapshot) match(method, path string) *route {
	for _, r := range s.routes {
		if (r.method == method || r.method == "*") && underPrefix(path, r.prefix) {
			return r
		}
	}
	return nil
}

// underPrefix reports whether path falls under a route's prefix on a segment boundary: /jobs
// takes /jobs and /jobs/7, not /jobsadmin (a prefix ending in / takes what follows it).
func underPrefix(path, prefix string) bool {
	return strings.HasPrefix(path, prefix) &&
		(len(path) == len(prefix) || prefix[len(prefix)-1] == '/' || path[len(prefix)] == '/')
}

// registry holds the raw state the followers deliver and builds snapshots from it.
type registry struct {
	g *Gateway

	mu       sync.Mutex
	routes   map[string]schema.Route
	dir      map[string]schema.Instance
	kindCfg  map[string]schema.KindConfig
	insts    map[string]*instance
	live     map[string]*instance // live at the last rebuild (forgetGone)
	kinds    map[string]*kindEntry
	followed map[string]*kvwatch.Follower // bucket -> follower, for staleness
	synced   map[string]bool

	conflicts map[[2]string]bool // routes two kinds publish, at the last rebuild

	snap  atomic.Pointer[snapshot]
	dirty chan struct{} // a change arrived since the last rebuild
}

func newRegistry(g *Gateway) *registry {
	r := &registry{
		g:        g,
		routes:   map[string]schema.Route{},
		dir:      map[string]schema.Instance{},
		kindCfg:  map[string]schema.KindConfig{},
		insts:    map[string]*instance{},
		kinds:    map[string]*kindEntry{},
		followed: map[string]*kvwatch.Follower{},
		synced:   map[string]bool{},
		dirty:    make(chan struct{}, 1),
	}
	r.snap.Store(&snapshot{kinds: map[string]*kindEntry{}, shards: map[string][]shardInfo{}})
	return r
}

// bucketHandler adapts one bucket's entries to the registry.
type bucketHandler struct {
	r      *registry
	bucket string
}

func (h bucketHandler) Apply(e kvwatch.Entry) { h.r.apply(h.bucket, e) }
func (h bucketHandler) Synced() {
	h.r.mu.Lock()
	h.r.synced[h.bucket] = true
	h.r.mu.Unlock()
	if h.r.allSynced() {
		h.r.rebuild()
		h.r.g.syncOnce.Do(func() { close(h.r.g.synced) })
	}
}

func (r *registry) allSynced() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.synced[schema.BucketRoutes] && r.synced[schema.BucketInstances] && r.synced[schema.BucketKinds]
}

func (r *registry) apply(bucket string, e kvwatch.Entry) {
	r.mu.Lock()
	var err error
	quiet := false // the change leaves the snapshot as it is
	switch bucket {
	case schema.BucketRoutes:
		if e.Op != kvwatch.Put {
			delete(r.routes, e.Key)
			break
		}
		var v schema.Route
		if err = json.Unmarshal(e.Value, &v); err == nil {
			err = v.Validate()
		}
		if kind, ok := schema.RouteKeyKind(e.Key); err == nil && ok && kind != v.Kind {
			// A route under one kind's key that names another: only that kind's shards may
			// write under its key, and they may not route to another kind.
			err = fmt.Errorf("the route under kind %s's key names kind %s", kind, v.Kind)
		}
		if err == nil {
			v.Revision = e.Revision
			r.routes[e.Key] = v
		} else {
			delete(r.routes, e.Key)
		}
	case schema.BucketInstances:
		if e.Op != kvwatch.Put {
			delete(r.dir, e.Key)
			break
		}
		var v schema.Instance
		if err = json.Unmarshal(e.Value, &v); err == nil {
			err = v.Validate()
		}
		if err == nil {
			v.Revision = e.Revision
			old, had := r.dir[e.Key]
			quiet = had && r.sameRouting(old, v)
			r.dir[e.Key] = v
		}
	case schema.BucketKinds:
		if e.Op != kvwatch.Put {
			delete(r.kindCfg, e.Key) // the kind entry stays; its routes go with it
			break
		}
		var v schema.KindConfig
		if err = json.Unmarshal(e.Value, &v); err == nil {
			v = v.WithDefaults()
			err = v.Validate()
		}
		if err == nil {
			r.kindCfg[e.Key] = v
		}
	}
	synced := r.synced[bucket]
	r.mu.Unlock()
	if err != nil {
		r.g.metrics.corrupt.WithLabelValues(bucket).Inc()
		r.g.log.Warn("skipping corrupt value", "bucket", bucket, "key", e.Key, "revision", e.Revision, "err", err)
		return
	}
	if synced && !quiet {
		select {
		case r.dirty <- struct{}{}:
		default: // a rebuild is already due
		}
	}
}

// sameRouting reports whether a directory entry's new value routes as the old one did: only its
// heartbeat time and metrics changed, and it is as live as it was. Such a heartbeat (nearly
// every directory write) rebuilds nothing; the ageing tick judges liveness again.
func (r *registry) sameRouting(old, cur schema.Instance) bool {
	if old.URL != cur.URL || old.Capacity != cur.Capacity || old.Reported != cur.Reported || old.InstanceID != cur.InstanceID ||
		!maps.Equal(old.Labels, cur.Labels) {
		return false
	}
	now := time.Now()
	th := r.g.cfg.Thresholds
	return th.Status(old, now).Live() == th.Status(cur, now).Live()
}

// rebuildEvery bounds how often changes rebuild the snapshot.
const rebuildEvery = 20 * time.Millisecond

// ageEvery is how often the snapshot is rebuilt without a change, so instances whose directory
// entries stopped being refreshed are judged again as they age. Routing asks only whether an
// instance is live (not offline after OfflineAfter, 2 min by default), so an eighth of that, at
// most 5 s, is timely; a rebuild is O(instances), 7 ms at 1,000 instances.
func ageEvery(th schema.Thresholds) time.Duration {
	off := th.OfflineAfter
	if off <= 0 {
		off = 2 * time.Minute
	}
	return min(5*time.Second, max(off/8, 10*time.Millisecond))
}

// rebuilder rebuilds the snapshot when changes arrived, at most once per rebuildEvery, and every
// ageEvery.
func (r *registry) rebuilder(ctx context.Context) {
	t := time.NewTimer(rebuildEvery)
	defer t.Stop()
	age := time.NewTicker(ageEvery(r.g.cfg.Thresholds))
	defer age.Stop()
	for {
		select {
		case <-r.dirty:
		case <-age.C:
		case <-ctx.Done():
			return
		}
		r.rebuild()
		t.Reset(rebuildEvery)
		select {
		case <-t.C:
		case <-ctx.Done():
			return
		}
	}
}

// liveAt is the time instance liveness is judged at: now, or, while the directory follower is
// cut off from NATS, the moment it was cut off. Heartbeats cannot arrive while NATS is away, so
// judging them against the wall clock would take every instance offline after two minutes of
// NATS outage: static stability says keep routing from the last known state.
func (r *registry) liveAt(now time.Time) time.Time {
	r.mu.Lock()
	f := r.followed[schema.BucketInstances]
	r.mu.Unlock()
	if f != nil {
		if ds := f.Stats().DownSince; !ds.IsZero() && ds.Before(now) {
			return ds
		}
	}
	return now
}

// rebuild makes and publishes a new snapshot from the raw state.
func (r *registry) rebuild() {
	now := time.Now()
	at := r.liveAt(now)
	g := r.g
	r.mu.Lock()
	defer r.mu.Unlock()
	s := &snapshot{kinds: make(map[string]*kindEntry, len(r.kindCfg)), shards: map[string][]shardInfo{}, built: now}

	for name, cfg := range r.kindCfg {
		ke := r.kinds[name]
		if ke == nil {
			ke = &kindEntry{name: name, kindHdr: []string{name}, metrics: g.metrics.forKind(name),
				aff: affinity.New(nil), lt: load.New(load.Config{}, nil, rand.Float64)}
			r.kinds[name] = ke
			g.startKind(ke)
		}
		c := cfg
		if old := ke.cfg.Load(); old == nil || !sameRate(old.RateLimit, c.RateLimit) {
			if c.RateLimit != nil {
				ke.limiter.Store(newTenantLimiter(c.RateLimit.PerSecond, c.RateLimit.Burst))
			} else {
				ke.limiter.Store(nil)
			}
		}
		if c.Load != nil {
			ke.lt.SetConfig(loadConfig(c.Load))
		}
		if old := ke.cfg.Load(); old == nil || old.Policy != c.Policy {
			p := policyFor(ke, &c)
			ke.pol.Store(&p)
		}
		ke.cfg.Store(&c)
		s.kinds[name] = ke
	}

	// Instances: keep one *instance per key; judge liveness.
	live := make(map[string]*instance, len(r.dir))
	for key, in := range r.dir {
		s.total++
		it := r.insts[key]
		if it == nil {
			it = &instance{key: key, id: in.InstanceID, breaker: breaker.New(breakerConfig(g.cfg.Breaker, r.kindCfg[in.Kind]))}
			r.insts[key] = it
		}
		if !it.started.IsZero() && (!it.started.Equal(in.Started) || it.rawURL != in.URL) {
			// Another process under the same key (restarted, or moved): what opened the
			// circuit was the old one's failures. It serves from now on.
			it.breaker.Reset()
			it.ewmaNS.Store(0)
		}
		it.started = in.Started
		if it.url.Load() == nil || it.rawURL != in.URL {
			if pu, err := url.Parse(in.URL); err == nil {
				it.url.Store(pu)
				it.rawURL = in.URL
			}
		}
		it.capacity.Store(int64(in.Capacity))
		it.external.Store(in.Labels[labelRegisteredBy] == registeredByGW)
		if g.cfg.Thresholds.Status(in, at).Live() && it.url.Load() != nil {
			live[key] = it
			s.live++
		}
	}
	for key := range r.insts {
		if _, ok := r.dir[key]; !ok {
			delete(r.insts, key)
		}
	}
	r.forgetGone(r.live, live)
	r.live = live

	// Shards per kind, from the live directory.
	byKind := map[string]map[string]*shardInfo{}
	for key, it := range live {
		in := r.dir[key]
		m := byKind[in.Kind]
		if m == nil {
			m = map[string]*shardInfo{}
			byKind[in.Kind] = m
		}
		si := m[in.Shard]
		if si == nil {
			si = &shardInfo{name: in.Shard}
			m[in.Shard] = si
		}
		c := in.Capacity
		if c <= 0 {
			if kc, ok := r.kindCfg[in.Kind]; ok {
				c = kc.Capacity
			}
		}
		si.capacity += c
		si.instances = append(si.instances, it)
	}
	for kind, m := range byKind {
		list := make([]shardInfo, 0, len(m))
		for _, si := range m {
			slices.SortFunc(si.instances, func(a, b *instance) int { return cmp.Compare(a.key, b.key) })
			list = append(list, *si)
		}
		slices.SortFunc(list, func(a, b shardInfo) int { return cmp.Compare(a.name, b.name) })
		s.shards[kind] = list
	}

	// Routes. The same method and prefix published by two kinds is a conflict: neither is
	// routed (a shard of one kind must not take another kind's traffic by publishing its
	// route), and it is logged and counted until one goes.
	claims := map[[2]string]string{}
	conflicts := map[[2]string]bool{}
	for _, rt := range r.routes {
		k := [2]string{rt.Method, rt.Prefix}
		if other, ok := claims[k]; ok && other != rt.Kind {
			conflicts[k] = true
		}
		claims[k] = rt.Kind
	}
	for k := range conflicts {
		r.g.metrics.routeConflicts.Inc()
		if !r.conflicts[k] { // said once, while it lasts
			r.g.log.Error("two kinds publish the same route; neither is routed until one goes", "method", k[0], "prefix", k[1])
		}
	}
	r.conflicts = conflicts
	for _, rt := range r.routes {
		if conflicts[[2]string{rt.Method, rt.Prefix}] {
			continue
		}
		nr := &route{method: rt.Method, prefix: rt.Prefix, kind: rt.Kind, byShard: map[string][]*instance{}, producer: newProducerSpec(rt.Producer),
			consumer: newConsumerSpec(rt.Consumer)}
		for _, key := range rt.Instances {
			it := live[key]
			if it == nil || it.id.Kind != rt.Kind {
				continue
			}
			nr.byShard[it.id.Shard] = append(nr.byShard[it.id.Shard], it)
		}
		for _, l := range nr.byShard {
			slices.SortFunc(l, func(a, b *instance) int { return cmp.Compare(a.key, b.key) })
		}
		s.routes = append(s.routes, nr)
	}
	keyProducers(s.routes)
	slices.SortFunc(s.routes, func(a, b *route) int {
		if c := cmp.Compare(len(b.prefix), len(a.prefix)); c != 0 {
			return c
		}
		if (a.method == "*") != (b.method == "*") {
			if a.method == "*" {
				return 1
			}
			return -1
		}
		return cmp.Compare(a.method+a.prefix, b.method+b.prefix)
	})
	r.snap.Store(s)
}

func sameRate(a, b *schema.RateLimit) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

// staleness is how long the oldest part of the routing state has been cut off from NATS.
func (r *registry) staleness(now time.Time) time.Duration {
	var worst time.Duration
	r.mu.Lock()
	for _, f := range r.followed {
		if ds := f.Stats().DownSince; !ds.IsZero() {
			worst = max(worst, now.Sub(ds))
		}
	}
	kinds := make([]*kindEntry, 0, len(r.kinds))
	for _, k := range r.kinds {
		kinds = append(kinds, k)
	}
	r.mu.Unlock()
	for _, k := range kinds {
		if w := k.w.Load(); w != nil {
			worst = max(worst, w.Staleness())
		}
	}
	return worst
}

// imbalance is max/mean - 1 of shard utilisations (0: perfectly even).
func imbalance(utils []float64) float64 {
	if len(utils) < 2 {
		return 0
	}
	var sum, hi float64
	for _, u := range utils {
		sum += u
		hi = math.Max(hi, u)
	}
	mean := sum / float64(len(utils))
	if mean == 0 {
		return 0
	}
	return hi/mean - 1
}

// instances lists every known instance, by key.
func (r *registry) instances() []*instance {
	r.mu.Lock()
	out := make([]*instance, 0, len(r.insts))
	for _, in := range r.insts {
		out = append(out, in)
	}
	r.mu.Unlock()
	slices.SortFunc(out, func(a, b *instance) int { return cmp.Compare(a.key, b.key) })
	return out
}
