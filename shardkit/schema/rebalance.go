package schema

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// Keys in tm_rebalance.
const (
	// LeaderLease is the key of the rebalancer's leader lease.
	LeaderLease = "lease.leader"
)

// PlanKey is the key of a plan record.
func PlanKey(id string) string { return "plan." + id }

// MoveKey is the key of one move's workflow record.
func MoveKey(plan, move string) string { return "move." + plan + "." + move }

// MovesOf is the watch/list filter for every move of a plan.
func MovesOf(plan string) string { return "move." + plan + ".*" }

// GetRecord reads a tm_rebalance record into v and returns its revision. It reads from the
// bucket's stream leader, so a record whose write was acknowledged (a plan just created, by
// this process or another) is always found: a direct get may be answered by a replica that
// has not applied it yet. While the stream has no leader it fails with ErrUnavailable.
func (s *Store) GetRecord(ctx context.Context, key string, v any) (uint64, error) {
	return s.getLeaderJSON(ctx, s.rebalance, key, v)
}

// CreateRecord writes v under key only if the key is absent.
func (s *Store) CreateRecord(ctx context.Context, key string, v any) (uint64, error) {
	return s.casJSON(ctx, s.rebalance, key, 0, v)
}

// UpdateRecord replaces the record at key if its revision is still rev.
func (s *Store) UpdateRecord(ctx context.Context, key string, rev uint64, v any) (uint64, error) {
	if rev == 0 {
		return 0, fmt.Errorf("%w: %s: update needs the revision read", ErrInvalid, key)
	}
	return s.casJSON(ctx, s.rebalance, key, rev, v)
}

// DeleteRecord removes the record at key (rev 0: unconditionally).
func (s *Store) DeleteRecord(ctx context.Context, key string, rev uint64) error {
	return s.deleteKey(ctx, s.rebalance, key, rev)
}

// ListRecords calls fn with the raw JSON of every record under filter (for example "plan.*").
func (s *Store) ListRecords(ctx context.Context, filter string, fn func(key string, rev uint64, raw json.RawMessage)) error {
	_, err := listJSON(ctx, s, s.rebalance, filter, fn)
	return err
}

// Lease is a named, expiring claim held by one holder, kept in tm_rebalance by CAS.
type Lease struct {
	Name     string    `json:"name"`
	Holder   string    `json:"holder"`
	Acquired time.Time `json:"acquired"`
	Expires  time.Time `json:"expires"`

	Revision uint64 `json:"-"`
}

// AcquireLease takes the lease for holder for ttl if it is free, expired or already holder's.
// Otherwise it fails with an error wrapping ErrLeaseHeld that names the holder.
func (s *Store) AcquireLease(ctx context.Context, name, holder string, ttl time.Duration) (Lease, error) {
	now := time.Now().UTC()
	l := Lease{Name: name, Holder: holder, Acquired: now, Expires: now.Add(ttl)}
	var cur Lease
	rev, err := s.getLeaderJSON(ctx, s.rebalance, name, &cur)
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
	nrev, err := s.casJSON(ctx, s.rebalance, name, rev, l)
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
func (s *Store) RenewLease(ctx context.Context, l Lease, ttl time.Duration) (Lease, error) {
	l.Expires = time.Now().UTC().Add(ttl)
	rev, err := s.casJSON(ctx, s.rebalance, l.Name, l.Revision, l)
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
func (s *Store) ReleaseLease(ctx context.Context, l Lease) error {
	err := s.deleteKey(ctx, s.rebalance, l.Name, l.Revision)
	if errors.Is(err, ErrConflict) {
		return nil // already someone else's
	}
	return err
}
