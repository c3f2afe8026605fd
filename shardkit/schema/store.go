package schema

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/tenantmesh/tenantmesh/internal/backoff"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
)

// Options configure how a Store creates buckets and streams. The zero value suits one embedded
// server: one replica, file storage.
type Options struct {
	// Replicas for every bucket and stream the store creates: 1 embedded, 3 in a cluster.
	Replicas int
	// Storage for buckets and streams. Default: file.
	Storage jetstream.StorageType
	// AuditMaxAge bounds how long audit events are kept. Default: 30 days.
	AuditMaxAge time.Duration
	// AuditMaxBytes bounds the audit stream. Default: 1 GiB.
	AuditMaxBytes int64
	// Timeout bounds each NATS call that the caller's context leaves unbounded. Default: 5s.
	Timeout time.Duration
	// Logger receives warnings (for example skipped corrupt values). If nil, they are discarded.
	Logger *slog.Logger
	// DefaultKinds are registered with their defaults at Open if absent. Default: aggregate,
	// projection and runner.
	DefaultKinds []string
	// Attach opens tenantmesh's shared buckets and streams without creating or changing them:
	// one that is missing is waited for, since a process whose credentials may not create it
	// (a gateway, a shard) relies on the rebalancer to provision it (Provision), and the
	// default kinds are not registered. A service's own buckets (jsx.Client.EnsureKV) are
	// still created.
	Attach bool
}

func (o Options) jsx() jsx.Options {
	return jsx.Options{Replicas: o.Replicas, Storage: o.Storage, Timeout: o.Timeout, Logger: o.Logger, Attach: o.Attach}
}

