// Package shardkit is the library every tenantmesh shard service embeds: the gate that serves a
// tenant only where it is placed, registration and heartbeats in the instance directory, route
// publication, load telemetry, per-tenant drain and warm-up for moves, affinity Release, and
// admin endpoints mounted on the service's own router.
//
// # Overview
//
// A service builds one [Shard] from a [Config], wraps its tenant routes in [Shard.Gate], mounts
// the admin routes with [Shard.Mount] and calls [Shard.Run]:
//
//	sk, err := shardkit.New(shardkit.Config{Store: st, ID: id, URL: url, Routes: routes, Hooks: hooks})
//	r := chi.NewRouter()
//	sk.Mount(r)                                  // /admin/*, /healthz, /readyz, /metrics
//	r.With(sk.Gate).Post("/commands/{id}", cmd)  // tenant routes behind the gate
//	go srv.Serve(ln)
//	err = sk.Run(ctx)                            // returns after a clean shutdown when ctx ends
//	srv.Shutdown(...)
//
// A service on net/http's ServeMux calls [Shard.MountMux] instead of Mount; any other router can
// delegate the shard's paths to [Shard.Handler]. Package shardmain (shardkit/shardmain) writes
// a shard binary's whole main: flags, NATS, the HTTP server, signals and all of the above.
//
// Run(ctx) with ctx from signal.NotifyContext(SIGTERM) gives the whole-instance drain: not
// ready first (readyz 503, directory status "draining"), then refuse new requests and wait for
// those in flight (DrainTimeout), then remove the routes, the signals and the directory entry.
//
// # The gate
//
// The gate reads x-tenant-id (400 if invalid) and x-tm-epoch, looks the tenant up in the
// placement snapshot (no lock, no allocation) and serves when this shard owns the tenant:
// phase active, warming (as the source) or draining (as the new owner), at the request's epoch.
// A request whose epoch is newer than the snapshot waits up to EpochWait for the snapshot to
// catch up. Otherwise:
//
//   - another shard owns the tenant, or the request's epoch is older: 421 problem+json with
//     owner and epoch; in forward mode, a proxy to a live instance of the owner instead;
//   - the tenant is in handoff: 503 with Retry-After (the gateway holds requests meanwhile);
//   - the tenant is draining here, or the instance is shutting down: 503 with Retry-After.
//
// Forward mode (Config.Forward, the Queen coordinator) proxies to the owner's live instances, read from the
// instance directory, and retries on another instance only when the request never reached the
// first (dial failure) or the method is idempotent and the body was buffered. It adds
// x-forwarded-by; a request that already carries it is never forwarded again (421, or 508 if it
// names this instance), so forwarding cannot loop. With Config.ForwardFallback, a kind whose
// requests any instance may serve has this instance serve the request itself when the owner
// fails twice in a way that is safe to repeat, or has no live instance (X-Fallback: true); a
// single-writer kind refuses it.
//
// # Moves
//
// shardkit follows the move workflow (docs/design.md "Moving a tenant") from placement changes and
// reports through tenant signals (tm_tenant_state, one key per instance; each write is noted on
// tm.signal.<kind>.<shard> to the shard the tenant moves to, whose instances read it):
//
//   - warming(A->B): each instance of B reports warming, calls Hooks.Warm(tenant, 0) and
//     reports ready with Fence 0 once Warm returned and Applied >= 0.
//   - handoff(A->B): each instance of A stops accepting the tenant, waits for its in-flight
//     requests (DrainTimeout), then reports drained at the handoff epoch E with
//     Fence = Applied = Hooks.Fence (default Hooks.Applied). Each instance of B waits until every
//     live instance of A reported drained at E (at least one), takes the highest fence, calls
//     Hooks.Warm(tenant, fence) and reports ready with that Fence once Applied >= fence (warming
//     with Lag meanwhile). B commits itself: the instance that sees every live sibling ready
//     with that Fence (a lone instance at once) writes draining(B, E+1) by compare-and-set (the
//     rebalancer audits it). The rebalancer commits only for a B that has not within 2s.
//   - commit, draining(B, E+1, from A): B serves. Each instance of A makes sure nothing is in
//     flight, calls Hooks.Release and reports drained at epoch E+1; the rebalancer then writes
//     active(B).
//   - active(B): A forgets the tenant and deletes its signal; B deletes its ready signal.
//   - abort (back to active(A)): A accepts again and deletes its signal; B cancels Warm's ctx,
//     calls Hooks.Release and deletes its signal.
//
// Per-tenant drain through [Shard.Drain] or POST /admin/drain?tenant_id= works the same way
// outside a move: draining, wait, Release, drained; [Shard.Undrain] or DELETE undoes it.
//
// # Admin routes
//
// /admin/* needs Authorization: Bearer $TM_ADMIN_TOKEN (Config.AdminToken); without a token
// configured they answer 403. /healthz, /readyz and /metrics are open. Per-tenant metric labels
// are bounded: the TopN busiest tenants are labelled, the rest count as "other".
package shardkit
