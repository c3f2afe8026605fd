package shardkit

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/gatesig"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// EnvAdminToken is the environment variable read for Config.AdminToken when the field is empty.
const EnvAdminToken = "TM_ADMIN_TOKEN"

// Config configures a Shard. Store, ID and URL are required; every other field has a default
// documented beside it.
type Config struct {
	// Store is the NATS schema store; required.
	Store *schema.Store
	// Watcher, if set, is a placement watcher of the instance's kind that the caller runs and
	// shares among the instances it hosts in one process (each would otherwise hold its own
	// copy of the kind's placements); it must confirm its view (placement.Config.Confirm, at
	// most a quarter of the kind's lease), since the instances' lease is its confirmations.
	// Default: the instance makes and runs its own, confirming every Confirm.
	Watcher *placement.Watcher
	// ID names this instance: kind, shard and instance; required.
	ID schema.InstanceID
	// URL is where this instance serves HTTP (absolute http(s) URL); required.
	URL string
	// Capacity is the number of tenants the instance can host. Default: the kind's capacity.
	Capacity int
	// Labels and Version are published in the instance directory.
	Labels  map[string]string
	Version string
	// DiskPath names the filesystem whose use load reports and the directory carry (the
	// instance's data). Default the working directory.
	DiskPath string
	// Routes this instance serves, published in the route registry (Aether routing) while it runs and
	// removed on shutdown. An empty Kind means ID.Kind.
	Routes []schema.Route

	// Hooks connect the service's state to moves; the zero value suits a stateless service.
	Hooks Hooks

	// Forward makes the gate proxy requests for tenants this shard does not own to the owner's
	// live instances instead of answering 421 (the Queen coordinator: clients may call any instance).
	Forward bool
	// ForwardFallback lets this instance serve a forwarded tenant itself when forwarding fails
	// safely twice (the owner's instances refused the connection, or the request is idempotent
	// and failed before an answer), or when the owner has no live instance: the answer carries
	// X-Fallback: true (the Queen coordinator's local fallback). The request then runs here
	// without ownership, so it is only for kinds whose requests any instance may serve; a kind
	// with single_writer (aggregate) refuses it: Run fails, and a kind switched to single
	// writer later never falls back. Requires Forward.
	ForwardFallback bool
	// ForwardRetries is how many other instances of the owner a forwarded request may try after
	// the first, when that is safe. Default 2.
	ForwardRetries int
	// ForwardTimeout bounds one forwarded request, all attempts included. Default: the kind's
	// forward_timeout (its load config, the Queen coordinator's; 5s when unset).
	ForwardTimeout time.Duration
	// ConnectTimeout bounds connecting to a peer to forward to it, when Transport is the
	// default. Default: the kind's connect_timeout (its load config; 1s when unset).
	ConnectTimeout time.Duration
	// MaxForwardBody is the largest request body buffered so a forward can be retried; larger
	// bodies are streamed and not retried. Default 1 MiB.
	MaxForwardBody int64
	// Transport carries forwarded requests. Default: a clone of http.DefaultTransport that
	// dials within the connect timeout (ConnectTimeout).
	Transport http.RoundTripper

	// GatewayKey, if set, is this kind's gateway key (internal/gatesig; `rebalance auth
	// gate-key` makes it from the gateways' key): the gate then serves only requests that
	// carry a gateway's valid X-Tm-Proof, made within GatewaySkew (default 30s) of this
	// instance's clock, and answers others 403 before it reads anything else. Without it the
	// gate believes x-tenant-id, x-tm-epoch and x-tm-subject from whoever reaches the port:
	// run so only where nothing but gateways can (deploy/k8s's NetworkPolicies).
	GatewayKey  []byte
	GatewaySkew time.Duration
	// gateProof verifies X-Tm-Proof with GatewayKey (made by withDefaults).
	gateProof *gatesig.Signer

	// AdminToken is the bearer token /admin/* requires. Default $TM_ADMIN_TOKEN. Without a
	// token, admin routes answer 403: they are refused, never open.
	AdminToken string

	// DrainTimeout bounds how long a drain waits for in-flight requests. Default 10s.
	DrainTimeout time.Duration
	// ShutdownGrace is how long Shutdown keeps serving new requests after it reported the
	// instance not ready and draining, so routers stop sending before requests are refused.
	// Default 0 (refuse at once); binaries behind a gateway should set about 2 heartbeats.
	ShutdownGrace time.Duration
	// EpochWait bounds how long a request carrying an epoch newer than the local placement
	// snapshot waits for the snapshot to catch up. Default 2s.
	EpochWait time.Duration
	// Heartbeat is the interval of load reports (core NATS), which gateways and the rebalancer
	// hear as the instance's heartbeat. Default 1s.
	Heartbeat time.Duration
	// Confirm is how often the instance confirms its view of placement with the placement
	// stream's leader (one request); it serves its tenants only while the newest confirmation
	// is younger than the kind's lease (KindConfig.Lease, 5s by default), so a shard cut off
	// from NATS or frozen stops serving before a takeover may give its tenants to another
	// shard. Default 1s, and at most a quarter of the lease.
	Confirm time.Duration
	// DirectoryRefresh is how often the directory entry (tm_instances, a replicated JetStream
	// write) is rewritten when nothing in it changed; a change of status, URL, capacity,
	// labels or version is written at the next Heartbeat. Readers allow for it before they
	// call the instance late (schema.Thresholds). Default 15s; at least Heartbeat, and well
	// under the sweeper's OfflineAfter (2m).
	DirectoryRefresh time.Duration
	// WarmRetry is the pause before Warm is called again when it failed or returned short of
	// the fence. Default 500ms.
	WarmRetry time.Duration
	// VerifyWait bounds how long a move's source, for a kind whose config asks for verified
	// moves, waits for the target's state digests before it releases the tenant (without them it
	// releases: a target that died cannot be compared). Default 10s.
	VerifyWait time.Duration
	// TopN is how many tenants get their own metric labels; the rest are "other". Default 20.
	// Load reports carry the same number of busiest tenants.
	TopN int
	// TopNEvery is how often the labelled set is recomputed. Default 15s.
	TopNEvery time.Duration

	// Registerer receives the shard's metrics; Gatherer serves /metrics. If Registerer is nil a
	// private registry is used. If Gatherer is nil, Registerer is used when it is a Gatherer,
	// else prometheus.DefaultGatherer.
	Registerer prometheus.Registerer
	Gatherer   prometheus.Gatherer
	// Logger; if nil, logs are discarded.
	Logger *slog.Logger
	// Now is the clock used for liveness decisions. Default time.Now.
	Now func() time.Time
}

