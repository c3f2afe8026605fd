package rebalancer

import (
	"context"
	"encoding/json"
	"sync"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/kvwatch"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// liveAgeEvery is how often the directory view re-judges liveness without a change: heartbeats
// age with nothing to wake on.
const liveAgeEvery = 500 * time.Millisecond

// dirView is the instance directory in memory, shared by every move the engine runs: one
// follower and one ageing tick for all of them, instead of a listing per move every 500ms (at a
// plan's concurrency of 50 that was 100 directory listings a second). It runs while at least
// one move holds it (acquire/release).
type dirView struct {
	e *Engine
	shared

	mu      sync.Mutex
	byShard map[string]map[string]schema.Instance // "<kind>.<shard>" -> instance key -> entry
	shardOf map[string]string                     // instance key -> "<kind>.<shard>"
	synced  bool
	notify  chan struct{} // closed and replaced when liveness may have changed
}

func newDirView(e *Engine) *dirView {
	return &dirView{e: e, byShard: map[string]map[string]schema.Instance{}, shardOf: map[string]string{},
		notify: make(chan struct{})}
}

// acquire starts the view if it is not running; every acquire needs a release.
func (d *dirView) acquire() {
	d.shared.acquire(func() {
		d.mu.Lock()
		d.byShard, d.shardOf, d.synced = map[string]map[string]schema.Instance{}, map[string]string{}, false
		d.mu.Unlock()
	}, func(ctx context.Context) { d.e.follow(ctx, schema.BucketInstances, d) }, d.age)
}

// age wakes the waiters every liveAgeEvery, so an instance whose heartbeats stopped is judged
// again as it ages.
func (d *dirView) age(ctx context.Context) {
	t := time.NewTicker(liveAgeEvery)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			d.mu.Lock()
			d.changed()
			d.mu.Unlock()
		case <-ctx.Done():
			return
		}
	}
}

func (d *dirView) changed() {
	close(d.notify)
	d.notify = make(chan struct{})
}

// Apply implements kvwatch.Handler. A heartbeat that leaves the instance as live as it was
// wakes nobody; the ageing tick covers heartbeats that stop.
func (d *dirView) Apply(e kvwatch.Entry) {
	now := time.Now()
	d.mu.Lock()
	defer d.mu.Unlock()
	old, had := d.remove(e.Key)
	var inst schema.Instance
	if e.Op != kvwatch.Put || json.Unmarshal(e.Value, &inst) != nil || inst.Key() != e.Key {
		if had {
			d.changed()
		}
		return
	}
	sk := inst.Kind + "." + inst.Shard
	m := d.byShard[sk]
	if m == nil {
		m = map[string]schema.Instance{}
		d.byShard[sk] = m
	}
	m[e.Key] = inst
	d.shardOf[e.Key] = sk
	th := d.e.cfg.Thresholds
	if !had || old.Shard != inst.Shard || th.Status(old, now).Live() != th.Status(inst, now).Live() {
		d.changed()
	}
}

// remove drops key's entry and returns it.
func (d *dirView) remove(key string) (schema.Instance, bool) {
	sk, ok := d.shardOf[key]
	if !ok {
		return schema.Instance{}, false
	}
	delete(d.shardOf, key)
	m := d.byShard[sk]
	old := m[key]
	delete(m, key)
	if len(m) == 0 {
		delete(d.byShard, sk)
	}
	return old, true
}

// Synced implements kvwatch.Handler.
func (d *dirView) Synced() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.synced = true
	d.changed()
}

// live returns the live instance keys of kind's shards (live by their directory entries, and
// not dead by Presence), whether the view has synced, and a channel closed when liveness may
// have changed (Presence's changes have a channel of their own).
func (d *dirView) live(kind string, shards ...string) (map[string][]string, bool, <-chan struct{}) {
	now := time.Now()
	th := d.e.cfg.Thresholds
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make(map[string][]string, len(shards))
	pr := d.e.cfg.Presence
	for _, sh := range shards {
		for key, inst := range d.byShard[kind+"."+sh] {
			if th.Status(inst, now).Live() && (pr == nil || !pr.Dead(key)) {
				out[sh] = append(out[sh], key)
			}
		}
	}
	return out, d.synced, d.notify
}
