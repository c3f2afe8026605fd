package jsx

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

var (
	// ErrNotFound means the key holds no value.
	ErrNotFound = errors.New("not found")
	// ErrConflict means a compare-and-set lost: the key changed since it was read.
	// Errors returned for it are *ConflictError and match ErrConflict with errors.Is.
	ErrConflict = errors.New("revision conflict")
	// ErrCorrupt means a stored value could not be decoded.
	ErrCorrupt = errors.New("corrupt value")
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

// ErrUnavailable means NATS could not serve a call for now: no responders (a stream or consumer
// leader being elected, a server restarting, interest not yet propagated in the cluster), a
// timeout, or a connection being re-established. The store retries idempotent reads that fail
// so within its timeout; errors that still wrap ErrUnavailable are worth retrying a little later
// (HTTP answers them 503 with Retry-After). The NATS error stays wrapped too.
var ErrUnavailable = errors.New("NATS is temporarily unavailable")

// IsUnavailable reports whether err is a NATS failure that may pass by itself (see
// ErrUnavailable), whether it came through the store or straight from nats.go: HTTP answers
// these 503 with Retry-After. A cancelled context is not (the caller gave up).
func IsUnavailable(err error) bool { return transient(err) }

func transient(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) {
		return false
	}
	if errors.Is(err, ErrUnavailable) || errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, nats.ErrNoResponders) || errors.Is(err, nats.ErrTimeout) ||
		errors.Is(err, nats.ErrConnectionReconnecting) || errors.Is(err, nats.ErrDisconnected) ||
		errors.Is(err, nats.ErrReconnectBufExceeded) ||
		errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, jetstream.ErrNoHeartbeat) ||
		errors.Is(err, jetstream.ErrConsumerLeadershipChanged) || errors.Is(err, jetstream.ErrConsumerDeleted) ||
		errors.Is(err, jetstream.ErrConsumerNotFound) || errors.Is(err, jetstream.ErrServerShutdown) {
		return true
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		// 503: "JetStream system temporarily unavailable" (no meta or stream leader) and the like.
		// "Duplicate message id is in process": a try with the same message id, whose answer
		// this call stopped waiting for, is still being stored; the next try gets its ack.
		return apiErr.Code == 503 || apiErr.ErrorCode == jsErrClusterNotAvail ||
			apiErr.ErrorCode == jsErrClusterNotLeader || apiErr.ErrorCode == jsErrStreamOffline ||
			apiErr.ErrorCode == jsErrDuplicateInProcess
	}
	return false
}

// JetStream API error codes (nats-server's jserrors) that mean "try again shortly".
const (
	jsErrClusterNotAvail  jetstream.ErrorCode = 10008 // JetStream system temporarily unavailable
	jsErrClusterNotLeader jetstream.ErrorCode = 10009 // not the JetStream leader
	jsErrStreamOffline    jetstream.ErrorCode = 10118 // stream is offline
	jsErrNoPeers          jetstream.ErrorCode = 10005 // no suitable peers for placement (a cluster still forming)
	jsErrStreamNotFound   jetstream.ErrorCode = 10059 // stream not found
	// duplicate message id is in process (a try with the same id is being stored)
	jsErrDuplicateInProcess jetstream.ErrorCode = 10158
)

// unavailable marks a transient err as ErrUnavailable; other errors are returned as they are.
func unavailable(err error) error {
	if !transient(err) || errors.Is(err, ErrUnavailable) {
		return err
	}
	return fmt.Errorf("%w: %w", ErrUnavailable, err)
}

// noResponders reports whether a request reached nobody, so sending it again cannot apply it
// twice (the one failure a write is retried on).
func noResponders(err error) bool {
	return errors.Is(err, nats.ErrNoResponders) || errors.Is(err, jetstream.ErrNoStreamResponse)
}

// creating reports whether creating or updating a bucket or stream that failed with err is
// worth another try: transient failures, a bounded attempt that went unanswered (concurrent
// creates on a cluster), no peers yet for its replicas, or a stream created a moment ago by
// another process not yet visible here.
func creating(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) {
		return false
	}
	if transient(err) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, jetstream.ErrStreamNotFound) {
		return true
	}
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && (apiErr.ErrorCode == jsErrNoPeers || apiErr.ErrorCode == jsErrStreamNotFound)
}

// IsConflict reports whether err is a compare-and-set write losing: the key's (or subject's)
// last revision was not the one expected.
func IsConflict(err error) bool {
	if errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
		return true
	}
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && (apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
		apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant)
}

// writeInFlight reports whether err is a stream leader's refusal of a conditional write
// because another write of its key is in flight (see writeCAS): "wrong last sequence" without
// the sequence.
func writeInFlight(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant
}
