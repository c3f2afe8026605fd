package schema

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
)

// Move verification (Vitess's VDiff for a move): at a move's fence, every instance of the
// source shard and of the target shard records a digest of the tenant's state there (the
// service's Digest hook), key <kind>.<tenant>.<epoch>.<role>.<shard>.<instance> in tm_verify;
// a verdict compares the target's digests with the source's. A record lives DigestTTL.

// BucketVerify holds the state digests move parties record at a move's fence.
const BucketVerify = "tm_verify"

// DigestTTL is how long a digest record is kept: long enough to verify a plan days later.
const DigestTTL = 7 * 24 * time.Hour

// digestFormat is written in every record; a record of a newer format is refused.
const digestFormat = 1

// Roles of a digest record.
const (
	RoleSource = "source"
	RoleTarget = "target"
)

// Digest is a tenant's state at one sequence, reduced to a sum that two instances holding the
// same state compute alike whatever order they hold it in.
type Digest struct {
	// At is the sequence the state is at (the service's applied sequence; 0 for a service
	// without one, such as the runner).
	At uint64 `json:"at"`
	// Sum is the digest of every part (hex); Items counts what it covers (rows, accounts,
	// queue entries).
	Sum   string `json:"sum"`
	Items int    `json:"items"`
	// Parts are the digests of the state's parts ("accounts", "transactions", "queue",
	// "outbox"), so a mismatch says where it is.
	Parts []DigestPart `json:"parts,omitempty"`
}

// DigestPart is one part of a Digest.
type DigestPart struct {
	Name  string `json:"name"`
	Sum   string `json:"sum"`
	Items int    `json:"items"`
}

// Part returns the named part (ok false if absent).
func (d Digest) Part(name string) (DigestPart, bool) {
	for _, p := range d.Parts {
		if p.Name == name {
			return p, true
		}
	}
	return DigestPart{}, false
}

// DigestSet builds an order-independent digest of a set of rows: the sum (mod 2^64) of each
// row's 64-bit xxhash. A row can be removed again (Sub), so a service can keep the digest of a
// changing set as it changes, at the cost of two hashes per changed row. The zero value is
// the empty set.
type DigestSet struct {
	sum uint64
	n   int
}

// Add puts row in the set.
func (d *DigestSet) Add(row []byte) { d.sum += xxhash.Sum64(row); d.n++ }

// Sub takes row out of the set (it must have been added).
func (d *DigestSet) Sub(row []byte) { d.sum -= xxhash.Sum64(row); d.n-- }

// Items is the number of rows in the set.
func (d DigestSet) Items() int { return d.n }

// Part is the set as a digest part.
func (d DigestSet) Part(name string) DigestPart {
	return DigestPart{Name: name, Sum: strconv.FormatUint(d.sum, 16), Items: d.n}
}

// NewDigest makes the Digest at sequence at of parts: its sum covers every part's name and sum.
func NewDigest(at uint64, parts ...DigestPart) Digest {
	d := Digest{At: at, Parts: parts}
	var sum uint64
	for _, p := range parts {
		v, _ := strconv.ParseUint(p.Sum, 16, 64)
		sum += xxhash.Sum64String(p.Name) ^ v
		d.Items += p.Items
	}
	d.Sum = strconv.FormatUint(sum, 16)
	return d
}

// RowEncoder appends a row's fields to a buffer in a fixed binary form, for DigestSet.
type RowEncoder []byte

// String appends s, length first.
func (e RowEncoder) String(s string) RowEncoder {
	return append(binary.AppendUvarint(e, uint64(len(s))), s...)
}

// Uint appends v.
func (e RowEncoder) Uint(v uint64) RowEncoder { return binary.BigEndian.AppendUint64(e, v) }

// Int appends v.
func (e RowEncoder) Int(v int64) RowEncoder { return e.Uint(uint64(v)) }

// Bool appends v.
func (e RowEncoder) Bool(v bool) RowEncoder {
	if v {
		return append(e, 1)
	}
	return append(e, 0)
}

// Time appends t as Unix nanoseconds (its location and monotonic reading do not count).
func (e RowEncoder) Time(t time.Time) RowEncoder {
	if t.IsZero() {
		return e.Int(math.MinInt64)
	}
	return e.Int(t.UnixNano())
}

// DigestRecord is what one instance recorded about a tenant at a move's fence, key
// <kind>.<tenant>.<epoch>.<role>.<shard>.<instance> in tm_verify.
type DigestRecord struct {
	Format   int    `json:"format"`
	Kind     string `json:"kind"`
	Tenant   string `json:"tenant"`
	Shard    string `json:"shard"`
	Instance string `json:"instance"`
	// Role is RoleSource or RoleTarget.
	Role string `json:"role"`
	// Epoch is the move's handoff epoch (the new owner serves at Epoch+1).
	Epoch uint64 `json:"epoch"`
	// Fence is the sequence the handoff fenced at: what the source reported, and what the
	// target warmed up to.
	Fence uint64 `json:"fence"`
	// Digest is the state's digest at Fence; nil with Error when the instance could not make
	// it (its state had moved on, it did not host the tenant).
	Digest *Digest `json:"digest,omitempty"`
	Error  string  `json:"error,omitempty"`
	// TookMicros is how long the digest took to make.
	TookMicros int64     `json:"took_us"`
	Recorded   time.Time `json:"recorded"`
}

