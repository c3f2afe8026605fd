// Command shardkit-sidecar makes an HTTP service in any language a tenantmesh shard. It runs
// beside the service, on its own port, as one instance of the service's shard: it registers in
// the instance directory, publishes the service's routes, heartbeats, serves /healthz, /readyz,
// /metrics and /admin/*, and sends each request the gateway routes to it through shardkit's
// gate (only tenants the shard owns, at the request's epoch; 421 or 503 otherwise) to the
// service, which sees the request as the client sent it plus X-Tenant-Id. On SIGTERM it drains
// (not ready, in-flight requests finish, unregister) before it exits.
//
// Usage:
//
//	shardkit-sidecar --kind notes --shard notes-1 --instance a --addr 127.0.0.1:9301 \
//	    --upstream http://127.0.0.1:8000 --route 'POST /notes' --route 'GET /notes' \
//	    --hooks warm,applied,fence,release --nats-creds notes-1.creds
//
// Every flag of a shard binary applies (--help lists them, each with its TM_* variable).
//
// A gRPC service is fronted the same way: name each service as a route (--route 'POST
// /notes.v1.NoteService'); the sidecar serves gRPC on its port (HTTP/2 with prior knowledge,
// or TLS with ALPN), the gate reads the tenant from the x-tenant-id metadata and answers its
// refusals as gRPC statuses, and admitted calls go to --upstream over HTTP/2 (h2c to http://,
// h2 to https://), each message flushed as it comes and the trailers relayed. A call still open
// when its tenant starts to leave (a move's handoff, a drain) is ended UNAVAILABLE, so a server
// stream does not hold the drain and its client calls again, reaching the new owner.
//
// # The hook contract
//
// A stateful service takes part in moves through HTTP calls the sidecar makes to it, under
// --hooks-path (default /tenantmesh) on --upstream, each with a JSON body or answer and a bound
// (--hook-timeout, default 5s; --warm-timeout for warm, default 60s). Only the hooks named in
// --hooks are called; a stateless service names none.
//
//	POST {hooks-path}/warm     {"tenant":"acme","fence":42}   2xx once the tenant's state is
//	                           loaded and has applied everything up to fence (0: load what
//	                           there is); a move's target gets it at warming (fence 0) and at
//	                           handoff (the source's fence). Answer {"applied":N} or nothing.
//	GET  {hooks-path}/applied?tenant=acme   {"applied":N}: how far the tenant's state has
//	                           applied its writes (any number that grows with them).
//	GET  {hooks-path}/fence?tenant=acme     {"fence":N}: called on a move's source once the
//	                           tenant's in-flight requests are done: make every write durable
//	                           where the target's warm will read it, and say how far that is.
//	                           Without it, the fence is applied's answer.
//	POST {hooks-path}/release  {"tenant":"acme"}   2xx: the tenant has moved away (or was
//	                           drained): drop what is kept of it.
//
// A hook that fails (an error status, no answer within its bound) fails that step of the move,
// which the rebalancer then retries or aborts; an applied or fence that fails counts as 0.
//
// The hooks are the sidecar's to call, never a tenant's: a request for a path under
// --hooks-path is answered 404 by the sidecar, whatever route led to it, and with
// --hooks-secret-file every hook call carries X-Tm-Hook-Token, which the service should check
// (bind the service to 127.0.0.1 so only its sidecar reaches it at all). Header fields with an
// underscore in their name are dropped on the way to the service (CGI, WSGI and PHP read
// x_tenant_id as x-tenant-id).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/tenantmesh/tenantmesh/shardkit/shardmain"
	"github.com/tenantmesh/tenantmesh/shardkit/sidecar"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	fail := func(code int, err error) {
		fmt.Fprintf(os.Stderr, "shardkit-sidecar: %v\n", err)
		stop()
		os.Exit(code)
	}
	var o sidecar.Options
	m := shardmain.Main{Extra: o.AddFlags}
	if err := m.ParseFlags("", os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fail(2, err)
	}
	sc, err := sidecar.New(o)
	if err != nil {
		fail(2, err)
	}
	if err := m.Run(ctx, sc.Build); err != nil {
		fail(1, err)
	}
}
