package tmhttp

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

func TestFromError(t *testing.T) {
	tests := []struct {
		name   string
		err    error
		status int
	}{
		{"invalid tenant", schema.CheckTenant("a.b"), 400},
		{"unknown kind", fmt.Errorf("x: %w", schema.ErrUnknownKind), 404},
		{"conflict", &schema.ConflictError{Bucket: "b", Key: "k", Expected: 3}, 409},
		{"typed", &Error{Status: 503, Type: "hold-expired", Title: "Held too long", Detail: "retry"}, 503},
		{"store unavailable", fmt.Errorf("schema: list tm_kinds: %w: nats: no responders", schema.ErrUnavailable), 503},
		{"anything else", fmt.Errorf("boom"), 500},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if p := FromError(tt.err); p.Status != tt.status || p.Type == "" || p.Title == "" {
				t.Fatalf("FromError = %+v, want status %d", p, tt.status)
			}
		})
	}
	if p := FromError(fmt.Errorf("secret db password in here")); p.Detail == "secret db password in here" {
		t.Fatal("500 leaks the internal error text")
	}
}

func TestWriteErrorRetryAfter(t *testing.T) {
	rec := httptest.NewRecorder()
	r := httptest.NewRequest("GET", "/", nil)
	r.Header.Set(HeaderRequestID, "req-1")
	WriteError(rec, r, &Error{Status: 503, Type: "hold-budget", Title: "Tenant is moving", Detail: "try again", RetryAfter: 1500 * time.Millisecond}, "acme", "aggregate")
	if rec.Code != http.StatusServiceUnavailable || rec.Header().Get("Retry-After") != "2" || rec.Header().Get("Content-Type") != ContentTypeProblem {
		t.Fatalf("code=%d headers=%v", rec.Code, rec.Header())
	}
	var p Problem
	if err := json.Unmarshal(rec.Body.Bytes(), &p); err != nil {
		t.Fatal(err)
	}
	if p.Tenant != "acme" || p.Kind != "aggregate" || p.RetryAfter != 2 || p.RequestID != "req-1" {
		t.Fatalf("problem = %+v", p)
	}
}