func (o Options) withDefaults() Options {
	if o.Replicas <= 0 {
		o.Replicas = 1
	}
	if o.AuditMaxAge <= 0 {
		o.AuditMaxAge = 30 * 24 * time.Hour
	}
	if o.AuditMaxBytes <= 0 {
		o.AuditMaxBytes = 1 << 30
	}
	if o.Timeout <= 0 {
		o.Timeout = 5 * time.Second
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.DefaultKinds == nil {
		o.DefaultKinds = []string{"aggregate", "projection", "runner"}
	}
	return o
}

// Store reads and writes tenantmesh's state in NATS. It is safe for concurrent use. Each
// resource has its handle, a small value made per use: Placements(kind), Kinds(), Directory(),
// Routes(), Signals(), Audit(), Digests() and Rebalance().
type Store struct {
	js   *jsx.Client
	opts Options

	kinds, instances, members, routes, signals, rebalance jetstream.KeyValue

	mu         sync.Mutex
	placements map[string]jetstream.KeyValue

	snapMu sync.Mutex // one opening at a time; the handle is kept
	snaps  jetstream.ObjectStore

	verifyMu sync.Mutex // Digests().KV: one opening at a time; the handle is kept
	verify   jetstream.KeyValue
}

// Open connects a Store to nc, creating every missing bucket and stream, and registering the
// default kinds that are absent.
func Open(ctx context.Context, nc *nats.Conn, opts Options) (*Store, error) {
	opts = opts.withDefaults()
	js, err := jsx.New(nc, opts.jsx())
	if err != nil {
		return nil, fmt.Errorf("schema: %w", err)
	}
	s := &Store{js: js, opts: opts, placements: map[string]jetstream.KeyValue{}}
	buckets := []struct {
		dst     *jetstream.KeyValue
		name    string
		desc    string
		history uint8
	}{
		{&s.kinds, BucketKinds, "tenantmesh kind config", 5},
		{&s.instances, BucketInstances, "tenantmesh instance directory", 1},
		{&s.members, BucketMembers, "tenantmesh instance membership (changes only)", 1},
		{&s.routes, BucketRoutes, "tenantmesh route registry", 1},
		{&s.signals, BucketTenantState, "tenantmesh tenant signals", 1},
		{&s.rebalance, BucketRebalance, "tenantmesh plans, moves and leader lease", 1},
	}
	for _, b := range buckets {
		kv, err := s.js.EnsureSharedKV(ctx, jsx.KVSpec{Bucket: b.name, Description: b.desc, History: b.history})
		if err != nil {
			return nil, err
		}
		*b.dst = kv
	}
	if err := s.js.EnsureStream(ctx, jetstream.StreamConfig{
		Name:        StreamAudit,
		Description: "tenantmesh audit journal",
		Subjects:    []string{SubjectAuditAll},
		MaxAge:      s.opts.AuditMaxAge,
		MaxBytes:    s.opts.AuditMaxBytes,
		Discard:     jetstream.DiscardOld,
	}); err != nil {
		return nil, err
	}
	if s.opts.Attach {
		return s, nil
	}
	for _, k := range s.opts.DefaultKinds {
		if _, err := s.Kinds().Ensure(ctx, DefaultKindConfig(k)); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// Provision creates what Attach-mode processes wait for beyond Open's buckets: the
// application streams (TM_EVENTS, TM_JOBS), the placement snapshots' object store and the
// move verification bucket (tm_verify). The rebalancer provisions at start.
func (s *Store) Provision(ctx context.Context) error {
	if s.opts.Attach {
		return errors.New("schema: a store opened to attach cannot provision")
	}
	if err := s.EnsureEventsStream(ctx); err != nil {
		return err
	}
	if err := s.EnsureJobsStream(ctx); err != nil {
		return err
	}
	if _, err := s.Digests().KV(ctx); err != nil {
		return err
	}
	_, err := s.Snapshots(ctx)
	return err
}

// JS is the JetStream client under the store, for a service's own streams, buckets and object
// stores (with the store's replicas, storage and timeout), and for raw NATS where a caller needs
// it (subscriptions, consumers).
func (s *Store) JS() *jsx.Client { return s.js }

// Options returns the options the store was opened with, defaults applied.
func (s *Store) Options() Options { return s.opts }

// Duration is a time.Duration that reads and writes as a string like "2s" in JSON.
type Duration time.Duration

// D returns d as a time.Duration.
func (d Duration) D() time.Duration { return time.Duration(d) }

func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }

func (d *Duration) UnmarshalJSON(b []byte) error {
	if len(b) > 0 && b[0] == '"' {
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return err
		}
		v, err := time.ParseDuration(s)
		if err != nil {
			return err
		}
		*d = Duration(v)
		return nil
	}
	var n int64
	if err := json.Unmarshal(b, &n); err != nil {
		return fmt.Errorf("duration must be a string like \"2s\" or nanoseconds: %w", err)
	}
	*d = Duration(n)
	return nil
}

// Snapshots opens (creating if missing) the object store of compacted placement snapshots.
// Callers of one Store share one opening and its handle.
func (s *Store) Snapshots(ctx context.Context) (jetstream.ObjectStore, error) {
	s.snapMu.Lock()
	defer s.snapMu.Unlock()
	if s.snaps != nil {
		return s.snaps, nil
	}
	if s.opts.Attach {
		// Readers go on without snapshots until the rebalancer makes the bucket, so this never
		// waits long: on a cluster still forming a request can go unanswered for as long as the
		// caller would let it, and the caller then has no time left for the placements.
		ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		os, err := s.js.JetStream().ObjectStore(ctx, BucketSnapshots)
		if err != nil {
			return nil, fmt.Errorf("schema: open object store %s: %w", BucketSnapshots, err)
		}
		s.snaps = os
		return os, nil
	}
	os, err := s.js.ObjectStore(ctx, BucketSnapshots, "tenantmesh compacted placement snapshots")
	if err == nil {
		s.snaps = os
	}
	return os, err
}

// OpenRetry is Open retried with backoff (250ms doubling to 5s) until it succeeds or ctx ends,
// so a process may start before NATS is reachable or while a new cluster still places its
// streams. Failures are logged at warn level through opts.Logger.
func OpenRetry(ctx context.Context, nc *nats.Conn, opts Options) (*Store, error) {
	log := opts.withDefaults().Logger
	var st *Store
	err := backoff.Retry(ctx, backoff.Policy{Initial: 250 * time.Millisecond, Max: 5 * time.Second,
		OnRetry: func(err error, pause time.Duration) {
			log.Warn("NATS state not ready; retrying", "err", err, "in", pause)
		},
	}, func(ctx context.Context) (err error) {
		ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		st, err = Open(ctx, nc, opts)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("schema: open: %w (last error: %v)", ctx.Err(), err)
	}
	return st, nil
}
