// Package affinity is the selection algorithm of the gateway's affinity policy (the prerender manager, the
// prerender manager): tenants stick to the instances that hold them warm, up to multiplex M
// owners per tenant, new tenants go round-robin to instances with room, and when every instance
// is full (pressure mode) a new tenant goes to the owner of the globally least-recently-used
// tenant, letting that instance's own LRU decide what to evict.
//
// A [Selector] keeps, per kind, what the algorithm needs: every tenant's owners (fed from the
// placement watcher, so it is the KV state every gateway agrees on), the per-instance tenant
// counts derived from them, each tenant's last access through this gateway, the global
// round-robin cursor and the per-tenant rotation. It performs no I/O: [Selector.Plan] returns
// the instances to try, in order, and the caller proxies and records assignments.
package affinity

import (
	"slices"
	"sync"
	"time"
)

// Server is one candidate instance: live, circuit not open.
type Server struct {
	// Key is the instance key (<kind>.<shard>.<instance>).
	Key string
	// Capacity is the number of tenants the instance takes (the prerender manager's page pool size).
	Capacity int
}

// Attempt is one instance to try for a request.
type Attempt struct {
	Key string
	// New: the instance is not an owner of the tenant yet; on success it becomes one.
	New bool
	// Pressure: chosen in pressure mode (no instance had room); the assignment is recorded
	// only after the request succeeds.
	Pressure bool
	// Fallback: the global round-robin attempt after the owners failed.
	Fallback bool
}

// Selector is one kind's affinity state. It is safe for concurrent use.
type Selector struct {
	now func() time.Time

	mu     sync.Mutex
	owners map[string][]string        // tenant -> owners as in KV (newest first)
	counts map[string]int             // instance key -> tenants it owns
	last   map[string]time.Time       // tenant -> last successful access through this gateway
	used   map[string]map[string]bool // tenant -> owners used since its owner set last changed
	prev   map[string]string          // tenant -> owner used last (rotation)
	rr     int                        // global round-robin cursor
}

// New makes a Selector; now defaults to time.Now.
func New(now func() time.Time) *Selector {
	if now == nil {
		now = time.Now
	}
	return &Selector{now: now, owners: map[string][]string{}, counts: map[string]int{},
		last: map[string]time.Time{}, used: map[string]map[string]bool{}, prev: map[string]string{}}
}

// SetOwners records tenant's owners as stored in KV (nil or empty: the tenant has none).
func (s *Selector) SetOwners(tenant string, owners []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	old := s.owners[tenant]
	if slices.Equal(old, owners) {
		return
	}
	for _, o := range old {
		if s.counts[o]--; s.counts[o] <= 0 {
			delete(s.counts, o)
		}
	}
	if len(owners) == 0 {
		delete(s.owners, tenant)
		delete(s.used, tenant)
		delete(s.prev, tenant)
		delete(s.last, tenant) // only owned tenants take part in pressure mode
		return
	}
	s.owners[tenant] = slices.Clone(owners)
	for _, o := range owners {
		s.counts[o]++
	}
	// The owner set changed: every owner serves the tenant once before the set grows again.
	s.used[tenant] = map[string]bool{}
}

// Owners returns tenant's owners (a copy).
func (s *Selector) Owners(tenant string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.owners[tenant])
}

// Count is the number of tenants the instance owns.
func (s *Selector) Count(key string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.counts[key]
}

// TenantsOf lists the tenants an instance owns.
func (s *Selector) TenantsOf(key string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for t, os := range s.owners {
		if slices.Contains(os, key) {
			out = append(out, t)
		}
	}
	slices.Sort(out)
	return out
}

// Instances lists every instance named as an owner.
func (s *Selector) Instances() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, len(s.counts))
	for k := range s.counts {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// Served records that key served tenant successfully now (last access, rotation).
func (s *Selector) Served(tenant, key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.last[tenant] = s.now()
	s.prev[tenant] = key
	u := s.used[tenant]
	if u == nil {
		u = map[string]bool{}
		s.used[tenant] = u
	}
	u[key] = true
}

// Forget drops a tenant's access record (it has no owner any more and will not come back soon).
func (s *Selector) Forget(tenant string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.last, tenant)
}

