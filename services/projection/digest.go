package projection

import (
	"context"
	"errors"
	"fmt"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Move verification (shardkit's Digest hook): a tenant's views at an applied sequence, as a
// digest of every row of both views. The digest is kept as rows change (an account row's hash
// out and in again, a transaction's in: three hashes per event), so reading it costs nothing;
// and while a move involves the tenant its value after each applied sequence is kept too, since
// the views go on applying events after the fence (the aggregate keeps writing while only the
// projection moves): the source takes its digest at its fence (Fence), the target looks up the
// fence's in that history (Digest).

// ringMax bounds the history kept while a tenant moves: a target that ran further ahead of its
// source's fence than this many of the tenant's events leaves the move unverified.
const ringMax = 4096

// viewDigest is a tenant's views reduced to a digest; the caller holds the tenant's lock.
type viewDigest struct {
	acc, tx schema.DigestSet
	buf     schema.RowEncoder
	ring    []digestAt // after each applied sequence, while kept (nil: not kept)
	fenced  *digestAt  // at the source's fence
	source  bool       // fenced as a move's source: released by shardkit, not by the watch
}

// digestAt is the views' digest after applied sequence seq.
type digestAt struct {
	seq     uint64
	acc, tx schema.DigestSet
}

func (d *viewDigest) accountRow(a *AccountRow) schema.RowEncoder {
	d.buf = d.buf[:0].String(a.ID).String(a.Owner).Int(a.Balance).Bool(a.Closed).Uint(a.Version).Uint(a.LastSeq).Time(a.OpenedAt).Time(a.UpdatedAt)
	return d.buf
}

func (d *viewDigest) txRow(t *TxRow) schema.RowEncoder {
	d.buf = d.buf[:0].Uint(t.Seq).String(t.Account).String(t.Kind).Int(t.Amount).Time(t.At)
	return d.buf
}

func (d *viewDigest) addAccount(a *AccountRow)    { d.acc.Add(d.accountRow(a)) }
func (d *viewDigest) removeAccount(a *AccountRow) { d.acc.Sub(d.accountRow(a)) }
func (d *viewDigest) addTx(t *TxRow)              { d.tx.Add(d.txRow(t)) }

// reset makes the digest of ts's views from scratch (after its stored views were loaded).
func (d *viewDigest) reset(ts *tenantState) {
	d.acc, d.tx = schema.DigestSet{}, schema.DigestSet{}
	for _, a := range ts.accounts {
		d.addAccount(a)
	}
	for i := range ts.txs {
		d.addTx(&ts.txs[i])
	}
	if d.ring != nil {
		d.ring = append(d.ring[:0], d.now(ts.applied))
	}
}

func (d *viewDigest) now(seq uint64) digestAt { return digestAt{seq: seq, acc: d.acc, tx: d.tx} }

// advanced notes that seq is applied.
func (d *viewDigest) advanced(seq uint64) {
	if d.ring == nil {
		return
	}
	if len(d.ring) == ringMax {
		d.ring = append(d.ring[:0], d.ring[ringMax/2:]...)
	}
	d.ring = append(d.ring, d.now(seq))
}

// keep starts keeping the digest's history, from applied on.
func (d *viewDigest) keep(applied uint64) {
	if d.ring == nil {
		d.ring = append(make([]digestAt, 0, 64), d.now(applied))
	}
}

// at is the digest after sequence seq, given the views are at applied now.
func (d *viewDigest) at(seq, applied uint64) (digestAt, bool) {
	if d.fenced != nil && d.fenced.seq == seq {
		return *d.fenced, true
	}
	if seq == applied {
		return d.now(applied), true
	}
	if seq > applied || len(d.ring) == 0 || d.ring[0].seq > seq {
		return digestAt{}, false
	}
	// The views change only at the tenant's applied sequences: the digest after seq is the
	// one after the last of them at or below it.
	best := d.ring[0]
	for _, e := range d.ring {
		if e.seq > seq {
			break
		}
		best = e
	}
	return best, true
}

// Fence is the sequence a move's source reports at handoff: its applied sequence (what it
// served). The views' digest there is taken at once, as they go on applying events. shardkit
// hook.
func (s *Service) Fence(tenant string) uint64 {
	ts := s.lookup(tenant)
	if ts == nil {
		return 0
	}
	ts.mu.Lock()
	defer ts.mu.Unlock()
	f := ts.dig.now(ts.applied)
	ts.dig.fenced, ts.dig.source = &f, true
	return ts.applied
}

// heldAsSource reports whether the tenant was fenced here as a move's source and not released
// since: shardkit releases it (Release) when the move ends, or holds it on a verification
// mismatch; the placement watch must not drop it behind shardkit's back.
func (ts *tenantState) heldAsSource() bool {
	ts.mu.RLock()
	defer ts.mu.RUnlock()
	return ts.dig.source
}

// errNoDigest means the views are not, and were not recently, at the sequence asked for.
var errNoDigest = errors.New("projection: the views' digest at that sequence is not known here")

// Digest is the tenant's views at applied sequence at, as a digest of both views. shardkit
// hook: on a move's source at its fence, on its target once warmed up to it.
func (s *Service) Digest(_ context.Context, tenant string, at uint64) (schema.Digest, error) {
	ts := s.lookup(tenant)
	if ts == nil {
		return schema.Digest{}, fmt.Errorf("projection: %s is not hosted here", tenant)
	}
	select {
	case <-ts.caught:
	default:
		return schema.Digest{}, fmt.Errorf("projection: %s is still catching up", tenant)
	}
	ts.mu.Lock()
	defer ts.mu.Unlock()
	d, ok := ts.dig.at(at, ts.applied)
	ts.dig.ring, ts.dig.fenced = nil, nil // asked once per move: what was kept for it is done
	if !ok {
		return schema.Digest{}, fmt.Errorf("%w: %s is at %d, asked for %d", errNoDigest, tenant, ts.applied, at)
	}
	return schema.NewDigest(at, d.acc.Part("accounts"), d.tx.Part("transactions")), nil
}
