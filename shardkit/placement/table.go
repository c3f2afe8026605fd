package placement

import (
	"hash/maphash"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// table is one kind's placements in memory: an open-addressing hash table written by one
// goroutine (the kind's follower) and read by any number of goroutines without locks.
//
// Layout, under 64 bytes per placement at 1M tenants:
//   - slots: uint32 per slot (entry index + 1, 0 = empty), load factor <= 3/4;
//   - entries: 40 bytes each, in fixed-size chunks that never move; a tenant id of up to 19
//     bytes is stored in the entry itself (one cache line to compare), longer ones in an arena.
//
// An entry's routing data is packed into one 64-bit word (owner ref, peer ref, phase, pinned,
// epoch) so that readers see it change atomically. Strings come from an interned table of refs
// (shard names and affinity owner sets), so a lookup returns them without allocating.
//
// Publication: the writer fills an entry before storing its slot, and publishes a new index
// (chunks and arena headers) before storing a slot that needs it. A reader that meets a slot
// beyond what its index can see reloads the index, which then covers it.
type table struct {
	seed maphash.Seed
	idx  atomic.Pointer[index]
	refs atomic.Pointer[[]*ref]
	// takeovers counts the placements in a takeover (written by the writer, read by anyone),
	// and held names them: finding them costs their number, not the kind's placements.
	takeovers atomic.Int64
	heldMu    sync.Mutex
	held      map[string]struct{}

	// Writer-only state.
	refIDs     map[string]uint16
	live       int // entries with a placement
	tombstones int // entries whose placement was deleted
}

const (
	chunkBits = 12
	chunkSize = 1 << chunkBits
	maxLoad   = 3 // numerator of the 3/4 load factor
)

type index struct {
	slots  []atomic.Uint32
	mask   uint32
	chunks []*[chunkSize]entry
	n      uint32 // entries in use
	arena  []byte
}

type entry struct {
	val    atomic.Uint64
	rev    atomic.Uint64
	hash   uint32
	keyLen uint8
	// key holds the tenant id if it fits, else its offset in the arena (first 4 bytes).
	key [inlineKey]byte
}

const inlineKey = 19

// keyOff is the arena offset of a key too long to be inline.
func (e *entry) keyOff() uint32 {
	return uint32(e.key[0]) | uint32(e.key[1])<<8 | uint32(e.key[2])<<16 | uint32(e.key[3])<<24
}

func (e *entry) setKey(key string, arena []byte) []byte {
	e.keyLen = uint8(len(key))
	if len(key) <= inlineKey {
		copy(e.key[:], key)
		return arena
	}
	off := len(arena)
	e.key[0], e.key[1], e.key[2], e.key[3] = byte(off), byte(off>>8), byte(off>>16), byte(off>>24)
	return append(arena, key...)
}

// keyIn returns the entry's key as stored in arena (no copy); ok is false if the arena is too
// short (a reader's index older than the entry).
func (e *entry) keyIn(arena []byte) (string, bool) {
	n := int(e.keyLen)
	if n <= inlineKey {
		return unsafe.String(&e.key[0], n), true
	}
	off := int(e.keyOff())
	if off+n > len(arena) {
		return "", false
	}
	return unsafe.String(&arena[off], n), true
}

// ref is an interned owner: a shard name, or, for affinity kinds, an owner set.
type ref struct {
	name   string
	owners []string
	count  atomic.Int64 // placements whose owner this is
}

// Packed value: | epoch 28 | pinned 1 | phase 3 | peer 16 | owner 16 |; phase 0 means absent.
const (
	maxEpoch   = 1<<28 - 1
	phaseShift = 32
	pinnedBit  = 1 << 35
	epochShift = 36
)

var phases = [...]schema.Phase{"", schema.PhaseActive, schema.PhaseWarming, schema.PhaseHandoff, schema.PhaseDraining, schema.PhaseTakeover}

func phaseCode(p schema.Phase) uint64 {
	for i, q := range phases {
		if i > 0 && q == p {
			return uint64(i)
		}
	}
	return 0
}

func newTable(sizeHint int) *table {
	t := &table{seed: maphash.MakeSeed(), refIDs: map[string]uint16{}, held: map[string]struct{}{}}
	refs := []*ref{{}} // ref 0 is "none"
	t.refs.Store(&refs)
	nslots := uint32(16)
	for int(nslots)*maxLoad/4 < sizeHint {
		nslots <<= 1
	}
	t.idx.Store(&index{slots: make([]atomic.Uint32, nslots), mask: nslots - 1})
	return t
}

func (t *table) hash(key string) uint32 {
	h := maphash.String(t.seed, key)
	return uint32(h) ^ uint32(h>>32)
}

// Entry is the routing view of one placement.
type Entry struct {
	Shard  string
	Epoch  uint64
	Phase  schema.Phase
	Target string // warming, handoff, takeover: where the tenant is going
	Source string // draining: the former owner
	Pinned bool
	// Owners are the instances serving the tenant under the affinity policy.
	Owners   []string
	Revision uint64
}

// lookup finds key; it takes no lock and allocates nothing.
func (t *table) lookup(key string) (Entry, bool) {
	h := t.hash(key)
	ix := t.idx.Load()
	for i := h & ix.mask; ; i = (i + 1) & ix.mask {
		s := ix.slots[i].Load()
		if s == 0 {
			return Entry{}, false
		}
		if s > uint32(len(ix.chunks))*chunkSize {
			// Published after our index was loaded: reload and start over.
			return t.lookup(key)
		}
		e := &ix.chunks[(s-1)>>chunkBits][(s-1)&(chunkSize-1)]
		if e.hash != h || int(e.keyLen) != len(key) {
			continue
		}
		k, ok := e.keyIn(ix.arena)
		if !ok {
			return t.lookup(key)
		}
		if k != key {
			continue
		}
		return t.decode(e.val.Load(), e.rev.Load())
	}
}

func (t *table) decode(v, rev uint64) (Entry, bool) {
	ph := (v >> phaseShift) & 7
	if ph == 0 || int(ph) >= len(phases) {
		return Entry{}, false
	}
	refs := *t.refs.Load() // loaded after v, so it holds every ref v names
	owner, peer := uint16(v), uint16(v>>16)
	e := Entry{
		Shard:    refs[owner].name,
		Owners:   refs[owner].owners,
		Epoch:    v >> epochShift,
		Phase:    phases[ph],
		Pinned:   v&pinnedBit != 0,
		Revision: rev,
	}
	switch e.Phase {
	case schema.PhaseWarming, schema.PhaseHandoff, schema.PhaseTakeover:
		e.Target = refs[peer].name
	case schema.PhaseDraining:
		e.Source = refs[peer].name
	}
	return e, true
}

// Writer side. Everything below runs on the kind's follower goroutine only.

// intern returns the ref id for a shard (and owner set), adding it if new.
func (t *table) intern(name string, owners []string) (uint16, bool) {
	if name == "" {
		return 0, true
	}
	k := name
	for _, o := range owners {
		k += "\x00" + o
	}
	if id, ok := t.refIDs[k]; ok {
		return id, true
	}
	refs := *t.refs.Load()
	if len(refs) >= 1<<16 {
		return 0, false
	}
	nrefs := append(refs[:len(refs):len(refs)], &ref{name: name, owners: append([]string(nil), owners...)})
	t.refs.Store(&nrefs)
	id := uint16(len(nrefs) - 1)
	t.refIDs[k] = id
	return id, true
}

// pack encodes p; ok is false if it does not fit (epoch or too many shards).
func (t *table) pack(p schema.Placement) (uint64, bool) {
	if p.Epoch > maxEpoch {
		return 0, false
	}
	owner, ok1 := t.intern(p.Shard, p.Owners)
	peerName := p.Target
	if p.Phase == schema.PhaseDraining {
		peerName = p.Source
	}
	peer, ok2 := t.intern(peerName, nil)
	ph := phaseCode(p.Phase)
	if !ok1 || !ok2 || ph == 0 {
		return 0, false
	}
	v := uint64(owner) | uint64(peer)<<16 | ph<<phaseShift | p.Epoch<<epochShift
	if p.Pinned {
		v |= pinnedBit
	}
	return v, true
}

// find returns the entry for key in the current index, or nil.
func (t *table) find(ix *index, key string, h uint32) *entry {
	for i := h & ix.mask; ; i = (i + 1) & ix.mask {
		s := ix.slots[i].Load()
		if s == 0 {
			return nil
		}
		e := &ix.chunks[(s-1)>>chunkBits][(s-1)&(chunkSize-1)]
		if e.hash == h && int(e.keyLen) == len(key) {
			if k, _ := e.keyIn(ix.arena); k == key {
				return e
			}
		}
	}
}

// set stores a packed value for key (v == 0 deletes) and returns the previous packed value.
func (t *table) set(key string, v, rev uint64) uint64 {
	h := t.hash(key)
	ix := t.idx.Load()
	if e := t.find(ix, key, h); e != nil {
		old := e.val.Load()
		t.account(key, old, v)
		switch {
		case old != 0 && v == 0:
			t.tombstones++
		case old == 0 && v != 0:
			t.tombstones--
		}
		e.rev.Store(rev)
		e.val.Store(v)
		return old
	}
	if v == 0 {
		return 0
	}
	t.insert(ix, key, h, v, rev)
	t.account(key, 0, v)
	return 0
}

// account keeps live, tombstone, per-owner and takeover counts, and the takeover set, as key's
// value changes from old to v.
func (t *table) account(key string, old, v uint64) {
	refs := *t.refs.Load()
	if old != 0 {
		refs[uint16(old)].count.Add(-1)
		t.live--
	}
	if v != 0 {
		refs[uint16(v)].count.Add(1)
		t.live++
	}
	was, is := old != 0 && inTakeover(old), v != 0 && inTakeover(v)
	if was == is {
		return
	}
	t.heldMu.Lock()
	defer t.heldMu.Unlock()
	if is {
		t.held[key] = struct{}{}
		t.takeovers.Add(1)
	} else {
		delete(t.held, key)
		t.takeovers.Add(-1)
	}
}

// heldTenants returns the tenants in a takeover (a copy; their placements may change after).
func (t *table) heldTenants() []string {
	if t.takeovers.Load() == 0 {
		return nil
	}
	t.heldMu.Lock()
	defer t.heldMu.Unlock()
	return slices.AppendSeq(make([]string, 0, len(t.held)), maps.Keys(t.held))
}

// insert appends a new entry and publishes it; it grows or compacts the index as needed.
func (t *table) insert(ix *index, key string, h uint32, v, rev uint64) {
	if int(ix.n+1)*4 > len(ix.slots)*maxLoad {
		ix = t.rebuild(ix, len(ix.slots)*2)
	}
	nix := *ix
	if nix.n == uint32(len(nix.chunks))*chunkSize {
		nix.chunks = append(nix.chunks[:len(nix.chunks):len(nix.chunks)], new([chunkSize]entry))
	}
	if len(key) > inlineKey && len(nix.arena)+len(key) > cap(nix.arena) {
		na := make([]byte, len(nix.arena), 2*cap(nix.arena)+len(key)+1024)
		copy(na, nix.arena)
		nix.arena = na
	}
	e := &nix.chunks[nix.n>>chunkBits][nix.n&(chunkSize-1)]
	e.hash = h
	nix.arena = e.setKey(key, nix.arena)
	e.rev.Store(rev)
	e.val.Store(v)
	nix.n++
	t.idx.Store(&nix)
	for i := h & nix.mask; ; i = (i + 1) & nix.mask {
		if nix.slots[i].Load() == 0 {
			nix.slots[i].Store(nix.n) // entry index + 1
			return
		}
	}
}

// rebuild makes a fresh index of nslots slots holding only live entries, and publishes it.
// Readers on the old index keep a consistent (if older) view.
func (t *table) rebuild(ix *index, nslots int) *index {
	for t.live*4 > nslots*maxLoad/2 {
		nslots *= 2
	}
	if nslots < 16 {
		nslots = 16
	}
	nix := &index{slots: make([]atomic.Uint32, nslots), mask: uint32(nslots - 1)}
	arenaSize := 0
	for i := uint32(0); i < ix.n; i++ {
		e := &ix.chunks[i>>chunkBits][i&(chunkSize-1)]
		if e.val.Load() != 0 && e.keyLen > inlineKey {
			arenaSize += int(e.keyLen)
		}
	}
	nix.arena = make([]byte, 0, arenaSize+arenaSize/2)
	for i := uint32(0); i < ix.n; i++ {
		e := &ix.chunks[i>>chunkBits][i&(chunkSize-1)]
		v := e.val.Load()
		if v == 0 {
			continue
		}
		if nix.n == uint32(len(nix.chunks))*chunkSize {
			nix.chunks = append(nix.chunks, new([chunkSize]entry))
		}
		ne := &nix.chunks[nix.n>>chunkBits][nix.n&(chunkSize-1)]
		ne.hash = e.hash
		k, _ := e.keyIn(ix.arena)
		nix.arena = ne.setKey(k, nix.arena)
		ne.rev.Store(e.rev.Load())
		ne.val.Store(v)
		nix.n++
		for j := e.hash & nix.mask; ; j = (j + 1) & nix.mask {
			if nix.slots[j].Load() == 0 {
				nix.slots[j].Store(nix.n)
				break
			}
		}
	}
	t.tombstones = 0
	t.idx.Store(nix)
	return nix
}

// rangeAll calls fn for every placement until fn returns false. Readers may call it while the
// writer runs: it walks the index it loaded, whose entries are complete, and so sees each
// placement at its value then or later.
func (t *table) rangeAll(fn func(key string, e Entry) bool) {
	ix := t.idx.Load()
	for i := uint32(0); i < ix.n; i++ {
		en := &ix.chunks[i>>chunkBits][i&(chunkSize-1)]
		e, ok := t.decode(en.val.Load(), en.rev.Load())
		if !ok {
			continue
		}
		k, _ := en.keyIn(ix.arena)
		if !fn(k, e) {
			return
		}
	}
}

// inTakeover reports whether packed value v is a placement in a takeover.
func inTakeover(v uint64) bool { return (v>>phaseShift)&7 == takeoverCode }

// takeoverCode is PhaseTakeover's code in a packed value.
var takeoverCode = phaseCode(schema.PhaseTakeover)

// len is the number of live placements.
func (t *table) len() int { return t.live }

// forEach calls fn for every live placement (writer goroutine only).
func (t *table) forEach(fn func(key string, v, rev uint64)) {
	ix := t.idx.Load()
	for i := uint32(0); i < ix.n; i++ {
		e := &ix.chunks[i>>chunkBits][i&(chunkSize-1)]
		if v := e.val.Load(); v != 0 {
			k, _ := e.keyIn(ix.arena)
			fn(k, v, e.rev.Load())
		}
	}
}

// shardCounts returns live placements per owner name (affinity owner sets count per set).
func (t *table) shardCounts() map[string]int {
	out := map[string]int{}
	for _, r := range (*t.refs.Load())[1:] {
		if n := r.count.Load(); n > 0 {
			out[r.name] += int(n)
		}
	}
	return out
}
