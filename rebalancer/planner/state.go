package planner

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strings"
)

// state is the planner's working copy of one world: compact per-shard and per-tenant slices
// indexed by int32, so a million tenants cost a few bytes each beyond the caller's World.
type state struct {
	w      *World
	opts   Options
	order  []int32 // shard indexes sorted by name
	rank   []int32 // per shard: its position in order (stable tie-breaks)
	byName map[string]int32

	load, load0   []float64 // per shard, now and before
	count, count0 []int32
	in, out       []int32
	excluded      []bool // left out of utilisation figures (draining, being evacuated)

	owner []int32 // per tenant: current shard index
	moves []Move
	// movedBytes is the bytes the moves carry; bytesBlocked is set when MaxBytes kept a tenant.
	movedBytes   uint64
	bytesBlocked bool

	// seg[off[s]:off[s+1]] lists the tenants first placed on shard s (built on demand).
	seg []int32
	off []int32
}

func newState(w *World, opts Options) (*state, error) {
	if w.Kind == "" {
		return nil, fmt.Errorf("%w: the world has no kind: set World.Kind", ErrInvalid)
	}
	n := len(w.Shards)
	s := &state{
		w: w, opts: opts, byName: make(map[string]int32, n),
		load: make([]float64, n), count: make([]int32, n), in: make([]int32, n), out: make([]int32, n),
		excluded: make([]bool, n), owner: make([]int32, len(w.Tenants)),
	}
	for i, sh := range w.Shards {
		if sh.Name == "" {
			return nil, fmt.Errorf("%w: %s: shard %d has no name", ErrInvalid, w.Kind, i)
		}
		if _, dup := s.byName[sh.Name]; dup {
			return nil, fmt.Errorf("%w: %s: shard %s is listed twice", ErrInvalid, w.Kind, sh.Name)
		}
		if !sh.Draining && !(sh.Capacity > 0) || sh.Capacity < 0 || math.IsInf(sh.Capacity, 0) || math.IsNaN(sh.Capacity) {
			return nil, fmt.Errorf("%w: %s: shard %s has capacity %v: give it a positive capacity or mark it draining", ErrInvalid, w.Kind, sh.Name, sh.Capacity)
		}
		s.byName[sh.Name] = int32(i)
		s.excluded[i] = sh.Draining
		s.order = append(s.order, int32(i))
	}
	slices.SortFunc(s.order, func(a, b int32) int { return strings.Compare(w.Shards[a].Name, w.Shards[b].Name) })
	s.rank = make([]int32, n)
	for r, si := range s.order {
		s.rank[si] = int32(r)
	}
	for i := range w.Tenants {
		t := &w.Tenants[i]
		si, ok := s.byName[t.Shard]
		if !ok {
			return nil, fmt.Errorf("%w: %s: tenant %s is on shard %q, which the world does not list: add the shard (marked draining if it is gone)", ErrInvalid, w.Kind, t.ID, t.Shard)
		}
		if t.Load < 0 || math.IsNaN(t.Load) || math.IsInf(t.Load, 0) {
			return nil, fmt.Errorf("%w: %s: tenant %s has load %v: loads are finite and >= 0", ErrInvalid, w.Kind, t.ID, t.Load)
		}
		s.owner[i] = si
		s.load[si] += t.Load
		s.count[si]++
	}
	s.load0 = slices.Clone(s.load)
	s.count0 = slices.Clone(s.count)
	return s, nil
}

// buildSegments buckets tenants by their original shard (a counting sort: no per-shard slices).
func (s *state) buildSegments() {
	n := len(s.w.Shards)
	s.off = make([]int32, n+1)
	for _, o := range s.owner {
		s.off[o+1]++
	}
	for i := 1; i <= n; i++ {
		s.off[i] += s.off[i-1]
	}
	s.seg = make([]int32, len(s.owner))
	next := slices.Clone(s.off[:n])
	for t, o := range s.owner {
		s.seg[next[o]] = int32(t)
		next[o]++
	}
}

// tenantsOf returns shard si's original tenants; sortDesc orders them heaviest first (ties:
// fewer bytes, then input order).
func (s *state) tenantsOf(si int32, sortDesc bool) []int32 {
	seg := s.seg[s.off[si]:s.off[si+1]]
	if sortDesc {
		ts := s.w.Tenants
		slices.SortFunc(seg, func(a, b int32) int {
			if c := cmp.Compare(ts[b].Load, ts[a].Load); c != 0 {
				return c
			}
			if c := cmp.Compare(ts[a].Bytes, ts[b].Bytes); c != 0 {
				return c // equal load: the one with less to carry first
			}
			return cmp.Compare(a, b)
		})
	}
	return seg
}