// Plan returns the instances to try for tenant, in order, among servers (the live instances
// with an available circuit), for multiplex m:
//
//   - a tenant with live owners rotates among them; while it has fewer than m owners and each
//     of them has served it since its owner set last changed, the next instance with room
//     (round-robin) is tried first and grows the set (organic growth);
//   - a tenant without owners goes to the next instance with room, round-robin;
//   - if no instance has room (pressure mode), to the owner of the globally least-recently-used
//     tenant;
//   - after the owners, one global round-robin attempt (room preferred, else any instance).
func (s *Selector) Plan(tenant string, servers []Server, m int) []Attempt {
	if len(servers) == 0 {
		return nil
	}
	if m < 1 {
		m = 1
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	live := make([]string, 0, m)
	for _, o := range s.owners[tenant] {
		if hasServer(servers, o) {
			live = append(live, o)
		}
	}
	var plan []Attempt
	if len(live) > 0 {
		if len(live) < m && s.allUsed(tenant, live) {
			if k := s.nextRR(servers, live, true); k != "" {
				plan = append(plan, Attempt{Key: k, New: true})
			}
		}
		for _, o := range s.rotate(tenant, live) {
			plan = append(plan, Attempt{Key: o})
		}
	} else if k := s.nextRR(servers, nil, true); k != "" {
		plan = append(plan, Attempt{Key: k, New: true})
	} else if k := s.lruOwner(servers); k != "" {
		plan = append(plan, Attempt{Key: k, New: true, Pressure: true})
	}
	tried := make([]string, 0, len(plan)+1)
	for _, a := range plan {
		tried = append(tried, a.Key)
	}
	// The fallback peeks at the cursor without moving it: it is rarely used.
	k := s.peekRR(servers, tried, true)
	if k == "" {
		k = s.peekRR(servers, tried, false)
	}
	if k != "" {
		plan = append(plan, Attempt{Key: k, New: !slices.Contains(live, k), Fallback: true, Pressure: !s.hasRoom(servers, k)})
	}
	return plan
}

func (s *Selector) allUsed(tenant string, live []string) bool {
	u := s.used[tenant]
	for _, o := range live {
		if !u[o] {
			return false
		}
	}
	return true
}

// rotate orders the live owners starting after the one used last.
func (s *Selector) rotate(tenant string, live []string) []string {
	start := 0
	if i := slices.Index(live, s.prev[tenant]); i >= 0 {
		start = (i + 1) % len(live)
	}
	out := make([]string, 0, len(live))
	for i := range live {
		out = append(out, live[(start+i)%len(live)])
	}
	return out
}

// nextRR advances the global round-robin cursor to the next server not in skip (with room if
// room is set) and returns it, or "" if there is none.
func (s *Selector) nextRR(servers []Server, skip []string, room bool) string {
	i := s.findRR(servers, skip, room)
	if i < 0 {
		return ""
	}
	s.rr = i + 1
	return servers[i%len(servers)].Key
}

// peekRR is nextRR without moving the cursor.
func (s *Selector) peekRR(servers []Server, skip []string, room bool) string {
	if i := s.findRR(servers, skip, room); i >= 0 {
		return servers[i%len(servers)].Key
	}
	return ""
}

func (s *Selector) findRR(servers []Server, skip []string, room bool) int {
	n := len(servers)
	for i := range n {
		j := (s.rr + i) % n
		sv := servers[j]
		if slices.Contains(skip, sv.Key) || (room && s.counts[sv.Key] >= sv.Capacity) {
			continue
		}
		return j
	}
	return -1
}

func (s *Selector) hasRoom(servers []Server, key string) bool {
	for _, sv := range servers {
		if sv.Key == key {
			return s.counts[key] < sv.Capacity
		}
	}
	return false
}

// lruOwner returns a live owner of the globally least-recently-used tenant (tenants this
// gateway never served count as oldest).
func (s *Selector) lruOwner(servers []Server) string {
	best, bestT, bestTenant, found := "", time.Time{}, "", false
	for t, os := range s.owners {
		at := s.last[t]
		if found && (at.After(bestT) || (at.Equal(bestT) && t > bestTenant)) {
			continue
		}
		for _, o := range os {
			if hasServer(servers, o) {
				best, bestT, bestTenant, found = o, at, t, true
				break
			}
		}
	}
	if !found {
		return servers[s.rr%len(servers)].Key
	}
	return best
}

func hasServer(servers []Server, key string) bool {
	for _, sv := range servers {
		if sv.Key == key {
			return true
		}
	}
	return false
}
