package shardkit

import (
	"context"
	"hash/maphash"
	"sync"
	"sync/atomic"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// tenantState is one tenant's figures and drain state on this instance. The gate finds it
// through a sharded map and touches only atomics.
type tenantState struct {
	tenant string

	inflight atomic.Int64
	// draining refuses new requests; dead marks a state removed from the map (the gate then
	// fetches the current one).
	draining atomic.Bool
	dead     atomic.Bool
	// idle gets a token when in-flight drops to zero while draining.
	idle chan struct{}
	// leave is closed when the tenant starts draining here (Leaving); made on first use
	// under mu, and made anew when the drain is lifted.
	leave chan struct{}

	requests atomic.Uint64
	errors   atomic.Uint64
	latency  atomic.Uint64 // nanoseconds, summed
	labels   atomic.Pointer[tenantSeries]

	mu sync.Mutex // guards the fields below
	// phase is what this instance reports for the tenant ("" while simply serving).
	phase    schema.SignalPhase
	fence    uint64
	epoch    uint64
	applied  uint64
	lag      uint64
	manual   bool // drained through /admin/drain
	released bool // the Release hook ran for this stint of hosting
	// task cancels the tenant's move task (warm-up or drain), if one runs.
	task     context.CancelFunc
	taskDone chan struct{}

	// telemetry goroutine only
	lastRequests uint64
	lastErrors   uint64
	rate         float64
	topMark      uint64 // requests at the last top-N recomputation
}

// acquire counts a request in, unless the tenant is draining or the state was removed.
func (ts *tenantState) acquire() (ok, dead bool) {
	ts.inflight.Add(1)
	if ts.draining.Load() || ts.dead.Load() {
		ts.release()
		return false, ts.dead.Load()
	}
	return true, false
}

// setDraining starts or lifts the tenant's drain here. Starting it closes the channel that
// Leaving gives the tenant's open calls (server streams end, so the drain does not wait for them).
func (ts *tenantState) setDraining(on bool) {
	ts.draining.Store(on)
	ts.mu.Lock()
	defer ts.mu.Unlock()
	if ts.leave == nil {
		return
	}
	select {
	case <-ts.leave:
		if !on {
			ts.leave = nil
		}
	default:
		if on {
			close(ts.leave)
		}
	}
}

// leaving returns a channel closed once the tenant starts draining here.
func (ts *tenantState) leaving() <-chan struct{} {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	if ts.leave == nil {
		ts.leave = make(chan struct{})
		if ts.draining.Load() || ts.dead.Load() {
			close(ts.leave)
		}
	}
	return ts.leave
}

// release counts a request out and wakes a drain waiting for zero.
func (ts *tenantState) release() {
	if ts.inflight.Add(-1) == 0 && ts.draining.Load() {
		select {
		case ts.idle <- struct{}{}:
		default:
		}
	}
}

const stateShards = 64

// stateMap is a sharded map of tenant states: the gate takes one shard's read lock.
type stateMap struct {
	seed   maphash.Seed
	shards [stateShards]struct {
		mu sync.RWMutex
		m  map[string]*tenantState
		_  [40]byte // keep shards on separate cache lines
	}
	newSeries func(tenant string) *tenantSeries
}

func newStateMap(newSeries func(string) *tenantSeries) *stateMap {
	sm := &stateMap{seed: maphash.MakeSeed(), newSeries: newSeries}
	for i := range sm.shards {
		sm.shards[i].m = map[string]*tenantState{}
	}
	return sm
}

func (sm *stateMap) shard(tenant string) int {
	return int(maphash.String(sm.seed, tenant) % stateShards)
}

// get returns the tenant's state, or nil.
func (sm *stateMap) get(tenant string) *tenantState {
	sh := &sm.shards[sm.shard(tenant)]
	sh.mu.RLock()
	ts := sh.m[tenant]
	sh.mu.RUnlock()
	return ts
}

// getOrCreate returns the tenant's state, creating it on first use.
func (sm *stateMap) getOrCreate(tenant string) *tenantState {
	if ts := sm.get(tenant); ts != nil {
		return ts
	}
	sh := &sm.shards[sm.shard(tenant)]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if ts := sh.m[tenant]; ts != nil {
		return ts
	}
	ts := &tenantState{tenant: tenant, idle: make(chan struct{}, 1)}
	ts.labels.Store(sm.newSeries(tenant))
	sh.m[tenant] = ts
	return ts
}

// removeIf deletes the tenant's state if keep reports false, marking it dead so gates holding
// it fetch a new one.
func (sm *stateMap) removeIf(tenant string, remove func(*tenantState) bool) {
	sh := &sm.shards[sm.shard(tenant)]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	ts := sh.m[tenant]
	if ts == nil || !remove(ts) {
		return
	}
	ts.dead.Store(true)
	if ts.inflight.Load() != 0 {
		ts.dead.Store(false) // a request got in meanwhile: keep it
		return
	}
	delete(sh.m, tenant)
}

// all returns every state (a copy of the pointers).
func (sm *stateMap) all() []*tenantState {
	var out []*tenantState
	for i := range sm.shards {
		sh := &sm.shards[i]
		sh.mu.RLock()
		for _, ts := range sh.m {
			out = append(out, ts)
		}
		sh.mu.RUnlock()
	}
	return out
}
