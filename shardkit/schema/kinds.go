package schema

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
)

// Policy is how a kind places tenants (docs/design.md "Policies").
type Policy string

const (
	// PolicyManaged: placement is written by the rebalancer; tenants move only through moves.
	PolicyManaged Policy = "managed"
	// PolicyAffinity: the gateway assigns tenants to instances with room, up to Multiplex owners
	// (the prerender manager, the prerender manager).
	PolicyAffinity Policy = "affinity"
	// PolicyLoad: soft affinity with a TTL driven by load scores (the Queen coordinator, the Queen coordinator).
	PolicyLoad Policy = "load"
)

// Unplaced is what the gateway does with a tenant that has no placement.
type Unplaced string

const (
	// UnplacedAssign assigns the tenant to the least-loaded shard with room (by KV create).
	UnplacedAssign Unplaced = "assign"
	// UnplacedReject answers 404.
	UnplacedReject Unplaced = "reject"
)

// KindConfig is one kind's configuration, key <kind> in tm_kinds. Zero fields take the defaults
// documented on each field (see WithDefaults).
type KindConfig struct {
	Kind   string `json:"kind"`
	Policy Policy `json:"policy"` // default managed
	// Unplaced is the rule for tenants without placement. Default assign.
	Unplaced Unplaced `json:"unplaced,omitempty"`
	// Capacity is the default number of tenants an instance hosts when it registers none.
	// Default 1000 (affinity: 4, the prerender manager's page pool).
	Capacity int `json:"capacity,omitempty"`
	// HoldBudget is how long the gateway holds a tenant's requests during a handoff. Default 2s.
	HoldBudget Duration `json:"hold_budget,omitempty"`
	// Overlap marks a kind that only reads: moves skip the hold (warm then cut over), and a
	// gateway sends any request again on another instance after an attempt whose outcome is
	// unknown (nothing it could have done needs undoing). Default: on for projection.
	Overlap bool `json:"overlap,omitempty"`
	// SingleWriter sends each tenant's requests to one instance of its shard (rendezvous hashing
	// over the live instances: a tenant changes instance only when its instance leaves), so
	// sibling instances do not race on the same state. Default: on for aggregate.
	SingleWriter bool `json:"single_writer,omitempty"`
	// Idempotent declares that the kind's services apply a request carrying an Idempotency-Key
	// once however often it is sent (the aggregate's commands, the runner's jobs): the gateway
	// may send such a request again on another instance after an attempt whose outcome is
	// unknown (the connection broke after it was sent), so the client gets one answer instead
	// of a 502 to retry itself. Default: on for aggregate and runner.
	Idempotent bool `json:"idempotent,omitempty"`
	// DegradedErrorRate makes an instance report itself degraded while its error rate (5xx
	// answers over requests, per heartbeat interval with at least DegradedMinRequests requests)
	// is at least this (the multi-host design's "degraded: high failure rate"). Default 0.5;
	// negative: never.
	DegradedErrorRate float64 `json:"degraded_error_rate,omitempty"`
	// UpstreamTimeout bounds one proxied request, all of it: long polls, synchronous jobs and
	// commands retried through a NATS election included, so not Aether's 5 s, which bounds one
	// forward attempt before another node is tried (docs/decisions.md). Default 30s.
	UpstreamTimeout Duration `json:"upstream_timeout,omitempty"`
	// RateLimit, if set, limits each tenant's requests to this kind (429 beyond it).
	RateLimit *RateLimit `json:"rate_limit,omitempty"`
	// Affinity configures PolicyAffinity.
	Affinity *AffinityConfig `json:"affinity,omitempty"`
	// Load configures PolicyLoad.
	Load *LoadConfig `json:"load,omitempty"`
	// Warmup makes the rebalancer choose each move's warm-up strategy (snapshot migration or
	// cold replay) from the tenant's size. Default: on for aggregate (see WarmupConfig).
	Warmup *WarmupConfig `json:"warmup,omitempty"`
	// Verify checks every move of the kind as it ends (move verification, BucketVerify): the
	// source keeps the tenant's state until the target's digest at the fence equals its own
	// (a mismatch keeps it for good and is alerted), and the rebalancer judges and audits
	// each move. Off by default; `rebalance verify` judges any move whose digests were recorded.
	Verify bool `json:"verify,omitempty"`
	// Lease is how long an instance of the kind keeps serving its tenants after it last
	// confirmed, with the placement stream's leader, that its view of placement is current: a
	// shard cut off from NATS (or frozen) stops serving within it, and a takeover of its
	// tenants waits it out (unless the shard's instances are gone or report drained). Longer
	// tolerates longer NATS outages without refusing requests; shorter fails over a frozen or
	// partitioned shard sooner. Default 5s; instances publish the lease they run with, and a
	// takeover waits the longest of them.
	Lease Duration `json:"lease,omitempty"`
	// Failover is whether the rebalancer's autopilot takes over the tenants of a shard of this
	// kind that has no live instance: "auto" (the default) or "off" (a person decides).
	Failover Failover `json:"failover,omitempty"`
}

