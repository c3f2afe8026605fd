package rebalancer

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Telemetry keeps the newest load report of every instance, from the tm.load subjects. It is
// lossy by design (core NATS): a planner reads whatever arrived within MaxAge.
type Telemetry struct {
	mu     sync.Mutex
	latest map[string]schema.LoadReport // instance key -> newest report
	sub    *nats.Subscription
	added  chan struct{} // a token per report added, if set (tests)
	pruned time.Time
}

// forgetAfter is how long a silent instance's last report is kept.
const forgetAfter = 10 * time.Minute

// WatchTelemetry subscribes to the load reports of kind ("" for every kind) until Stop; also
// calls each heard function with every report (Presence.Heard), on the subscription's goroutine.
func WatchTelemetry(st *schema.Store, kind string, heard ...func(schema.LoadReport)) (*Telemetry, error) {
	t := &Telemetry{latest: map[string]schema.LoadReport{}}
	sub, err := st.SubscribeLoad(kind, func(r schema.LoadReport) {
		t.Add(r)
		for _, h := range heard {
			h(r)
		}
	})
	if err != nil {
		return nil, err
	}
	t.sub = sub
	return t, nil
}

// CollectTelemetry listens to kind's load reports for d (or until ctx ends) and returns them.
// Instances report about once a second, so a few seconds see every live instance.
func CollectTelemetry(ctx context.Context, st *schema.Store, kind string, d time.Duration) (*Telemetry, error) {
	t, err := WatchTelemetry(st, kind)
	if err != nil {
		return nil, err
	}
	if d > 0 {
		tm := time.NewTimer(d)
		select {
		case <-tm.C:
		case <-ctx.Done():
		}
		tm.Stop()
	}
	t.Stop()
	return t, nil
}

// Add records a report (newer reports of the same instance replace older ones).
func (t *Telemetry) Add(r schema.LoadReport) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.latest == nil {
		t.latest = map[string]schema.LoadReport{}
	}
	if cur, ok := t.latest[r.Key()]; ok && cur.Time.After(r.Time) {
		return
	}
	t.latest[r.Key()] = r
	if now := time.Now(); now.Sub(t.pruned) > time.Minute {
		t.pruned = now
		maps.DeleteFunc(t.latest, func(_ string, r schema.LoadReport) bool { return now.Sub(r.Time) > forgetAfter })
	}
	if t.added != nil {
		select {
		case t.added <- struct{}{}:
		default:
		}
	}
}

// Stop ends the subscription; the reports received stay readable.
func (t *Telemetry) Stop() {
	if t != nil && t.sub != nil {
		_ = t.sub.Unsubscribe()
	}
}

