package shardkit

import (
	"context"
	"net/http"
)

// gRPC: a shard serves gRPC beside HTTP on the same port (HTTP/2 with prior knowledge, or TLS
// with ALPN): shardmain hands gRPC calls to a grpc.Server (its ServeHTTP) behind Gate. The gate
// reads the tenant from the x-tenant-id metadata, like the header, and answers its refusals as
// gRPC statuses (UNAVAILABLE with x-tm-owner and x-tm-epoch naming the owner, the reason in
// x-tm-refused and grpc-retry-pushback-ms; tmhttp.WriteGRPCProblem). A call the gate admitted
// carries its tenant in its context (Tenant for HTTP requests, TenantOf here), and Leaving
// tells a server stream when to end so that its client reconnects to the tenant's new owner.

type callKey struct{}

// call is what the gate gives an admitted gRPC call's context.
type call struct {
	ts *tenantState
}

// withCall marks r's context as admitted for ts (gRPC calls only: the context costs an
// allocation that plain HTTP requests do not pay).
func withCall(r *http.Request, ts *tenantState) *http.Request {
	return r.WithContext(context.WithValue(r.Context(), callKey{}, &call{ts: ts}))
}

// TenantOf returns the tenant of a gRPC call the gate admitted ("" outside the gate).
func TenantOf(ctx context.Context) string {
	if c, ok := ctx.Value(callKey{}).(*call); ok {
		return c.ts.tenant
	}
	return ""
}

// Leaving returns a channel that is closed when the tenant of the call (the gate admitted
// it) starts to leave this instance: a move's handoff or commit, a takeover, an admin drain.
// A server stream selects on it and ends with codes.Unavailable ("the tenant moved;
// reconnect"), so the tenant's drain does not wait for it and the client's next call goes to
// the new owner through the gateway. Outside the gate it returns nil (a channel that never
// closes).
func Leaving(ctx context.Context) <-chan struct{} {
	if c, ok := ctx.Value(callKey{}).(*call); ok {
		return c.ts.leaving()
	}
	return nil
}