// Hooks are what a stateful service implements so shardkit can move its tenants. Every hook is
// optional: with the zero Hooks, warm-up is immediate and drain releases nothing.
type Hooks struct {
	// Warm brings the tenant's state up to at least fence (0: as far as known now). It is called
	// when this shard becomes a move's target, and again at handoff with the source's fence. Its
	// ctx is cancelled if the move is aborted.
	Warm func(ctx context.Context, tenant string, fence uint64) error
	// Applied is the tenant's last applied sequence. Default: always 0.
	Applied func(tenant string) uint64
	// Fence is the sequence a drained source reports as the fence at handoff. Default Applied.
	Fence func(tenant string) uint64
	// Lag is the tenant's count of entries not yet applied. Default fence - applied.
	Lag func(tenant string) uint64
	// Release drops the tenant's state once this shard no longer serves it (after a drain, after
	// a move's commit, or when a move to this shard is aborted).
	Release func(ctx context.Context, tenant string) error
	// Reload is called by POST /admin/reload after the instance re-registered.
	Reload func(ctx context.Context) error
	// Report adds the service's own figures (the runner's recent runs) to each load report
	// before it is published. It runs on the heartbeat loop and must not block.
	Report func(r *schema.LoadReport)
	// Sizes lists the stored size of every tenant the instance hosts, from figures the service
	// keeps (it is called every heartbeat: no NATS round trip). Default: none.
	Sizes func() []schema.TenantSize
	// Digest reduces the tenant's state at sequence at (a move's fence) to a digest two
	// instances holding the same state make alike, for move verification (schema.BucketVerify,
	// `rebalance verify`). On a move's target it is called once Warm reached the fence, before
	// the commit, so inside the handoff pause: keep it quick. On the source it is called just
	// after Fence, and the handoff does not wait for it: the state must still be at the fence
	// then (or the service keeps what it needs at Fence). An error (the state moved past at)
	// leaves the move unverified, never a mismatch. Default: no digest is recorded.
	Digest func(ctx context.Context, tenant string, at uint64) (schema.Digest, error)
	// DigestBeside takes the target's Digest beside the commit instead of before it, out of the
	// handoff pause: for a service whose digest costs round trips and whose state at the fence
	// stays what it reads until the digest is recorded (the runner leaves out jobs queued at
	// a later epoch, and claims nothing of the tenant until both sides' digests are in).
	DigestBeside bool
	// Takeover is called on a takeover's target (the former owner has no live instance, or was
	// fenced for another reason, and does not drain): it must make the former owner's late
	// writes fail in the service's store from now on (the events package stores an epoch
	// marker that every later append of an older writer trips on) and return the sequence
	// that Warm must then reach (0: just the newest state). epoch is the one this shard will
	// own the tenant at. Without it the target warms from the store as it is: right for a
	// service that only reads (projection) or whose every write is already refused to a
	// former owner (the runner's claims and effect markers); a service with writes of its own
	// must implement it, or run with failover off (KindConfig.Failover).
	Takeover func(ctx context.Context, tenant string, epoch uint64) (fence uint64, err error)
}