// util is shard si's utilisation now.
func (s *state) util(si int32) float64 {
	c := s.w.Shards[si].Capacity
	if c <= 0 {
		return 0
	}
	return s.load[si] / c
}

// mean is the utilisation of all shards together (excluded shards left out).
func (s *state) mean() float64 {
	var l, c float64
	for i := range s.w.Shards {
		if !s.excluded[i] {
			l += s.load[i]
			c += s.w.Shards[i].Capacity
		}
	}
	if c == 0 {
		return 0
	}
	return l / c
}

// canHost reports whether shard si may receive tenant t now: not draining, labels, tenant count
// and load capacity.
func (s *state) canHost(si int32, t int32) bool {
	sh := &s.w.Shards[si]
	ten := &s.w.Tenants[t]
	if sh.Draining || s.owner[t] == si {
		return false
	}
	if sh.MaxTenants > 0 && int(s.count[si]) >= sh.MaxTenants {
		return false
	}
	if !leq(s.load[si]+ten.Load, sh.Capacity) {
		return false
	}
	if !s.fitsBytes(t) {
		return false
	}
	return matches(sh.Labels, ten.Requires) && matches(sh.Labels, s.opts.Require)
}

// move records tenant t moving to shard to and updates the working figures.
func (s *state) move(t, to int32) {
	from := s.owner[t]
	ten := &s.w.Tenants[t]
	s.load[from] -= ten.Load
	s.load[to] += ten.Load
	s.count[from]--
	s.count[to]++
	s.out[from]++
	s.in[to]++
	s.owner[t] = to
	s.movedBytes += ten.Bytes
	m := Move{
		Kind: s.w.Kind, Tenant: ten.ID, From: s.w.Shards[from].Name, To: s.w.Shards[to].Name,
		Load: ten.Load, Revision: ten.Revision, Bytes: ten.Bytes,
	}
	s.w.Warmup.choose(&m, ten)
	s.moves = append(s.moves, m)
}

// fitsBytes reports whether tenant t's bytes fit in what is left of the byte budget.
func (s *state) fitsBytes(t int32) bool {
	b := s.w.Tenants[t].Bytes
	if s.opts.MaxBytes == 0 || s.movedBytes+b <= s.opts.MaxBytes {
		return true
	}
	s.bytesBlocked = true
	return false
}

func (s *state) budgetLeft() bool { return s.opts.Budget == 0 || len(s.moves) < s.opts.Budget }

// leq is a <= b with a small relative tolerance for float sums.
func leq(a, b float64) bool { return a <= b+1e-9*math.Max(1, math.Abs(b)) }

// pinnedError names the tenants that must stay (at most 10, each with why: pinned, moving,
// cooling down) in a message that says what to do.
func pinnedError(kind, shard string, names []string) error {
	more := ""
	if len(names) > 10 {
		more = fmt.Sprintf(" and %d more", len(names)-10)
		names = names[:10]
	}
	return fmt.Errorf("%w: %s/%s holds %s%s: unpin the pinned (or move them by hand first), and wait for moves and the autopilot's cool-downs to end",
		ErrPinned, kind, shard, strings.Join(names, ", "), more)
}

// heap32 is a binary heap of int32 ids ordered by less (no interface boxing on the hot path).
type heap32 struct {
	items []int32
	less  func(a, b int32) bool
}

func (h *heap32) Len() int     { return len(h.items) }
func (h *heap32) Top() int32   { return h.items[0] }
func (h *heap32) Push(x int32) { h.items = append(h.items, x); h.up(len(h.items) - 1) }

func (h *heap32) Pop() int32 {
	n := len(h.items) - 1
	top := h.items[0]
	h.items[0] = h.items[n]
	h.items = h.items[:n]
	if n > 0 {
		h.down(0)
	}
	return top
}

// Fix restores the order after the top's key changed.
func (h *heap32) Fix() { h.down(0) }

func (h *heap32) up(i int) {
	for i > 0 {
		p := (i - 1) / 2
		if !h.less(h.items[i], h.items[p]) {
			return
		}
		h.items[i], h.items[p] = h.items[p], h.items[i]
		i = p
	}
}

func (h *heap32) down(i int) {
	n := len(h.items)
	for {
		l := 2*i + 1
		if l >= n {
			return
		}
		m := l
		if r := l + 1; r < n && h.less(h.items[r], h.items[l]) {
			m = r
		}
		if !h.less(h.items[m], h.items[i]) {
			return
		}
		h.items[i], h.items[m] = h.items[m], h.items[i]
		i = m
	}
}
