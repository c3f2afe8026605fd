// Package tmgrpc is what a shard's gRPC services share: the tenant and idempotency key of a
// call, and the one mapping of errors to gRPC statuses (the problem tmhttp.FromError makes,
// with the code tmhttp.GRPCCode gives it and grpc-retry-pushback-ms when it says when to come
// back). shardmain serves the services an App registers (shardmain.GRPCApp) behind the gate.
package tmgrpc

import (
	"context"
	"strconv"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// Tenant is the tenant of a call the gate admitted (the x-tenant-id metadata).
func Tenant(ctx context.Context) string { return shardkit.TenantOf(ctx) }

// IdempotencyKey is the call's idempotency-key metadata ("" if none): what the gateway reads
// to know that a call to an idempotent kind is safe to send again, so a service takes it when
// the message carries no key of its own.
func IdempotencyKey(ctx context.Context) string {
	if v := metadata.ValueFromIncomingContext(ctx, "idempotency-key"); len(v) == 1 {
		return v[0]
	}
	return ""
}

// Status maps err to a gRPC status error: a status error as it is, anything else by its
// problem (tmhttp.FromError: *tmhttp.Error as it says, schema errors by their meaning, the
// rest INTERNAL without its text), with the retry pushback in the trailer when the problem
// has a Retry-After.
func Status(ctx context.Context, err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	p := tmhttp.FromError(err)
	code := codes.Code(tmhttp.GRPCCode(p))
	if p.RetryAfter > 0 && (code == codes.Unavailable || code == codes.ResourceExhausted) {
		_ = grpc.SetTrailer(ctx, metadata.Pairs("grpc-retry-pushback-ms", strconv.Itoa(p.RetryAfter*1000)))
	}
	msg := p.Title
	if p.Detail != "" {
		msg += ": " + p.Detail
	}
	return status.Error(code, msg)
}

// Moved is the status a server stream ends with when its tenant leaves the instance
// (shardkit.Leaving): UNAVAILABLE, so the client calls again and the gateway sends the call
// to the tenant's new owner.
func Moved() error {
	return status.Error(codes.Unavailable, "the tenant is moving to another shard; call again (the gateway routes the call to its new owner)")
}
