package schema

import (
	"errors"
	"fmt"
)

var (
	// ErrNotFound means the key holds no value.
	ErrNotFound = errors.New("not found")
	// ErrConflict means a compare-and-set lost: the key changed since it was read.
	// Errors returned for it are *ConflictError and match ErrConflict with errors.Is.
	ErrConflict = errors.New("revision conflict")
	// ErrInvalidTenant means a tenant id is not 1-128 characters of [A-Za-z0-9_-].
	ErrInvalidTenant = errors.New("invalid tenant id")
	// ErrInvalidName means a kind, shard or instance name is not a valid token.
	ErrInvalidName = errors.New("invalid name")
	// ErrUnknownKind means the kind is not registered in tm_kinds.
	ErrUnknownKind = errors.New("unknown kind")
	// ErrTransition means a placement change breaks the move state machine or the epoch rules.
	ErrTransition = errors.New("invalid placement transition")
	// ErrCorrupt means a stored value could not be decoded.
	ErrCorrupt = errors.New("corrupt value")
	// ErrInvalid means a value failed validation before it was written.
	ErrInvalid = errors.New("invalid value")
	// ErrLeaseHeld means another holder has the lease.
	ErrLeaseHeld = errors.New("lease held by another holder")
)

// ConflictError reports a lost compare-and-set.
type ConflictError struct {
	Bucket   string
	Key      string
	Expected uint64 // the revision the caller read; 0 for a create
	Err      error  // the NATS error
}

func (e *ConflictError) Error() string {
	if e.Expected == 0 {
		return fmt.Sprintf("%s/%s: %v: the key already exists", e.Bucket, e.Key, ErrConflict)
	}
	return fmt.Sprintf("%s/%s: %v: expected revision %d, the key has changed since; read it again and retry", e.Bucket, e.Key, ErrConflict, e.Expected)
}

// Is makes errors.Is(err, ErrConflict) true.
func (e *ConflictError) Is(target error) bool { return target == ErrConflict }

func (e *ConflictError) Unwrap() error { return e.Err }