// Failover is a kind's rule for shards without a live instance.
type Failover string

const (
	// FailoverAuto: the autopilot moves the tenants of a dead shard to live ones (a takeover).
	FailoverAuto Failover = "auto"
	// FailoverOff: tenants wait for their shard to come back, or for an operator's plan.
	FailoverOff Failover = "off"
)

// DefaultLease is KindConfig.Lease's default.
const DefaultLease = 5 * time.Second

// WarmupConfig is a kind's rule for choosing a move's warm-up strategy by tenant size (the
// Cloudlysis PRD's "the rebalancer selecting the strategy based on tenant size/SLO"): a tenant
// with a snapshot loads it when its events weigh more than SnapshotAboveBytes, or when a cold
// replay is predicted to take longer than SLO; otherwise it replays. Predictions are bytes
// over the two throughputs. Zero fields take the defaults, measured by the aggregate's
// BenchmarkWarm on 2 cores (docs/benchmarks.md): 100,000 events of ~250 bytes replay in ~1.1 s.
type WarmupConfig struct {
	SnapshotAboveBytes  uint64   `json:"snapshot_above_bytes"`   // default 1 MiB
	SLO                 Duration `json:"slo"`                    // default 5s
	ReplayBytesPerSec   float64  `json:"replay_bytes_per_sec"`   // default 20 MiB/s
	SnapshotBytesPerSec float64  `json:"snapshot_bytes_per_sec"` // default 50 MiB/s
}

// WithDefaults fills zero fields with their documented defaults.
func (w WarmupConfig) WithDefaults() WarmupConfig {
	if w.SnapshotAboveBytes == 0 {
		w.SnapshotAboveBytes = 1 << 20
	}
	if w.SLO <= 0 {
		w.SLO = Duration(5 * time.Second)
	}
	if !(w.ReplayBytesPerSec > 0) {
		w.ReplayBytesPerSec = 20 << 20
	}
	if !(w.SnapshotBytesPerSec > 0) {
		w.SnapshotBytesPerSec = 50 << 20
	}
	return w
}

// RateLimit is a token bucket per tenant.
type RateLimit struct {
	PerSecond float64 `json:"per_second"`
	Burst     int     `json:"burst"`
}

// AffinityConfig holds the prerender manager's settings.
type AffinityConfig struct {
	// Multiplex is M, the most instances that serve one tenant at once. Default 1.
	Multiplex int `json:"multiplex"`
	// HealthInterval is how often the gateway polls each server. Default 10s.
	HealthInterval Duration `json:"health_interval"`
	// ServerTimeout bounds one proxied request. Default 30s.
	ServerTimeout Duration `json:"server_timeout"`
	// DefaultPort is used to infer a registering server's URL from its peer address. Default 4223.
	DefaultPort int `json:"default_port"`
}

// LoadConfig holds the Queen coordinator's settings.
type LoadConfig struct {
	AffinityTTL      Duration `json:"affinity_ttl"`      // default 5m
	MigrateThreshold float64  `json:"migrate_threshold"` // default 0.70
	BreakThreshold   float64  `json:"break_threshold"`   // default 0.90
	MigrateMinGain   float64  `json:"migrate_min_gain"`  // default 0.15
	ForwardThreshold float64  `json:"forward_threshold"` // default 0.10
	EMAAlpha         float64  `json:"ema_alpha"`         // default 0.3
	ForwardTimeout   Duration `json:"forward_timeout"`   // default 5s
	ConnectTimeout   Duration `json:"connect_timeout"`   // default 1s
	CircuitFailures  int      `json:"circuit_failures"`  // default 3
	CircuitRetry     Duration `json:"circuit_retry"`     // default 5s
	CircuitMaxRetry  Duration `json:"circuit_max_retry"` // default 5m
	// QueueAffinityThreshold: a producer route's key is queue:group while the queue has at most
	// this many groups with waiting consumers, and the queue alone beyond it. Default 10.
	QueueAffinityThreshold int `json:"queue_affinity_threshold"`
}

