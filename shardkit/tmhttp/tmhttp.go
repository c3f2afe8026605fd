// Package tmhttp holds what tenantmesh's HTTP parts share: header names, and the one place that
// turns errors into RFC 9457 problem+json responses.
package tmhttp

import (
	"crypto/subtle"
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Header names. Clients send only HeaderTenant; every x-tm-* header a client sends is stripped
// by the gateway.
const (
	HeaderTenant      = "X-Tenant-Id"
	HeaderEpoch       = "X-Tm-Epoch"
	HeaderShard       = "X-Tm-Shard"
	HeaderKind        = "X-Tm-Kind"
	HeaderRequestID   = "X-Request-Id"
	HeaderServedBy    = "X-Served-By"
	HeaderForwardedBy = "X-Forwarded-By"
	// HeaderFallback is "true" on an answer the instance served itself after forwarding to the
	// owner failed (shardkit Config.ForwardFallback, the Queen coordinator's fallback).
	HeaderFallback    = "X-Fallback"
	HeaderTraceparent = "Traceparent"
	// HeaderRefused marks an answer of shardkit's gate that refused a request before the
	// service saw it (the value says why: not_owner, handoff, closing, ...). Such a request is
	// always safe to send again; the gateway does, and never passes the header on.
	HeaderRefused = "X-Tm-Refused"
	// HeaderSubject is the subject (sub) of the bearer token the gateway verified, when it
	// checks tenant identity at the edge (gateway --jwt-*): a shard can trust it, since the
	// gateway strips every x-tm-* header a client sends.
	HeaderSubject = "X-Tm-Subject"
	// HeaderProof is the gateway's proof that a request came through it (internal/gatesig),
	// which shardkit's gate checks when the shard has its kind's key.
	HeaderProof = "X-Tm-Proof"
	// HeaderPrefixTM is the prefix of headers only tenantmesh may set.
	HeaderPrefixTM = "X-Tm-"
)

// ContentTypeProblem is RFC 9457's media type.
const ContentTypeProblem = "application/problem+json"

// Problem is an RFC 9457 problem detail, with tenantmesh's extensions.
type Problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail,omitempty"`
	Tenant string `json:"tenant,omitempty"`
	Kind   string `json:"kind,omitempty"`
	// Owner and Epoch name the tenant's owner in a 421 (not the owner at this epoch).
	Owner string `json:"owner,omitempty"`
	Epoch uint64 `json:"epoch,omitempty"`
	// RetryAfter, in seconds, is also sent as the Retry-After header.
	RetryAfter int    `json:"retry_after,omitempty"`
	RequestID  string `json:"request_id,omitempty"`
}

// Error is an error that carries its HTTP answer.
type Error struct {
	Status int
	// Type is a short slug, turned into the problem type URI.
	Type   string
	Title  string
	Detail string
	// RetryAfter, if set, is sent as Retry-After (503, 429).
	RetryAfter time.Duration
	Err        error
}

func (e *Error) Error() string {
	if e.Err != nil {
		return e.Detail + ": " + e.Err.Error()
	}
	return e.Detail
}

func (e *Error) Unwrap() error { return e.Err }

// Errorf is shorthand for an *Error.
func Errorf(status int, typ, title, detail string) *Error {
	return &Error{Status: status, Type: typ, Title: title, Detail: detail}
}

// TypeBase prefixes problem type slugs.
const TypeBase = "https://tenantmesh.dev/problems/"

// UnavailableRetryAfter is the Retry-After of a 503 for a state store that is unavailable for
// now (schema.ErrUnavailable: a NATS leader election, a server restarting).
const UnavailableRetryAfter = time.Second

