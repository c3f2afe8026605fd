// Package schema is the one place that names and reads/writes tenantmesh's state in NATS.
//
// # Overview
//
// Every bucket, stream and subject of docs/design.md's "State in NATS" table is spelled here and
// nowhere else. Gateway, rebalancer and services open a [Store] and use its typed API:
//
//   - kind config ([KindConfig]) in KV tm_kinds;
//   - placement ([Placement]) in KV tm_placement_<kind>, changed only by compare-and-set;
//   - the instance directory ([Instance]) in KV tm_instances;
//   - the route registry ([Route]) in KV tm_routes;
//   - tenant signals ([TenantSignal]) in KV tm_tenant_state;
//   - rebalancer records and the leader [Lease] in KV tm_rebalance;
//   - the audit journal ([AuditEvent]) in stream TM_AUDIT;
//   - load telemetry ([LoadReport]) on core NATS subjects tm.load.>;
//   - signal notes (a signal's key and revision, for the shard a tenant moves to) on core NATS
//     subjects tm.signal.<kind>.<shard>;
//   - application data names (TM_EVENTS, TM_JOBS) for the services.
//
// Values are JSON a person can read with the nats CLI. Names that become KV key or subject
// tokens are validated first, with errors that say what is allowed.
package schema

import (
	"encoding/base64"
	"fmt"
	"strings"

	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
)

// Buckets and streams.
const (
	BucketKinds     = "tm_kinds"
	BucketInstances = "tm_instances"
	// BucketMembers is the instance directory without heartbeats: an entry changes only when
	// its instance registers, changes status, URL, capacity, labels or version, or is marked
	// offline or removed by the sweeper. Shard instances follow it (tm_instances carries a
	// write per instance per second, which would cost every instance every other's heartbeat).
	BucketMembers     = "tm_members"
	BucketRoutes      = "tm_routes"
	BucketTenantState = "tm_tenant_state"
	BucketRebalance   = "tm_rebalance"
	// BucketSnapshots is the object store holding compacted placement snapshots.
	BucketSnapshots = "tm_snapshots"

	StreamAudit  = "TM_AUDIT"
	StreamEvents = "TM_EVENTS"
	StreamJobs   = "TM_JOBS"

	placementBucketPrefix = "tm_placement_"
)

// BucketRunnerSchedules holds the runner's recurring schedules, key <tenant>.<schedule id>:
// the cron expression, the job to create and the next due time (advanced by compare-and-set,
// so each due time fires once whichever instance reaches it).
var BucketRunnerSchedules = ServiceBucket("runner", "schedules")

// Subjects.
const (
	subjectAuditPrefix = "tm.audit."
	subjectLoadPrefix  = "tm.load."
	subjectSignalNote  = "tm.signal."
	subjectPingPrefix  = "tm.ping."
	// SubjectAuditAll matches every audit event.
	SubjectAuditAll = "tm.audit.>"
	// SubjectLoadAll matches every load report.
	SubjectLoadAll = "tm.load.>"
	// SubjectEventsAll matches every application event.
	SubjectEventsAll = "events.>"
	// SubjectJobsAll matches every job.
	SubjectJobsAll = "jobs.>"
)

// PlacementBucket names the placement KV bucket of kind.
func PlacementBucket(kind string) string { return placementBucketPrefix + kind }

// PlacementStream names the stream behind the placement bucket of kind.
func PlacementStream(kind string) string { return jsx.KVStream(PlacementBucket(kind)) }

// PlacementSubjectPrefix is the subject prefix of placement keys of kind in its stream.
func PlacementSubjectPrefix(kind string) string { return jsx.KVSubject(PlacementBucket(kind), "") }

// SnapshotObject names the object holding kind's compacted placement snapshot.
func SnapshotObject(kind string) string { return "placement." + kind }

// LoadSubject is the telemetry subject of one instance.
func LoadSubject(id InstanceID) string {
	return subjectLoadPrefix + id.Kind + "." + id.Shard + "." + id.Instance
}

// PingSubject is where one instance answers the rebalancer's liveness probe: a request there
// with no responders tells that the instance's NATS connection is gone (the process died, or
// its server closed the connection), in one round trip.
func PingSubject(id InstanceID) string {
	return subjectPingPrefix + id.Kind + "." + id.Shard + "." + id.Instance
}

// PingSubjectShard matches the probes of every instance of kind's shard (what a shard instance
// may subscribe to).
func PingSubjectShard(kind, shard string) string {
	return subjectPingPrefix + kind + "." + shard + ".*"
}

// SubjectPingAll matches every instance's probe (what the rebalancer may publish to).
const SubjectPingAll = "tm.ping.>"

// SignalNoteSubject is where the writers of tenant signals note them for shard, the shard a
// tenant moves to (or owns it): tm.signal.<kind>.<shard>.
func SignalNoteSubject(kind, shard string) string { return subjectSignalNote + kind + "." + shard }

// SignalNoteSubjectKind matches the signal notes for every shard of kind (what a shard may
// publish).
func SignalNoteSubjectKind(kind string) string { return subjectSignalNote + kind + ".*" }