// DefaultKindConfig is the configuration a kind gets when it is first registered.
func DefaultKindConfig(kind string) KindConfig {
	c := KindConfig{Kind: kind, SingleWriter: kind == "aggregate", Idempotent: kind == "aggregate" || kind == "runner", Overlap: kind == "projection"}
	if kind == "aggregate" {
		c.Warmup = &WarmupConfig{}
	}
	return c.WithDefaults()
}

// WithDefaults fills zero fields with their documented defaults.
func (c KindConfig) WithDefaults() KindConfig {
	if c.Policy == "" {
		c.Policy = PolicyManaged
	}
	if c.Unplaced == "" {
		c.Unplaced = UnplacedAssign
	}
	if c.Capacity <= 0 {
		c.Capacity = 1000
		if c.Policy == PolicyAffinity {
			c.Capacity = 4
		}
	}
	if c.HoldBudget <= 0 {
		c.HoldBudget = Duration(2 * time.Second)
	}
	if c.UpstreamTimeout <= 0 {
		c.UpstreamTimeout = Duration(30 * time.Second)
	}
	if c.DegradedErrorRate == 0 {
		c.DegradedErrorRate = 0.5
	}
	if c.Lease <= 0 {
		c.Lease = Duration(DefaultLease)
	}
	if c.Failover == "" {
		c.Failover = FailoverAuto
	}
	if c.Warmup != nil {
		w := c.Warmup.WithDefaults()
		c.Warmup = &w
	}
	if c.Policy == PolicyAffinity {
		a := AffinityConfig{}
		if c.Affinity != nil {
			a = *c.Affinity
		}
		if a.Multiplex <= 0 {
			a.Multiplex = 1
		}
		if a.HealthInterval <= 0 {
			a.HealthInterval = Duration(10 * time.Second)
		}
		if a.ServerTimeout <= 0 {
			a.ServerTimeout = Duration(30 * time.Second)
		}
		if a.DefaultPort <= 0 {
			a.DefaultPort = 4223
		}
		c.Affinity = &a
	}
	if c.Policy == PolicyLoad {
		l := LoadConfig{}
		if c.Load != nil {
			l = *c.Load
		}
		l = l.withDefaults()
		c.Load = &l
	}
	return c
}

func (l LoadConfig) withDefaults() LoadConfig {
	def := func(v *float64, d float64) {
		if *v <= 0 {
			*v = d
		}
	}
	defD := func(v *Duration, d time.Duration) {
		if *v <= 0 {
			*v = Duration(d)
		}
	}
	defD(&l.AffinityTTL, 5*time.Minute)
	def(&l.MigrateThreshold, 0.70)
	def(&l.BreakThreshold, 0.90)
	def(&l.MigrateMinGain, 0.15)
	def(&l.ForwardThreshold, 0.10)
	def(&l.EMAAlpha, 0.3)
	defD(&l.ForwardTimeout, 5*time.Second)
	defD(&l.ConnectTimeout, time.Second)
	if l.CircuitFailures <= 0 {
		l.CircuitFailures = 3
	}
	defD(&l.CircuitRetry, 5*time.Second)
	defD(&l.CircuitMaxRetry, 5*time.Minute)
	if l.QueueAffinityThreshold <= 0 {
		l.QueueAffinityThreshold = 10
	}
	return l
}

