// Package events is event-sourced per-tenant state for a shard service, with both
// single-writer fences tenantmesh relies on and the move hooks wired.
//
// # Overview
//
// A service keeps each tenant's state (of its own type S, JSON in snapshots) as the fold of the
// tenant's events on a JetStream stream, one subject per thing the events are about
// (Config.Prefix(tenant) + Event.Subject, e.g. events.<tenant>.account.main). A command goes
// through [Log.Execute]:
//
//	res, err := log.Execute(ctx, tenant, "account.main", key, func(st *Ledger, at events.Position) (events.Event, error) {
//		// validate against st; at.Version is the subject's event count
//		return events.Event{Type: "deposited", Data: body}, nil
//	})
//
// Execute appends the event with JetStream's expected-last-subject-sequence, taken over all of
// the tenant's subjects (Nats-Expected-Last-Subject-Sequence-Subject: Prefix(tenant) + ">"), set
// to the last event of the tenant this instance applied, so two writers that both believe they
// own a tenant (the epoch fence of shardkit's gate is the first fence; this is the second)
// cannot fork its history: the second append is rejected, the instance catches the tenant up
// from the stream and decides again. A takeover (the former owner had no live instance and did
// not drain) stores an epoch marker in the tenant's events ([Log.Takeover]): every later
// append of the former owner expects an earlier last event and fails, and once it has caught
// up the marker fences it ([Log.SetWriteEpoch], schema.ErrFenced), for reads too. The message id <tenant>:<key> and a per-tenant window of recent
// outcomes make a retried command apply once, also across a move: the window travels in
// snapshots and is rebuilt from the events' message ids.
//
// State lives in memory per hosted tenant, rebuilt from the newest snapshot (Config.Snapshots,
// written every SnapshotEvery events and when a tenant is released) plus later events.
// [Log.Hooks] are shardkit's Warm (load with the move's strategy, follow the stream until the
// handoff, catch up to the fence), Applied, Fence (the tenant's newest stored event) and
// Release (final snapshot, forget). [Log.Run] writes snapshots and owns the follows.
package events