func digestKey(kind, tenant string, epoch uint64, role, shard, instance string) string {
	return kind + "." + tenant + "." + strconv.FormatUint(epoch, 10) + "." + role + "." + shard + "." + instance
}

// DigestFilter matches the records of one handoff: <kind>.<tenant>.<epoch>.>.
func DigestFilter(kind, tenant string, epoch uint64) string {
	return kind + "." + tenant + "." + strconv.FormatUint(epoch, 10) + ".>"
}

// Digests is the handle on the moves' state digests, the bucket tm_verify:
// store.Digests().Put(ctx, rec).
type Digests struct{ s *Store }

// Digests is the handle on the moves' state digests.
func (s *Store) Digests() Digests { return Digests{s} }

// KV opens tm_verify, creating it unless the store attaches. A store that attaches and finds no
// bucket (a rebalancer older than move verification) gets ErrNotFound at once: digests are then
// simply not recorded.
func (ds Digests) KV(ctx context.Context) (jetstream.KeyValue, error) {
	s := ds.s
	s.verifyMu.Lock()
	defer s.verifyMu.Unlock()
	if s.verify != nil {
		return s.verify, nil
	}
	var kv jetstream.KeyValue
	var err error
	if s.opts.Attach {
		ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		kv, err = s.js.JetStream().KeyValue(ctx, BucketVerify)
		if errors.Is(err, jetstream.ErrBucketNotFound) {
			return nil, fmt.Errorf("schema: %s is not provisioned: %w", BucketVerify, ErrNotFound)
		}
	} else {
		kv, err = s.js.EnsureKV(ctx, jsx.KVSpec{Bucket: BucketVerify, Description: "tenantmesh move verification: state digests at each move's fence", PerKeyTTL: true})
	}
	if err != nil {
		return nil, fmt.Errorf("schema: open %s: %w", BucketVerify, err)
	}
	s.verify = kv
	return kv, nil
}

// Put writes rec (overwriting an earlier record of the same instance at the same epoch: an
// aborted move's), to be removed DigestTTL later.
func (ds Digests) Put(ctx context.Context, rec DigestRecord) error {
	s := ds.s
	if err := CheckTenant(rec.Tenant); err != nil {
		return err
	}
	id := InstanceID{Kind: rec.Kind, Shard: rec.Shard, Instance: rec.Instance}
	if err := id.Check(); err != nil {
		return err
	}
	if rec.Role != RoleSource && rec.Role != RoleTarget {
		return fmt.Errorf("%w: digest record role %q is not %s or %s", ErrInvalid, rec.Role, RoleSource, RoleTarget)
	}
	kv, err := ds.KV(ctx)
	if err != nil {
		return err
	}
	rec.Format = digestFormat
	if rec.Recorded.IsZero() {
		rec.Recorded = time.Now().UTC()
	}
	b, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, s.opts.Timeout)
	defer cancel()
	subj := jsx.KVSubject(kv.Bucket(), digestKey(rec.Kind, rec.Tenant, rec.Epoch, rec.Role, rec.Shard, rec.Instance))
	if _, err := s.js.JetStream().PublishMsg(ctx, &nats.Msg{Subject: subj, Data: b}, jetstream.WithMsgTTL(DigestTTL)); err != nil {
		return fmt.Errorf("schema: record digest of %s/%s: %w", rec.Kind, rec.Tenant, err)
	}
	return nil
}

// ErrNewerFormat is a record written by a newer binary than this one (jsx.ErrNewerFormat:
// every record carries a format).
var ErrNewerFormat = jsx.ErrNewerFormat

// List lists the records of one handoff of kind's tenant at epoch.
func (ds Digests) List(ctx context.Context, kind, tenant string, epoch uint64) ([]DigestRecord, error) {
	if err := CheckTenant(tenant); err != nil {
		return nil, err
	}
	if err := CheckName("kind", kind); err != nil {
		return nil, err
	}
	kv, err := ds.KV(ctx)
	if err != nil {
		return nil, err
	}
	var out []DigestRecord
	var newer error
	_, err = jsx.ListJSON(ctx, ds.s.js.Records(kv), DigestFilter(kind, tenant, epoch), func(key string, _ uint64, r DigestRecord) {
		if r.Format > digestFormat {
			newer = fmt.Errorf("schema: %s/%s format %d: %w", BucketVerify, key, r.Format, ErrNewerFormat)
			return
		}
		out = append(out, r)
	})
	if err == nil {
		err = newer
	}
	return out, err
}

