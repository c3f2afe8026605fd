package tmhttp

import (
	"net/http"
	"net/http/httptest"
	"testing"
)

func TestGRPCCode(t *testing.T) {
	for _, tc := range []struct {
		name string
		p    Problem
		want int
	}{
		{"invalid tenant", Problem{Status: 400, Type: TypeBase + "invalid-tenant"}, GRPCInvalidArgument},
		{"no token", Problem{Status: 401}, GRPCUnauthenticated},
		{"other tenant", Problem{Status: 403, Type: TypeBase + "tenant-mismatch"}, GRPCPermissionDenied},
		{"no route", Problem{Status: 404, Type: TypeBase + "no-route"}, GRPCUnimplemented},
		{"not placed", Problem{Status: 404, Type: TypeBase + "not-placed"}, GRPCNotFound},
		{"conflict", Problem{Status: 409, Type: TypeBase + "conflict"}, GRPCAborted},
		{"rejected", Problem{Status: 409, Type: TypeBase + "rejected"}, GRPCFailedPrecondition},
		{"rate limit", Problem{Status: 429}, GRPCResourceExhausted},
		{"not owner", Problem{Status: 421}, GRPCUnavailable},
		{"no live instance", Problem{Status: 503}, GRPCUnavailable},
		{"client gone", Problem{Status: 499}, GRPCCanceled},
		{"in doubt", Problem{Status: 502}, GRPCUnknown},
		{"timeout", Problem{Status: 504}, GRPCDeadlineExceeded},
		{"internal", Problem{Status: 500}, GRPCInternal},
	} {
		if got := GRPCCode(tc.p); got != tc.want {
			t.Errorf("%s: %d, want %d", tc.name, got, tc.want)
		}
	}
	if got := EncodeGRPCMessage("50% off: ü"); got != "50%25 off: %C3%BC" {
		t.Errorf("EncodeGRPCMessage: %q", got)
	}
}

// A gRPC call gets its problem as a trailers-only status; an HTTP request problem+json.
func TestWriteProblemGRPC(t *testing.T) {
	r := httptest.NewRequest("POST", "/x.v1.S/M", nil)
	r.ProtoMajor, r.Header = 2, http.Header{"Content-Type": {"application/grpc+proto"}}
	w := httptest.NewRecorder()
	WriteProblem(w, r, Problem{Status: 421, Title: "Not the owner", Detail: "owner s2", Owner: "s2", Epoch: 7, RetryAfter: 1})
	h := w.Result().Header
	if w.Code != 200 || h.Get("Grpc-Status") != "14" || h.Get(HeaderOwner) != "s2" || h.Get(HeaderEpoch) != "7" ||
		h.Get(HeaderPushback) != "1000" || h.Get("Grpc-Message") != "Not the owner: owner s2" || w.Body.Len() != 0 {
		t.Fatalf("gRPC answer %d %v %q", w.Code, h, w.Body.String())
	}
	r.ProtoMajor = 1 // not gRPC: HTTP/1.1 cannot carry it
	w = httptest.NewRecorder()
	WriteProblem(w, r, Problem{Status: 421, Title: "Not the owner"})
	if w.Code != 421 || w.Result().Header.Get("Content-Type") != ContentTypeProblem {
		t.Fatalf("HTTP answer %d %v", w.Code, w.Result().Header)
	}
}