// Validate reports the first problem with c, wrapping ErrInvalid or ErrInvalidName.
func (c KindConfig) Validate() error {
	if err := CheckName("kind", c.Kind); err != nil {
		return err
	}
	switch c.Policy {
	case PolicyManaged, PolicyAffinity, PolicyLoad:
	default:
		return fmt.Errorf("%w: kind %s: policy %q is not one of managed, affinity, load", ErrInvalid, c.Kind, c.Policy)
	}
	switch c.Unplaced {
	case UnplacedAssign, UnplacedReject:
	default:
		return fmt.Errorf("%w: kind %s: unplaced %q is not one of assign, reject", ErrInvalid, c.Kind, c.Unplaced)
	}
	switch c.Failover {
	case FailoverAuto, FailoverOff:
	default:
		return fmt.Errorf("%w: kind %s: failover %q is not one of auto, off", ErrInvalid, c.Kind, c.Failover)
	}
	if c.Lease.D() < 500*time.Millisecond || c.Lease.D() > 5*time.Minute {
		return fmt.Errorf("%w: kind %s: lease %s must be between 500ms and 5m", ErrInvalid, c.Kind, c.Lease.D())
	}
	if c.RateLimit != nil && (c.RateLimit.PerSecond <= 0 || c.RateLimit.Burst < 1) {
		return fmt.Errorf("%w: kind %s: rate_limit needs per_second > 0 and burst >= 1", ErrInvalid, c.Kind)
	}
	if l := c.Load; l != nil && !(l.MigrateThreshold < l.BreakThreshold && l.BreakThreshold <= 1) {
		return fmt.Errorf("%w: kind %s: load thresholds need migrate < break <= 1", ErrInvalid, c.Kind)
	}
	return nil
}

// Kinds is the handle on the kinds' configs, the bucket tm_kinds: store.Kinds().Get(ctx, kind).
type Kinds struct{ s *Store }

// Kinds is the handle on the kinds' configs.
func (s *Store) Kinds() Kinds { return Kinds{s} }

// Get reads one kind's config; an unregistered kind is ErrUnknownKind.
func (ks Kinds) Get(ctx context.Context, kind string) (KindConfig, error) {
	if err := CheckName("kind", kind); err != nil {
		return KindConfig{}, err
	}
	var c KindConfig
	if _, err := ks.s.js.Records(ks.s.kinds).Get(ctx, kind, &c); err != nil {
		if errors.Is(err, ErrNotFound) {
			return KindConfig{}, fmt.Errorf("%w: %q is not registered in %s ; register the kind first", ErrUnknownKind, kind, BucketKinds)
		}
		return KindConfig{}, err
	}
	return c.WithDefaults(), nil
}

// List lists every registered kind's config.
func (ks Kinds) List(ctx context.Context) ([]KindConfig, error) {
	var out []KindConfig
	_, err := jsx.ListJSON(ctx, ks.s.js.Records(ks.s.kinds), ">", func(_ string, _ uint64, c KindConfig) {
		out = append(out, c.WithDefaults())
	})
	return out, err
}

// Put registers or replaces a kind's config and creates its placement bucket.
func (ks Kinds) Put(ctx context.Context, c KindConfig) (KindConfig, error) {
	c = c.WithDefaults()
	if err := c.Validate(); err != nil {
		return KindConfig{}, err
	}
	if _, err := ks.s.placementKVCreate(ctx, c.Kind); err != nil {
		return KindConfig{}, err
	}
	if _, err := ks.s.js.Records(ks.s.kinds).Put(ctx, c.Kind, c); err != nil {
		return KindConfig{}, err
	}
	return c, nil
}

// Ensure registers c if its kind is absent and returns the stored config either way.
func (ks Kinds) Ensure(ctx context.Context, c KindConfig) (KindConfig, error) {
	c = c.WithDefaults()
	if err := c.Validate(); err != nil {
		return KindConfig{}, err
	}
	if _, err := ks.s.placementKVCreate(ctx, c.Kind); err != nil {
		return KindConfig{}, err
	}
	if _, err := ks.s.js.Records(ks.s.kinds).Create(ctx, c.Kind, c); err != nil {
		if errors.Is(err, ErrConflict) {
			return ks.Get(ctx, c.Kind)
		}
		return KindConfig{}, err
	}
	return c, nil
}

func (s *Store) placementKVCreate(ctx context.Context, kind string) (jetstream.KeyValue, error) {
	s.mu.Lock()
	kv, ok := s.placements[kind]
	s.mu.Unlock()
	if ok {
		return kv, nil
	}
	kv, err := s.js.EnsureSharedKV(ctx, jsx.KVSpec{Bucket: PlacementBucket(kind), Description: "tenantmesh placement of kind " + kind})
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.placements[kind] = kv
	s.mu.Unlock()
	return kv, nil
}