// Verification results.
const (
	// VerifyMatch: every target instance's digest at the fence equals the source's.
	VerifyMatch = "match"
	// VerifyMismatch: a target instance's state at the fence differs from the source's.
	VerifyMismatch = "mismatch"
	// VerifyUnverified: the records do not allow a comparison (no digest from the source at
	// the fence: a takeover, a source that had died; none from the target; a service without
	// a Digest hook).
	VerifyUnverified = "unverified"
)

// Verdict is the comparison of one handoff's digests.
type Verdict struct {
	Result string `json:"result"`
	// Fence is the sequence compared at.
	Fence uint64 `json:"fence"`
	// Source and Target are the digests compared: one per instance of each side.
	Source []DigestRecord `json:"source,omitempty"`
	Target []DigestRecord `json:"target,omitempty"`
	// Detail says why, in words: which instance differs and in which part.
	Detail string `json:"detail"`
}

// CompareDigests judges one handoff from its records: the target shard to's records at the
// fence it warmed up to (the highest, should an aborted attempt at the same epoch have left
// older ones) against the source shard from's at that fence. It is a match when every target
// instance's digest equals a source instance's; source instances that disagree among
// themselves are named in Detail (the runner's siblings may stop acquiring a moment apart).
func CompareDigests(recs []DigestRecord, from, to string) Verdict {
	var tgt, src []DigestRecord
	var fence uint64
	for _, r := range recs {
		if r.Role == RoleTarget && r.Shard == to {
			fence = max(fence, r.Fence)
		}
	}
	for _, r := range recs {
		switch {
		case r.Role == RoleTarget && r.Shard == to && r.Fence == fence:
			tgt = append(tgt, r)
		case r.Role == RoleSource && r.Shard == from && r.Fence == fence:
			src = append(src, r)
		}
	}
	byInst := func(a, b DigestRecord) int { return strings.Compare(a.Instance, b.Instance) }
	slices.SortFunc(tgt, byInst)
	slices.SortFunc(src, byInst)
	v := Verdict{Result: VerifyUnverified, Fence: fence, Source: src, Target: tgt}
	if len(tgt) == 0 {
		v.Detail = "no digest from the target " + to
		return v
	}
	sums := map[string]DigestRecord{}
	var srcErrs []string
	for _, r := range src {
		if r.Digest == nil {
			srcErrs = append(srcErrs, r.Instance+": "+r.Error)
			continue
		}
		if _, ok := sums[r.Digest.Sum]; !ok {
			sums[r.Digest.Sum] = r
		}
	}
	if len(sums) == 0 {
		v.Detail = fmt.Sprintf("no digest from the source %s at fence %d", from, fence)
		if len(srcErrs) > 0 {
			v.Detail += " (" + strings.Join(srcErrs, "; ") + ")"
		}
		return v
	}
	var bad, skipped []string
	for _, r := range tgt {
		if r.Digest == nil {
			skipped = append(skipped, r.Instance+": "+r.Error)
			continue
		}
		if _, ok := sums[r.Digest.Sum]; ok {
			continue
		}
		bad = append(bad, describeMismatch(r, src))
	}
	switch {
	case len(bad) > 0:
		v.Result = VerifyMismatch
		v.Detail = strings.Join(bad, "; ")
	case len(skipped) == len(tgt):
		v.Detail = "the target made no digest (" + strings.Join(skipped, "; ") + ")"
		return v
	default:
		v.Result = VerifyMatch
		v.Detail = fmt.Sprintf("%d target instance(s) equal the source at fence %d", len(tgt)-len(skipped), fence)
	}
	if len(skipped) > 0 {
		v.Detail += "; not compared: " + strings.Join(skipped, "; ")
	}
	if len(sums) > 1 {
		v.Detail += fmt.Sprintf("; the source's instances disagree (%d digests)", len(sums))
	}
	return v
}

// describeMismatch names a target record's differences from the first source digest: the
// parts whose sums differ, with their item counts.
func describeMismatch(t DigestRecord, src []DigestRecord) string {
	var ref *Digest
	for _, s := range src {
		if s.Digest != nil {
			ref = s.Digest
			break
		}
	}
	var parts []string
	for _, p := range ref.Parts {
		q, ok := t.Digest.Part(p.Name)
		switch {
		case !ok:
			parts = append(parts, p.Name+" missing")
		case q.Sum != p.Sum:
			parts = append(parts, fmt.Sprintf("%s (%d items, source %d)", p.Name, q.Items, p.Items))
		}
	}
	sort.Strings(parts)
	what := strings.Join(parts, ", ")
	if what == "" {
		what = fmt.Sprintf("sum %s, source %s", t.Digest.Sum, ref.Sum)
	}
	return fmt.Sprintf("target %s.%s differs from the source at %d: %s", t.Shard, t.Instance, t.Digest.At, what)
}
