package placement

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
)

// A compacted snapshot is one kind's whole table at one revision, in a compact binary form:
//
//	"TMPS" 1 | kind | revision | refs (name, owners) | count | entries | crc32
//
// with strings as uvarint length + bytes and numbers as uvarints. An entry is key, owner ref,
// peer ref, phase, pinned, epoch, revision. Loading one and following the bucket from its
// revision gives the same table as reading every key, much faster.
const snapshotMagic = "TMPS\x01"

var errSnapshot = errors.New("placement: bad snapshot")

// encodeSnapshot serializes the table; the caller holds the kind's writer lock.
func encodeSnapshot(kind string, rev uint64, t *table) []byte {
	refs := *t.refs.Load()
	b := make([]byte, 0, 64+t.len()*32)
	b = append(b, snapshotMagic...)
	b = appendString(b, kind)
	b = binary.AppendUvarint(b, rev)
	b = binary.AppendUvarint(b, uint64(len(refs)))
	for _, r := range refs {
		b = appendString(b, r.name)
		b = binary.AppendUvarint(b, uint64(len(r.owners)))
		for _, o := range r.owners {
			b = appendString(b, o)
		}
	}
	b = binary.AppendUvarint(b, uint64(t.len()))
	t.forEach(func(key string, v, erev uint64) {
		b = appendString(b, key)
		b = binary.AppendUvarint(b, v)
		b = binary.AppendUvarint(b, erev)
	})
	return binary.BigEndian.AppendUint32(b, crc32.ChecksumIEEE(b))
}

// decodeSnapshot builds a table from a snapshot of kind.
func decodeSnapshot(kind string, b []byte) (*table, uint64, error) {
	if len(b) < len(snapshotMagic)+4 || string(b[:len(snapshotMagic)]) != snapshotMagic {
		return nil, 0, fmt.Errorf("%w: not a v1 snapshot", errSnapshot)
	}
	body, sum := b[:len(b)-4], binary.BigEndian.Uint32(b[len(b)-4:])
	if crc32.ChecksumIEEE(body) != sum {
		return nil, 0, fmt.Errorf("%w: checksum mismatch", errSnapshot)
	}
	d := decoder{b: body[len(snapshotMagic):]}
	if k := d.str(); k != kind {
		return nil, 0, fmt.Errorf("%w: snapshot of kind %q, want %q", errSnapshot, k, kind)
	}
	rev := d.uint()
	nrefs := d.uint()
	if nrefs == 0 || nrefs > 1<<16 {
		return nil, 0, fmt.Errorf("%w: %d refs", errSnapshot, nrefs)
	}
	type refv struct {
		name   string
		owners []string
	}
	refs := make([]refv, nrefs)
	for i := range refs {
		refs[i].name = d.str()
		n := d.uint()
		if n > 1024 {
			return nil, 0, fmt.Errorf("%w: owner set of %d", errSnapshot, n)
		}
		for range n {
			refs[i].owners = append(refs[i].owners, d.str())
		}
	}
	count := d.uint()
	if d.err != nil || count > uint64(len(d.b)) {
		return nil, 0, fmt.Errorf("%w: truncated header", errSnapshot)
	}
	t := newTable(int(count))
	ids := make([]uint16, nrefs)
	for i := 1; i < len(refs); i++ {
		id, _ := t.intern(refs[i].name, refs[i].owners)
		ids[i] = id
	}
	for range count {
		key, v, erev := d.str(), d.uint(), d.uint()
		if d.err != nil {
			return nil, 0, fmt.Errorf("%w: truncated entries", errSnapshot)
		}
		owner, peer := uint16(v), uint16(v>>16)
		if int(owner) >= len(ids) || int(peer) >= len(ids) {
			return nil, 0, fmt.Errorf("%w: entry %q names ref %d of %d", errSnapshot, key, max(owner, peer), len(ids))
		}
		v = v&^0xffffffff | uint64(ids[owner]) | uint64(ids[peer])<<16
		t.set(key, v, erev)
	}
	if len(d.b) != 0 {
		return nil, 0, fmt.Errorf("%w: %d trailing bytes", errSnapshot, len(d.b))
	}
	return t, rev, nil
}

func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

type decoder struct {
	b   []byte
	err error
}

func (d *decoder) uint() uint64 {
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.err = errSnapshot
		d.b = nil
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *decoder) str() string {
	n := d.uint()
	if n > uint64(len(d.b)) {
		d.err = errSnapshot
		d.b = nil
		return ""
	}
	s := string(d.b[:n])
	d.b = d.b[n:]
	return s
}
