package jsx

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Records are the JSON values of one bucket: read with a direct get or from the bucket's
// stream leader, written unconditionally or by compare-and-set, listed in full, and leases kept
// the same way. The store's buckets (placements, kinds, the directory, routes, signals) and
// the rebalancer's plans and moves are records.
type Records struct {
	c  *Client
	kv jetstream.KeyValue
}

// Records are kv's values as JSON records.
func (c *Client) Records(kv jetstream.KeyValue) *Records { return &Records{c: c, kv: kv} }

// KV is the bucket the records are in.
func (r *Records) KV() jetstream.KeyValue { return r.kv }

// Create writes v under key only if the key is absent (CompareAndSet at revision 0).
func (r *Records) Create(ctx context.Context, key string, v any) (uint64, error) {
	return r.CompareAndSet(ctx, key, 0, v)
}

// Update replaces the record at key if its revision is still rev. Unlike CompareAndSet it
// refuses revision 0: an update of a record not read is a mistake (Create makes a record).
func (r *Records) Update(ctx context.Context, key string, rev uint64, v any) (uint64, error) {
	if rev == 0 {
		return 0, fmt.Errorf("%s/%s: an update needs the revision read (Create makes a record)", r.kv.Bucket(), key)
	}
	return r.CompareAndSet(ctx, key, rev, v)
}

// List calls fn with the raw JSON of every record under filter (for example "plan.*").
func (r *Records) List(ctx context.Context, filter string, fn func(key string, rev uint64, raw json.RawMessage)) error {
	_, err := ListJSON(ctx, r, filter, fn)
	return err
}

// ErrLeaseHeld means another holder has the lease.
var ErrLeaseHeld = errors.New("lease held by another holder")

// Lease is a named, expiring claim held by one holder, kept as a record by compare-and-set.
type Lease struct {
	Name     string    `json:"name"`
	Holder   string    `json:"holder"`
	Acquired time.Time `json:"acquired"`
	Expires  time.Time `json:"expires"`

	Revision uint64 `json:"-"`
}

// AcquireLease takes the lease for holder for ttl if it is free, expired or already holder's.
// Otherwise it fails with an error wrapping ErrLeaseHeld that names the holder.
func (r *Records) AcquireLease(ctx context.Context, name, holder string, ttl time.Duration) (Lease, error) {
	now := time.Now().UTC()
	l := Lease{Name: name, Holder: holder, Acquired: now, Expires: now.Add(ttl)}
	var cur Lease
	rev, err := r.Latest(ctx, name, &cur)
	switch {
	case errors.Is(err, ErrNotFound):
		rev = 0
	case errors.Is(err, ErrCorrupt):
		// A corrupt lease is replaced by CAS on its revision.
	case err != nil:
		return Lease{}, err
	default:
		if cur.Holder != holder && now.Before(cur.Expires) {
			return cur, fmt.Errorf("%w: %s is held by %s until %s", ErrLeaseHeld, name, cur.Holder, cur.Expires.Format(time.RFC3339))
		}
		if cur.Holder == holder {
			l.Acquired = cur.Acquired
		}
	}
	nrev, err := r.CompareAndSet(ctx, name, rev, l)
	if err != nil {
		if errors.Is(err, ErrConflict) {
			return Lease{}, fmt.Errorf("%w: %s was taken by another holder just now", ErrLeaseHeld, name)
		}
		return Lease{}, err
	}
	l.Revision = nrev
	return l, nil
}

// RenewLease extends a held lease by ttl. If someone else took it meanwhile, the error wraps
// ErrLeaseHeld and the caller must stop acting as holder.
func (r *Records) RenewLease(ctx context.Context, l Lease, ttl time.Duration) (Lease, error) {
	l.Expires = time.Now().UTC().Add(ttl)
	rev, err := r.CompareAndSet(ctx, l.Name, l.Revision, l)
	if err != nil {
		if errors.Is(err, ErrConflict) {
			return Lease{}, fmt.Errorf("%w: %s was lost", ErrLeaseHeld, l.Name)
		}
		return Lease{}, err
	}
	l.Revision = rev
	return l, nil
}

// ReleaseLease gives the lease up if it is still held as l.
func (r *Records) ReleaseLease(ctx context.Context, l Lease) error {
	err := r.Delete(ctx, l.Name, l.Revision)
	if errors.Is(err, ErrConflict) {
		return nil // already someone else's
	}
	return err
}