// LoadSubjectKind matches every load report of kind.
func LoadSubjectKind(kind string) string { return subjectLoadPrefix + kind + ".>" }

// AuditSubject is the subject of an audit event about kind and tenant. Events that concern no
// tenant use "-" for it; events that concern no kind use "-" too.
func AuditSubject(kind, tenant string) string {
	if kind == "" {
		kind = "-"
	}
	if tenant == "" {
		tenant = "-"
	}
	return subjectAuditPrefix + kind + "." + tenant
}

// EventSubject is the subject of an aggregate's events: events.<tenant>.<type>.<id>.
func EventSubject(tenant, aggType, aggID string) string {
	return "events." + tenant + "." + aggType + "." + aggID
}

// TenantEvents matches every event of tenant.
func TenantEvents(tenant string) string { return "events." + tenant + ".>" }

// JobSubject is the subject of a tenant's job queue entries: jobs.<tenant>.<rest>.
func JobSubject(tenant, rest string) string { return "jobs." + tenant + "." + rest }

// TenantJobs matches every job subject of tenant.
func TenantJobs(tenant string) string { return "jobs." + tenant + ".>" }

// ServiceBucket names a service's own KV bucket (snapshots, views, job runs) for kind.
func ServiceBucket(kind, purpose string) string { return "tm_" + kind + "_" + purpose }

// MaxTenantLen is the longest tenant id accepted.
const MaxTenantLen = 128

// ValidTenant reports whether tenant is 1 to 128 characters of [A-Za-z0-9_-].
func ValidTenant(tenant string) bool {
	return len(tenant) >= 1 && len(tenant) <= MaxTenantLen && isToken(tenant)
}

// CheckTenant returns an error wrapping ErrInvalidTenant that says what is allowed.
func CheckTenant(tenant string) error {
	switch {
	case tenant == "":
		return fmt.Errorf("%w: the tenant id is empty; send 1 to %d characters of [A-Za-z0-9_-] in x-tenant-id", ErrInvalidTenant, MaxTenantLen)
	case len(tenant) > MaxTenantLen:
		return fmt.Errorf("%w: the tenant id has %d characters; at most %d are allowed", ErrInvalidTenant, len(tenant), MaxTenantLen)
	case !isToken(tenant):
		return fmt.Errorf("%w: %q has a character outside [A-Za-z0-9_-]", ErrInvalidTenant, truncate(tenant, 40))
	}
	return nil
}

// CheckName validates a kind, shard or instance name: 1 to 64 characters of [A-Za-z0-9_-].
// what names the thing in the error ("kind", "shard", ...).
func CheckName(what, name string) error {
	if name == "" || len(name) > 64 || !isToken(name) {
		return fmt.Errorf("%w: %s %q must be 1 to 64 characters of [A-Za-z0-9_-]", ErrInvalidName, what, truncate(name, 40))
	}
	return nil
}

func isToken(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// InstanceID names one process of a shard; its directory key is <kind>.<shard>.<instance>.
type InstanceID struct {
	Kind     string `json:"kind"`
	Shard    string `json:"shard"`
	Instance string `json:"instance"`
}

// Key is the instance's key in tm_instances and its id in route values.
func (id InstanceID) Key() string { return id.Kind + "." + id.Shard + "." + id.Instance }

func (id InstanceID) String() string { return id.Key() }

// Check validates every part of the id.
func (id InstanceID) Check() error {
	if err := CheckName("kind", id.Kind); err != nil {
		return err
	}
	if err := CheckName("shard", id.Shard); err != nil {
		return err
	}
	return CheckName("instance", id.Instance)
}

// ParseInstanceID parses a key made by InstanceID.Key.
func ParseInstanceID(key string) (InstanceID, error) {
	parts := strings.Split(key, ".")
	if len(parts) != 3 {
		return InstanceID{}, fmt.Errorf("%w: instance key %q is not <kind>.<shard>.<instance>", ErrInvalidName, truncate(key, 80))
	}
	id := InstanceID{Kind: parts[0], Shard: parts[1], Instance: parts[2]}
	return id, id.Check()
}

// routeKey encodes a route as a KV key: <kind>.<METHOD>.<base64url(prefix)>. Method "*" is
// ANY. The kind leads so that a shard's NATS user may write its own kind's routes only
// ($KV.tm_routes.<kind>.>, shardkit/natsperm).
func routeKey(kind, method, prefix string) string {
	if method == "" || method == "*" {
		method = "ANY"
	}
	return kind + "." + method + "." + base64.RawURLEncoding.EncodeToString([]byte(prefix))
}

// RouteKeyKind returns the kind a route key names, and false for a key without one (the
// format before routes were keyed by kind: <METHOD>.<base64url(prefix)>).
func RouteKeyKind(key string) (string, bool) {
	if strings.Count(key, ".") != 2 {
		return "", false
	}
	kind, _, _ := strings.Cut(key, ".")
	return kind, true
}

func signalKey(kind, tenant string, id InstanceID) string {
	return kind + "." + tenant + "." + id.Shard + "." + id.Instance
}