func (h Hooks) applied(tenant string) uint64 {
	if h.Applied == nil {
		return 0
	}
	return h.Applied(tenant)
}

func (h Hooks) fence(tenant string) uint64 {
	if h.Fence != nil {
		return h.Fence(tenant)
	}
	return h.applied(tenant)
}

func (h Hooks) lag(tenant string, fence, applied uint64) uint64 {
	if h.Lag != nil {
		return h.Lag(tenant)
	}
	if fence > applied {
		return fence - applied
	}
	return 0
}

// ErrConfig is wrapped by every configuration error.
var ErrConfig = errors.New("shardkit: invalid config")

func (c Config) withDefaults() Config {
	if c.ForwardRetries <= 0 {
		c.ForwardRetries = 2
	}
	if c.MaxForwardBody <= 0 {
		c.MaxForwardBody = 1 << 20
	}
	if c.AdminToken == "" {
		c.AdminToken = os.Getenv(EnvAdminToken)
	}
	if c.GatewaySkew <= 0 {
		c.GatewaySkew = 30 * time.Second
	}
	if len(c.GatewayKey) > 0 && c.gateProof == nil {
		c.gateProof = gatesig.NewSigner(c.GatewayKey)
	}
	if c.DrainTimeout <= 0 {
		c.DrainTimeout = 10 * time.Second
	}
	if c.EpochWait <= 0 {
		c.EpochWait = 2 * time.Second
	}
	if c.Heartbeat <= 0 {
		c.Heartbeat = time.Second
	}
	if c.Confirm <= 0 {
		c.Confirm = time.Second
	}
	if c.DirectoryRefresh <= 0 {
		c.DirectoryRefresh = 15 * time.Second
	}
	c.DirectoryRefresh = max(c.DirectoryRefresh, c.Heartbeat)
	if c.WarmRetry <= 0 {
		c.WarmRetry = 500 * time.Millisecond
	}
	if c.DiskPath == "" {
		c.DiskPath = "."
	}
	if c.VerifyWait <= 0 {
		c.VerifyWait = 10 * time.Second
	}
	if c.TopN <= 0 {
		c.TopN = 20
	}
	if c.TopNEvery <= 0 {
		c.TopNEvery = 15 * time.Second
	}
	if c.Registerer == nil {
		c.Registerer = prometheus.NewRegistry()
	}
	if c.Gatherer == nil {
		if g, ok := c.Registerer.(prometheus.Gatherer); ok {
			c.Gatherer = g
		} else {
			c.Gatherer = prometheus.DefaultGatherer
		}
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return c
}

func (c Config) valid() error {
	if c.Store == nil {
		return fmt.Errorf("%w: Store is required", ErrConfig)
	}
	if err := c.ID.Check(); err != nil {
		return fmt.Errorf("%w: ID: %w", ErrConfig, err)
	}
	inst := schema.Instance{InstanceID: c.ID, URL: c.URL, Capacity: c.Capacity}
	if err := inst.Validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	if c.Watcher != nil && !c.Watcher.Has(c.ID.Kind) {
		return fmt.Errorf("%w: Watcher does not follow kind %s", ErrConfig, c.ID.Kind)
	}
	if c.Watcher != nil && c.Watcher.ConfirmEvery() <= 0 {
		return fmt.Errorf("%w: Watcher must confirm its view (placement.Config.Confirm): the instances' lease is its confirmations", ErrConfig)
	}
	if c.ForwardFallback && !c.Forward {
		return fmt.Errorf("%w: ForwardFallback needs Forward", ErrConfig)
	}
	for _, r := range c.Routes {
		if r.Kind == "" {
			r.Kind = c.ID.Kind
		}
		if err := r.Validate(); err != nil {
			return fmt.Errorf("%w: route: %w", ErrConfig, err)
		}
	}
	return nil
}