// Reports returns the newest report of every instance of kind ("" all) not older than maxAge
// at now (maxAge 0: any age), sorted by instance key.
func (t *Telemetry) Reports(kind string, now time.Time, maxAge time.Duration) []schema.LoadReport {
	if t == nil {
		return nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []schema.LoadReport
	for _, r := range t.latest {
		if (kind == "" || r.Kind == kind) && (maxAge <= 0 || now.Sub(r.Time) <= maxAge) {
			out = append(out, r)
		}
	}
	slices.SortFunc(out, func(a, b schema.LoadReport) int { return strings.Compare(a.Key(), b.Key()) })
	return out
}

// WorldOptions tune BuildWorld. The zero value works.
type WorldOptions struct {
	// Telemetry, if set, supplies per-tenant load; without it tenants are balanced by count.
	Telemetry *Telemetry
	// MaxReportAge ignores load reports older than this. Default 15s.
	MaxReportAge time.Duration
	// Thresholds decide which instances are live. Default schema's.
	Thresholds schema.Thresholds
	// TenantFloor is the least load a tenant counts for (and the load of every tenant when there
	// is no load data). Default 1.
	TenantFloor float64
	// Headroom scales shard capacity in load mode (see BuildWorld). Default 2.
	Headroom float64
	// Now is the clock. Default time.Now.
	Now func() time.Time
	// Dead, if set, tells of instances known dead sooner than their directory entries age (the
	// rebalancer's Presence): they are not live.
	Dead func(key string) bool
}

func (o WorldOptions) withDefaults() WorldOptions {
	if o.MaxReportAge <= 0 {
		o.MaxReportAge = 15 * time.Second
	}
	if o.TenantFloor <= 0 {
		o.TenantFloor = 1
	}
	if o.Headroom <= 0 {
		o.Headroom = 2
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return o
}

// BuildWorld reads kind's directory and placements (and load from opts.Telemetry) into the
// planner's view of it.
//
// Shards are the distinct shards of the kind's instances, plus any shard that still owns
// tenants without having an instance. A shard's MaxTenants is the sum of its live instances'
// capacity; its Labels are those every live instance carries; it is Draining when it has no
// live instance or all of them report draining.
//
// Tenants are the placements, sorted by tenant id, with their revision and pin. A tenant whose
// placement is in the middle of a move (not active) is Moving: the move in flight owns it, and
// only a failover takes it over.
//
// Load: a tenant's load is the sum of its rates in the Top lists of its shard's newest
// reports. A tenant that no Top list names gets its shard's unexplained rate (the instances'
// total rate minus the Top rates) shared evenly among such tenants, and never less than
// TenantFloor. Capacity is then in load units: the kind's total load times the shard's share of
// the kind's tenant capacity (MaxTenants over the sum of non-draining shards'), times Headroom;
// utilisation compares shards fairly, and Headroom leaves room so the planner's hard capacity
// limit bites only well above a fair share. When no instance reports any rate (an idle system,
// or no telemetry), every tenant weighs TenantFloor and Capacity is MaxTenants times
// TenantFloor: balance then evens out tenant counts relative to capacity.
//
// Size: a tenant's Bytes (what a move carries), ReplayBytes and SnapshotBytes are the largest
// figures the live instances report for it in their Sizes lists (the largest tenants of each
// instance); a tenant none of them lists is small and counts 0. The kind's warm-up rule
// (KindConfig.Warmup) becomes World.Warmup, so each move's warm-up strategy is chosen by size.
func BuildWorld(ctx context.Context, st *schema.Store, kind string, opts WorldOptions) (planner.World, error) {
	opts = opts.withDefaults()
	insts, err := st.Directory().Instances(ctx, kind)
	if err != nil {
		return planner.World{}, fmt.Errorf("rebalancer: read the directory of %s: %w", kind, err)
	}
	pls, _, err := st.Placements(kind).List(ctx)
	if err != nil {
		return planner.World{}, fmt.Errorf("rebalancer: read placements of %s: %w", kind, err)
	}
	reports := opts.Telemetry.Reports(kind, opts.Now(), opts.MaxReportAge)
	w := assembleWorld(kind, insts, pls, reports, opts)
	kc, err := st.Kinds().Get(ctx, kind)
	if err != nil && !errors.Is(err, schema.ErrUnknownKind) {
		return planner.World{}, fmt.Errorf("rebalancer: read the config of %s: %w", kind, err)
	}
	if wc := kc.Warmup; err == nil && wc != nil {
		w.Warmup = &planner.Warmup{SnapshotAbove: wc.SnapshotAboveBytes, SLO: wc.SLO.D(),
			ReplayBytesPerSec: wc.ReplayBytesPerSec, SnapshotBytesPerSec: wc.SnapshotBytesPerSec}
	}
	return w, nil
}

// shardAcc accumulates one shard's figures while the world is built.
type shardAcc struct {
	name             string
	live, draining   int
	maxTenants       int
	labels           map[string]string
	labelsSet        bool
	rate, topRate    float64
	unnamed          int
	unnamedPerTenant float64
}

func assembleWorld(kind string, insts []schema.Instance, pls []schema.Placement, reports []schema.LoadReport, opts WorldOptions) planner.World {
	now := opts.Now()
	shards := map[string]*shardAcc{}
	get := func(name string) *shardAcc {
		s := shards[name]
		if s == nil {
			s = &shardAcc{name: name}
			shards[name] = s
		}
		return s
	}
	live := map[string]bool{}
	for _, i := range insts {
		s := get(i.Shard)
		if opts.Dead != nil && opts.Dead(i.Key()) {
			continue
		}
		switch opts.Thresholds.Status(i, now) {
		case schema.StatusOnline, schema.StatusDegraded:
			s.live++
			live[i.Key()] = true
		case schema.StatusDraining:
			s.draining++
			continue
		default:
			continue
		}
		s.maxTenants += i.Capacity
		if !s.labelsSet {
			s.labels, s.labelsSet = maps.Clone(i.Labels), true
		} else {
			maps.DeleteFunc(s.labels, func(k, v string) bool { return i.Labels[k] != v })
		}
	}
	// Per-tenant rates and sizes from the live instances' newest reports. Instances of one
	// shard that report the same tenant (a runner's siblings all acquire it) count once: the
	// largest figure.
	rates := map[string]float64{}
	sizes := map[string]schema.TenantSize{}
	total := 0.0
	for _, r := range reports {
		if !live[r.Key()] {
			continue
		}
		for _, z := range r.Sizes {
			if cur, ok := sizes[z.Tenant]; !ok || z.Bytes() > cur.Bytes() {
				sizes[z.Tenant] = z
			}
		}
		s := get(r.Shard)
		s.rate += r.RatePerSec
		total += r.RatePerSec
		for _, tl := range r.Top {
			rates[tl.Tenant] += tl.RatePerSec
			s.topRate += tl.RatePerSec
		}
	}
	slices.SortFunc(pls, func(a, b schema.Placement) int { return strings.Compare(a.Tenant, b.Tenant) })
	for _, p := range pls {
		if _, ok := rates[p.Tenant]; !ok {
			get(p.Shard).unnamed++
		}
	}
	loadMode := total > 0
	for _, s := range shards {
		if s.unnamed > 0 {
			s.unnamedPerTenant = max(s.rate-s.topRate, 0) / float64(s.unnamed)
		}
	}
	w := planner.World{Kind: kind, Shards: []planner.Shard{}, Tenants: make([]planner.Tenant, 0, len(pls))}
	var totalLoad float64
	for _, p := range pls {
		t := planner.Tenant{ID: p.Tenant, Shard: p.Shard, Revision: p.Revision, Pinned: p.Pinned, Moving: p.Phase != schema.PhaseActive}
		t.Load = opts.TenantFloor
		if loadMode {
			if r, ok := rates[p.Tenant]; ok {
				t.Load = max(r, opts.TenantFloor)
			} else {
				t.Load = max(shards[p.Shard].unnamedPerTenant, opts.TenantFloor)
			}
		}
		if z, ok := sizes[p.Tenant]; ok {
			t.Bytes, t.ReplayBytes, t.SnapshotBytes = z.Bytes(), z.EventBytes, z.SnapshotBytes
		}
		totalLoad += t.Load
		w.Tenants = append(w.Tenants, t)
	}
	sumMax := 0
	for _, s := range shards {
		if s.live > 0 {
			sumMax += s.maxTenants
		}
	}
	names := slices.Sorted(maps.Keys(shards))
	for _, n := range names {
		s := shards[n]
		sh := planner.Shard{Name: n, MaxTenants: s.maxTenants, Labels: s.labels, Draining: s.live == 0}
		switch {
		case sh.Draining:
		case !loadMode:
			sh.Capacity = float64(max(s.maxTenants, 1)) * opts.TenantFloor
		case sumMax > 0:
			sh.Capacity = opts.Headroom * totalLoad * float64(s.maxTenants) / float64(sumMax)
		default:
			sh.Capacity = opts.Headroom * totalLoad
		}
		if len(sh.Labels) == 0 {
			sh.Labels = nil
		}
		w.Shards = append(w.Shards, sh)
	}
	fenceOffAllTenantShards(&w)
	return w
}

// BuildWorlds builds the world of every kind in kinds (all registered kinds if empty) that has
// at least one shard or tenant.
func BuildWorlds(ctx context.Context, st *schema.Store, kinds []string, opts WorldOptions) ([]planner.World, error) {
	if len(kinds) == 0 {
		kcs, err := st.Kinds().List(ctx)
		if err != nil {
			return nil, err
		}
		for _, k := range kcs {
			kinds = append(kinds, k.Kind)
		}
		slices.Sort(kinds)
	}
	var out []planner.World
	for _, k := range kinds {
		w, err := BuildWorld(ctx, st, k, opts)
		if err != nil {
			return nil, err
		}
		if len(w.Shards) > 0 || len(w.Tenants) > 0 {
			out = append(out, w)
		}
	}
	return out, nil
}

// MakePlan builds the worlds req needs (its kind, or every kind for a move-tenant request or
// when req.Kind is empty) and plans on them.
func MakePlan(ctx context.Context, st *schema.Store, req planner.Request, opts WorldOptions) (*planner.Plan, error) {
	var kinds []string
	if req.Kind != "" && req.Strategy != planner.StrategyMoveTenant {
		if _, err := st.Kinds().Get(ctx, req.Kind); err != nil {
			return nil, err
		}
		kinds = []string{req.Kind}
	}
	worlds, err := BuildWorlds(ctx, st, kinds, opts)
	if err != nil {
		return nil, err
	}
	if len(kinds) == 1 && len(worlds) == 0 {
		worlds = []planner.World{{Kind: req.Kind}}
	}
	if req.Kind == "" && req.Strategy != planner.StrategyMoveTenant && len(worlds) != 1 {
		have := make([]string, 0, len(worlds))
		for _, w := range worlds {
			have = append(have, w.Kind)
		}
		return nil, fmt.Errorf("%w: name the kind to plan for; kinds with shards or tenants: %v", planner.ErrInvalid, have)
	}
	if err := refuseAllTenantShards(req, worlds); err != nil {
		return nil, err
	}
	return planner.Make(req, worlds...)
}