// FromError maps any error to a Problem: *Error as it says, schema errors by their meaning
// (schema.ErrUnavailable: 503 with Retry-After), and anything else as a 500 that hides its text.
func FromError(err error) Problem {
	var e *Error
	switch {
	case errors.As(err, &e):
		p := Problem{Type: TypeBase + e.Type, Title: e.Title, Status: e.Status, Detail: e.Detail}
		if e.RetryAfter > 0 {
			p.RetryAfter = int((e.RetryAfter + time.Second - 1) / time.Second)
		}
		return p
	case schema.IsUnavailable(err):
		return Problem{Type: TypeBase + "store-unavailable", Title: "State store unavailable", Status: http.StatusServiceUnavailable,
			Detail:     "NATS could not serve the request for now (a leader election or a restarting server); retry after Retry-After seconds",
			RetryAfter: int(UnavailableRetryAfter / time.Second)}
	case errors.Is(err, schema.ErrFenced):
		return Problem{Type: TypeBase + "not-owner", Title: "Not the owner", Status: http.StatusMisdirectedRequest,
			Detail: err.Error() + "; send the request to the tenant's new owner"}
	case errors.Is(err, schema.ErrInvalidTenant):
		return Problem{Type: TypeBase + "invalid-tenant", Title: "Invalid tenant id", Status: http.StatusBadRequest, Detail: err.Error()}
	case errors.Is(err, schema.ErrInvalidName), errors.Is(err, schema.ErrInvalid), errors.Is(err, schema.ErrTransition):
		return Problem{Type: TypeBase + "invalid-request", Title: "Invalid request", Status: http.StatusBadRequest, Detail: err.Error()}
	case errors.Is(err, schema.ErrUnknownKind), errors.Is(err, schema.ErrNotFound):
		return Problem{Type: TypeBase + "not-found", Title: "Not found", Status: http.StatusNotFound, Detail: err.Error()}
	case errors.Is(err, schema.ErrConflict), errors.Is(err, schema.ErrLeaseHeld):
		return Problem{Type: TypeBase + "conflict", Title: "Conflict", Status: http.StatusConflict, Detail: err.Error()}
	}
	return Problem{Type: TypeBase + "internal", Title: "Internal error", Status: http.StatusInternalServerError,
		Detail: "the server failed to handle the request; it has been logged"}
}

// WriteError writes err as problem+json, with tenant and kind when known.
func WriteError(w http.ResponseWriter, r *http.Request, err error, tenant, kind string) {
	p := FromError(err)
	p.Tenant, p.Kind = tenant, kind
	WriteProblem(w, r, p)
}

// WriteProblem writes p: problem+json, or to a gRPC call (IsGRPC) the gRPC status it maps to
// (WriteGRPCProblem).
func WriteProblem(w http.ResponseWriter, r *http.Request, p Problem) {
	if p.RequestID == "" && r != nil {
		p.RequestID = r.Header.Get(HeaderRequestID)
	}
	if r != nil && IsGRPC(r) {
		WriteGRPCProblem(w, p)
		return
	}
	h := w.Header()
	h.Set("Content-Type", ContentTypeProblem)
	h.Set("Cache-Control", "no-store")
	if p.RetryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(p.RetryAfter))
	}
	w.WriteHeader(p.Status)
	_ = json.NewEncoder(w).Encode(p)
}

// WriteJSON writes v as JSON with status.
func WriteJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

// BearerToken is the token r carries as Authorization: Bearer <token>, and whether it carries one.
func BearerToken(r *http.Request) (string, bool) {
	return strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
}

// TokenIn reports whether got is one of tokens, comparing with each in constant time (the
// one token check of the gateway, shardkit and the rebalancer). An empty token never matches.
func TokenIn(got string, tokens ...string) bool {
	in := false
	for _, t := range tokens {
		if t != "" && subtle.ConstantTimeCompare([]byte(got), []byte(t)) == 1 {
			in = true
		}
	}
	return in
}

// RequireBearer returns middleware that admits only requests with Authorization: Bearer
// <token>, compared in constant time; a missing or wrong token is answered 401 with
// WWW-Authenticate. With token empty the routes are disabled: every request is answered 403.
// setWith says where the token is configured ("TM_ADMIN_TOKEN"); both answers name it.
func RequireBearer(token, setWith string) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if token == "" {
				WriteProblem(w, r, Problem{Type: TypeBase + "admin-disabled", Title: "Admin disabled", Status: http.StatusForbidden,
					Detail: "admin routes are disabled: no admin token is configured; set one with " + setWith})
				return
			}
			if got, ok := BearerToken(r); !ok || !TokenIn(got, token) {
				w.Header().Set("WWW-Authenticate", `Bearer realm="tenantmesh admin"`)
				WriteProblem(w, r, Problem{Type: TypeBase + "unauthorized", Title: "Unauthorized", Status: http.StatusUnauthorized,
					Detail: "admin routes need Authorization: Bearer <the admin token set with " + setWith + ">"})
				return
			}
			next.ServeHTTP(w, r)
		})
	}
}
