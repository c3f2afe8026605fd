package gateway

import "sync"

// interned keeps one string per valid tenant id seen, so the request path turns the
// x-tenant-id bytes into a string without allocating (the map lookup with string(b) does not).
// Only ids that passed validation are interned (admit checks first), and the table is bounded
// by bytes: ids go into the current generation, and when it holds maxInternBytes the previous
// generation is dropped and the current one takes its place, so the tenants in use stay
// interned (a hit in the previous generation moves the id forward) and the table never holds
// more than two generations. A tenant beyond the bound costs one allocation per request.
type interned struct {
	mu        sync.RWMutex
	cur, prev map[string]string
	bytes     int // in cur
	max       int // bytes per generation; 0: maxInternBytes
}

// maxInternBytes bounds one generation: about 190,000 ids of the longest length (128), many
// more of usual ones. internCost is what one entry costs beside its bytes (map slot, string
// header).
const (
	maxInternBytes = 32 << 20
	internCost     = 48
)

func (t *interned) get(b []byte) string {
	t.mu.RLock()
	s, ok := t.cur[string(b)]
	if !ok {
		s = t.prev[string(b)] // moved forward below
	}
	t.mu.RUnlock()
	if ok {
		return s
	}
	if s == "" {
		s = string(b)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if v, hit := t.cur[s]; hit {
		return v
	}
	limit := t.max
	if limit == 0 {
		limit = maxInternBytes
	}
	if t.bytes+len(s)+internCost > limit {
		t.prev, t.cur, t.bytes = t.cur, make(map[string]string, len(t.cur)), 0
	}
	if t.cur == nil {
		t.cur = map[string]string{}
	}
	t.cur[s] = s
	t.bytes += len(s) + internCost
	return s
}

// size is the bytes the table holds (both generations, estimated).
func (t *interned) size() int {
	t.mu.RLock()
	defer t.mu.RUnlock()
	n := t.bytes
	for k := range t.prev {
		n += len(k) + internCost
	}
	return n
}
