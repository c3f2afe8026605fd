package tmhttp

import (
	"net/http"
	"strconv"
	"strings"
)

// gRPC status codes (google.golang.org/grpc/codes), by number: tenantmesh's gRPC answers are
// written by its HTTP parts (the gateway, shardkit's gate), which do not link grpc-go.
const (
	GRPCOK                 = 0
	GRPCCanceled           = 1
	GRPCUnknown            = 2
	GRPCInvalidArgument    = 3
	GRPCDeadlineExceeded   = 4
	GRPCNotFound           = 5
	GRPCPermissionDenied   = 7
	GRPCResourceExhausted  = 8
	GRPCFailedPrecondition = 9
	GRPCAborted            = 10
	GRPCUnimplemented      = 12
	GRPCInternal           = 13
	GRPCUnavailable        = 14
	GRPCUnauthenticated    = 16
)

// gRPC metadata the gate and the gateway add to their own statuses.
const (
	// HeaderOwner and HeaderEpoch name the tenant's owner and its epoch in a gate refusal
	// answered as a gRPC status (the problem's owner and epoch).
	HeaderOwner = "X-Tm-Owner"
	// HeaderPushback is gRPC's retry pushback (A6): how long a client should wait before it
	// tries again, in milliseconds.
	HeaderPushback = "Grpc-Retry-Pushback-Ms"
)

// IsGRPC reports whether r is a gRPC call: HTTP/2 with a content type of application/grpc or
// one of its subtypes (application/grpc+proto, ...).
func IsGRPC(r *http.Request) bool {
	if r.ProtoMajor != 2 {
		return false
	}
	ct := r.Header.Get("Content-Type")
	return strings.HasPrefix(ct, "application/grpc") && (len(ct) == 16 || ct[16] == '+' || ct[16] == ';')
}

// GRPCCode is the gRPC status of a problem: what a gRPC client should do with it. 400 is
// INVALID_ARGUMENT, 401 UNAUTHENTICATED, 403 PERMISSION_DENIED, a missing route
// UNIMPLEMENTED and anything else not found NOT_FOUND, a conflict ABORTED (try again from a
// fresh read) and a rejected command FAILED_PRECONDITION, 413 and 429 RESOURCE_EXHAUSTED, 421
// and 503 UNAVAILABLE (safe to try again), 499 CANCELLED, 502 UNKNOWN (the call may have been
// applied: only resend it with its idempotency key), 408 and 504 DEADLINE_EXCEEDED, other
// 5xx INTERNAL.
func GRPCCode(p Problem) int {
	slug := strings.TrimPrefix(p.Type, TypeBase)
	switch p.Status {
	case http.StatusBadRequest:
		return GRPCInvalidArgument
	case http.StatusUnauthorized:
		return GRPCUnauthenticated
	case http.StatusForbidden:
		return GRPCPermissionDenied
	case http.StatusNotFound:
		if slug == "no-route" || slug == "unknown-kind" {
			return GRPCUnimplemented
		}
		return GRPCNotFound
	case http.StatusRequestTimeout, http.StatusGatewayTimeout:
		return GRPCDeadlineExceeded
	case http.StatusConflict:
		if slug == "rejected" {
			return GRPCFailedPrecondition
		}
		return GRPCAborted
	case http.StatusRequestEntityTooLarge, http.StatusTooManyRequests:
		return GRPCResourceExhausted
	case http.StatusMisdirectedRequest, http.StatusServiceUnavailable:
		return GRPCUnavailable
	case 499:
		return GRPCCanceled
	case http.StatusBadGateway:
		return GRPCUnknown
	case http.StatusNotImplemented:
		return GRPCUnimplemented
	}
	if p.Status >= 500 {
		return GRPCInternal
	}
	return GRPCFailedPrecondition
}

// WriteGRPCProblem answers a gRPC call with p as a status, trailers-only (HTTP 200, the status
// in the one header block): grpc-status (GRPCCode), grpc-message (title and detail),
// grpc-retry-pushback-ms when p says when to come back, and the owner and epoch of a
// refusal in x-tm-owner and x-tm-epoch. Write nothing after it.
func WriteGRPCProblem(w http.ResponseWriter, p Problem) {
	h := w.Header()
	h.Set("Content-Type", "application/grpc")
	code := GRPCCode(p)
	h.Set("Grpc-Status", strconv.Itoa(code))
	msg := p.Title
	if p.Detail != "" {
		msg += ": " + p.Detail
	}
	h.Set("Grpc-Message", EncodeGRPCMessage(msg))
	if p.RetryAfter > 0 && (code == GRPCUnavailable || code == GRPCResourceExhausted) {
		h.Set(HeaderPushback, strconv.Itoa(p.RetryAfter*1000))
	}
	if p.Owner != "" {
		h.Set(HeaderOwner, p.Owner)
	}
	if p.Epoch != 0 {
		h.Set(HeaderEpoch, strconv.FormatUint(p.Epoch, 10))
	}
	w.WriteHeader(http.StatusOK)
}

// EncodeGRPCMessage percent-encodes a grpc-message value (the gRPC HTTP/2 protocol: bytes
// outside printable ASCII, and '%', as %XX).
func EncodeGRPCMessage(s string) string {
	ok := true
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < ' ' || c > '~' || c == '%' {
			ok = false
			break
		}
	}
	if ok {
		return s
	}
	const hex = "0123456789ABCDEF"
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < ' ' || c > '~' || c == '%' {
			b.WriteByte('%')
			b.WriteByte(hex[c>>4])
			b.WriteByte(hex[c&15])
		} else {
			b.WriteByte(c)
		}
	}
	return b.String()
}
