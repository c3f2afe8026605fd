// Package natsperm says which NATS subjects each tenantmesh role may publish and subscribe to:
// the least each needs, spelled from schema's names. natsauth puts these into user JWTs; the
// table in docs/security.md is what they come to.
//
// JetStream is used through its API subjects, so reading a bucket means asking for stream info,
// direct and leader gets and consumers on its stream, and writing a key means publishing on
// $KV.<bucket>.<key>. Stream names are single subject tokens that cannot be matched by prefix,
// so the roles list each asset by name: a kind added later needs the gateway's credentials made
// again (`rebalance auth creds`).
package natsperm

import (
	"github.com/tenantmesh/tenantmesh/internal/natsauth"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Role is one user's permissions.
type Role = natsauth.Role

// Rebalancer may do anything in tenantmesh's account: it provisions every bucket and stream,
// rewrites placements and sweeps the directory. The operator CLI uses it too.
func Rebalancer() Role { return natsauth.Admin() }

// Gateway reads placements of kinds, kind config, routes and the directory; writes placements
// of kinds (the unplaced-tenant rule and the affinity policy) and audits them, under those
// kinds only; writes the directory entries and routes of the servers that register with it
// for affinityKinds, under those kinds only; reads load reports and publishes its circuit
// reports.
func Gateway(kinds, affinityKinds []string) Role {
	p := base("gateway")
	p.readKV(schema.BucketKinds, schema.BucketInstances, schema.BucketMembers, schema.BucketRoutes, schema.BucketTenantState)
	p.readObjects(schema.BucketSnapshots)
	for _, k := range kinds {
		p.readKV(schema.PlacementBucket(k))
		p.writeKV(schema.PlacementBucket(k), ">")
		p.publishAudit(k)
	}
	for _, k := range affinityKinds {
		p.writeKV(schema.BucketInstances, k+".>")
		p.writeKV(schema.BucketMembers, k+".>")
		p.writeKV(schema.BucketRoutes, k+".>")
	}
	p.Sub = append(p.Sub, schema.SubjectLoadAll)
	p.Pub = append(p.Pub, schema.SubjectCircuitAll)
	return p.Role
}

// BuiltinKinds are the kinds of the platform's own services.
func BuiltinKinds() []string { return []string{"aggregate", "projection", "runner", "render"} }

// DefaultGateway is the gateway for the built-in kinds and more (kinds of services beyond the
// platform's own), with render as its affinity kind.
func DefaultGateway(more ...string) Role {
	return Gateway(append(BuiltinKinds(), more...), []string{"render"})
}

// Scopes are the roles whose templates a trust chain keeps as scoped keys (natsauth.AddScope)
// before its servers start: the built-in kinds' shards and the default gateway (with more
// kinds, if it routes them). Their users' JWTs then hold a name and a tag, not a few hundred
// subjects, which every JetStream API request they make carries to the server.
func Scopes(moreKinds ...string) []Role {
	out := []Role{DefaultGateway(moreKinds...)}
	for _, k := range BuiltinKinds() {
		out = append(out, Shard(k, "scope", KindAssets(k)))
	}
	return out
}

// AddScopes gives chain a scoped key for each of roles' templates; it reports whether the
// account changed (servers already running need it pushed).
func AddScopes(chain *natsauth.Chain, roles []Role) (bool, error) {
	changed := false
	for _, r := range roles {
		c, err := chain.AddScope(r)
		if err != nil {
			return changed, err
		}
		changed = changed || c
	}
	return changed, nil
}

// Assets are a kind's application data: what its instances create, write and read.
type Assets struct {
	// Streams and KV buckets the kind owns: created, updated, written, purged.
	Streams, KV, Objects []string
	// ReadStreams are other kinds' streams it reads.
	ReadStreams []string
	// Publish and Subscribe are core or stream subjects beyond its own streams'.
	Publish, Subscribe []string
}

// KindAssets are the built-in kinds' assets: aggregate writes events, projection reads them,
// runner keeps job queues and reads events. Other kinds own tm_<kind>_* buckets named by the
// caller.
func KindAssets(kind string) Assets {
	switch kind {
	case "aggregate":
		return Assets{Streams: []string{schema.StreamEvents}, Objects: []string{schema.ServiceBucket(kind, "snapshots")},
			Publish: []string{schema.SubjectEventsAll}}
	case "projection":
		return Assets{ReadStreams: []string{schema.StreamEvents}, Objects: []string{schema.ServiceBucket(kind, "views")},
			KV: []string{schema.ServiceBucket(kind, "checkpoints")}}
	case "runner":
		return Assets{Streams: []string{schema.StreamJobs}, ReadStreams: []string{schema.StreamEvents},
			KV: []string{schema.ServiceBucket(kind, "runs"), schema.ServiceBucket(kind, "outbox"),
				schema.ServiceBucket(kind, "checkpoints"), schema.ServiceBucket(kind, "status"), schema.BucketRunnerSchedules},
			Publish:   []string{schema.SubjectJobsAll, schema.JobEventSubjectKind(kind)},
			Subscribe: []string{schema.SubjectJobsAll, schema.SubjectEventsAll}}
	}
	return Assets{}
}

// Shard is one shard's instances: they read the control plane; write only their own
// directory entries, their own tenant signals, their own move digests (tm_verify), their kind's placements (a drained tenant is
// released by its shard), routes, their load reports and their kind's audit events; note
// signals to their kind's shards and hear their own shard's notes; answer the rebalancer's
// liveness probes of their own shard (a reply each); and use their kind's application assets.
//
// Its Template is the same with the shard as the user's tag "shard" (natsauth's scoped keys),
// so one scope in the account serves every shard of the kind.
func Shard(kind, shard string, a Assets) Role {
	r := shardRole(kind, shard, a)
	t := shardRole(kind, "{{tag(shard)}}", a)
	t.Name = "shard-" + kind
	r.Template, r.Tags = &t, map[string]string{"shard": shard}
	return r
}

func shardRole(kind, shard string, a Assets) Role {
	p := base("shard-" + kind + "-" + shard)
	p.readKV(schema.BucketKinds, schema.BucketInstances, schema.BucketMembers, schema.BucketRoutes,
		schema.BucketTenantState, schema.PlacementBucket(kind))
	p.readObjects(schema.BucketSnapshots)
	p.writeKV(schema.BucketInstances, kind+"."+shard+".*")
	p.writeKV(schema.BucketMembers, kind+"."+shard+".*")
	p.writeKV(schema.BucketTenantState, kind+".*."+shard+".*")
	p.readKV(schema.BucketVerify)
	p.writeKV(schema.BucketVerify, kind+".*.*.*."+shard+".*")
	p.writeKV(schema.PlacementBucket(kind), ">")
	p.writeKV(schema.BucketRoutes, kind+".>") // its own kind's routes (keys lead with the kind)
	p.Pub = append(p.Pub, "tm.load."+kind+"."+shard+".*", schema.SignalNoteSubjectKind(kind))
	p.Sub = append(p.Sub, schema.SignalNoteSubject(kind, shard), schema.PingSubjectShard(kind, shard))
	p.Respond = true // the rebalancer's liveness probes
	p.publishAudit(kind)
	for _, s := range a.Streams {
		p.ownStream(s)
	}
	for _, s := range a.ReadStreams {
		p.readStream(s)
	}
	for _, b := range a.KV {
		p.ownStream(jsx.KVStream(b))
		p.writeKV(b, ">")
	}
	for _, b := range a.Objects {
		p.ownStream(objectStream(b))
		p.Pub = append(p.Pub, "$O."+b+".>")
	}
	p.Pub = append(p.Pub, a.Publish...)
	p.Sub = append(p.Sub, a.Subscribe...)
	return p.Role
}

type perms struct{ Role }

// base is what every role needs: its inbox, JetStream account info, the stream leader
// advisories (a KV follower or an ordered read whose consumer's server went offline hears it
// there), and reading the audit stream and tm_rebalance (schema.Open opens every control-plane
// bucket; only the rebalancer writes this one).
func base(name string) *perms {
	p := &perms{Role{Name: name}}
	p.Sub = append(p.Sub, p.Inbox()+".>", jsx.SubjectLeaderElected)
	p.Pub = append(p.Pub, "$JS.API.INFO")
	p.readStream(schema.StreamAudit)
	p.readKV(schema.BucketRebalance)
	return p
}

func (p *perms) readKV(buckets ...string) {
	for _, b := range buckets {
		p.readStream(jsx.KVStream(b))
	}
}

func (p *perms) readObjects(buckets ...string) {
	for _, b := range buckets {
		p.readStream(objectStream(b))
	}
}

// readStream: stream info, gets, and the ephemeral consumers tenantmesh reads with (ordered
// pull consumers with no acknowledgement: kvwatch, jsx.Reader) on stream s. No acknowledgement
// and no durable consumer: nothing tenantmesh runs acknowledges a message or makes a durable
// consumer, so no role may ack (or create) one in another role's name. Consumer names are
// single subject tokens, which permissions cannot match by a role's prefix, so a role may
// still delete or look up another's ephemeral consumer on a stream both read; its owner
// makes a new one at once (docs/security.md).
func (p *perms) readStream(s string) {
	api := "$JS.API."
	p.Pub = append(p.Pub,
		api+"STREAM.INFO."+s, api+"STREAM.MSG.GET."+s,
		api+"DIRECT.GET."+s, api+"DIRECT.GET."+s+".>",
		api+"CONSUMER.CREATE."+s, api+"CONSUMER.CREATE."+s+".>",
		api+"CONSUMER.INFO."+s+".>", api+"CONSUMER.DELETE."+s+".>",
		api+"CONSUMER.MSG.NEXT."+s+".>",
		api+"CONSUMER.NAMES."+s, api+"CONSUMER.LIST."+s,
		"$JS.FC."+s+".>",
	)
}

// ownStream: read, plus create, update, purge and delete messages.
func (p *perms) ownStream(s string) {
	p.readStream(s)
	api := "$JS.API."
	p.Pub = append(p.Pub, api+"STREAM.CREATE."+s, api+"STREAM.UPDATE."+s,
		api+"STREAM.PURGE."+s, api+"STREAM.MSG.DELETE."+s)
}

func (p *perms) writeKV(bucket, keys string) {
	p.Pub = append(p.Pub, jsx.KVSubject(bucket, keys))
}

func (p *perms) publishAudit(kind string) {
	p.Pub = append(p.Pub, "tm.audit."+kind+".>")
}

func objectStream(bucket string) string { return "OBJ_" + bucket }
