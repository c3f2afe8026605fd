package schema

import (
	"errors"

	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
)

var (
	// ErrInvalidTenant means a tenant id is not 1-128 characters of [A-Za-z0-9_-].
	ErrInvalidTenant = errors.New("invalid tenant id")
	// ErrInvalidName means a kind, shard or instance name is not a valid token.
	ErrInvalidName = errors.New("invalid name")
	// ErrUnknownKind means the kind is not registered in tm_kinds.
	ErrUnknownKind = errors.New("unknown kind")
	// ErrTransition means a placement change breaks the move state machine or the epoch rules.
	ErrTransition = errors.New("invalid placement transition")
	// ErrInvalid means a value failed validation before it was written.
	ErrInvalid = errors.New("invalid value")
	// ErrFenced means a takeover fenced this instance for a tenant: another shard owns it at a
	// newer epoch, and this one may neither write it nor answer for it. HTTP answers it 421
	// (not the owner), so a gateway sends the request again to the new owner.
	ErrFenced = errors.New("fenced by a newer owner")
)

// The store's reads and writes fail with the JetStream layer's errors; they are named here too,
// so a caller of the store needs no other import to tell them apart.
var (
	// ErrNotFound means the key holds no value.
	ErrNotFound = jsx.ErrNotFound
	// ErrConflict means a compare-and-set lost (a *ConflictError).
	ErrConflict = jsx.ErrConflict
	// ErrCorrupt means a stored value could not be decoded.
	ErrCorrupt = jsx.ErrCorrupt
	// ErrUnavailable means NATS could not serve a call for now; see jsx.ErrUnavailable.
	ErrUnavailable = jsx.ErrUnavailable
	// ErrLeaseHeld means another holder has the lease.
	ErrLeaseHeld = jsx.ErrLeaseHeld

	// IsUnavailable reports whether err is a NATS failure that may pass by itself: HTTP
	// answers these 503 with Retry-After.
	IsUnavailable = jsx.IsUnavailable
	// IsConflict reports whether err is a compare-and-set write losing.
	IsConflict = jsx.IsConflict
)

// ConflictError reports a lost compare-and-set.
type ConflictError = jsx.ConflictError
