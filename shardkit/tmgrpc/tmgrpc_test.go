package tmgrpc

import (
	"context"
	"errors"
	"net/http"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

func TestStatus(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		err  error
		want codes.Code
	}{
		{nil, codes.OK},
		{status.Error(codes.NotFound, "x"), codes.NotFound},
		{&tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "store-unavailable", Title: "Store", RetryAfter: time.Second}, codes.Unavailable},
		{&tmhttp.Error{Status: http.StatusBadRequest, Type: "bad-command", Title: "Bad"}, codes.InvalidArgument},
		{schema.ErrInvalidTenant, codes.InvalidArgument},
		{errors.New("something private"), codes.Internal},
	} {
		err := Status(ctx, tc.err)
		if status.Code(err) != tc.want {
			t.Errorf("%v: %v, want %v", tc.err, err, tc.want)
		}
	}
	if s := status.Convert(Status(ctx, errors.New("something private"))); s.Message() == "" || s.Message() == "something private" {
		t.Errorf("an internal error's text must not leave: %q", s.Message())
	}
	if status.Code(Moved()) != codes.Unavailable {
		t.Error("Moved is not UNAVAILABLE")
	}
	md := metadata.Pairs("idempotency-key", "k1")
	if IdempotencyKey(metadata.NewIncomingContext(ctx, md)) != "k1" || IdempotencyKey(ctx) != "" {
		t.Error("IdempotencyKey")
	}
}
