// Package planner computes rebalancing plans: which tenants move from which shard to which, and
// what each shard's load looks like before and after.
//
// # Overview
//
// The planner is pure: it takes a snapshot of one kind's world as plain data (a [World]: its
// shards from the instance directory, its tenants from placement and load telemetry) and returns a
// [Plan]. It never talks to NATS or HTTP; the move workflow engine feeds it and applies its plans.
//
// Strategies:
//
//   - [Balance] brings every shard's utilisation (load/capacity) within a tolerance of the mean
//     with as few moves as it can (heaviest-first greedy, see balance.go);
//   - [Evacuate] moves every unpinned tenant off one shard onto the least utilised eligible shards;
//   - [Fill] feeds a new (or underused) shard from the most utilised shards up to the mean;
//   - [Manual] checks and records operator-chosen moves;
//   - [MoveTenant] moves one tenant across kinds, one move per kind, in the order aggregate,
//     projection, runner, then any other kind by name.
//
// Every plan respects shard capacity (load and tenant count), label requirements (the tenant's
// and the request's), pinned tenants (never moved), the move budget, and groups moves into waves
// of at most Options.Concurrency moves for the engine. Each [Move] carries the placement revision
// it was planned from, so apply can skip a move whose tenant changed since.
//
// # Feeding the planner
//
// A [Shard] is one shard of the kind: Labels are the labels its instances share, MaxTenants the
// sum of its live instances' capacity, Capacity the load it is sized for in the same unit as
// tenant loads (for example requests per second), Draining set for a shard that must receive
// nothing (offline, draining, being retired). A [Tenant] is one placement (schema.Placement):
// Shard, Revision and Pinned come straight from it, Load from telemetry (0 if unknown), Requires
// from the tenant's label requirements.
//
// Utilisation is load/capacity; the mean utilisation of a kind is its total load over its total
// capacity (shards marked Draining excluded), so "max/mean" is 1 when every shard is equally full.
package planner
