package jsx

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Records are JSON values in one bucket, written by compare-and-set and read from the bucket's
// stream leader, and leases kept the same way. The rebalancer's plans and moves are records.
type Records struct {
	c  *Client
	kv jetstream.KeyValue
}

// Records are kv's values as JSON records.
func (c *Client) Records(kv jetstream.KeyValue) *Records { return &Records{c: c, kv: kv} }

// Get reads the record at key into v and returns its revision. It reads from the bucket's
// stream leader, so a record whose write was acknowledged (a plan just created, by this process
// or another) is always found: a direct get may be answered by a replica that has not applied
// it yet. While the stream has no leader it fails with ErrUnavailable.
func (r *Records) Get(ctx context.Context, key string, v any) (uint64, error) {
	return r.c.LeaderGetJSON(ctx, r.kv, key, v)
}

// Create writes v under key only if the key is absent.
func (r *Records) Create(ctx context.Context, key string, v any) (uint64, error) {
	return r.c.UpdateJSON(ctx, r.kv, key, 0, v)
}

// Update replaces the record at key if its revision is still rev.
func (r *Records) Update(ctx context.Context, key string, rev uint64, v any) (uint64, error) {
	if rev == 0 {
		return 0, fmt.Errorf("%s/%s: an update needs the revision read (Create makes a record)", r.kv.Bucket(), key)
	}
	return r.c.UpdateJSON(ctx, r.kv, key, rev, v)
}

// Delete removes the record at key (rev 0: unconditionally).
func (r *Records) Delete(ctx context.Context, key string, rev uint64) error {
	return r.c.DeleteKey(ctx, r.kv, key, rev)
}

// List calls fn with the raw JSON of every record under filter (for example "plan.*").
func (r *Records) List(ctx context.Context, filter string, fn func(key string, rev uint64, raw json.RawMessage)) error {
	_, err := ListJSON(ctx, r.c, r.kv, filter, fn)
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
	rev, err := r.c.LeaderGetJSON(ctx, r.kv, name, &cur)
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
	nrev, err := r.c.UpdateJSON(ctx, r.kv, name, rev, l)
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
	rev, err := r.c.UpdateJSON(ctx, r.kv, l.Name, l.Revision, l)
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
	err := r.c.DeleteKey(ctx, r.kv, l.Name, l.Revision)
	if errors.Is(err, ErrConflict) {
		return nil // already someone else's
	}
	return err
}
