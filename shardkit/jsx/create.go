package jsx

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/tenantmesh/tenantmesh/internal/backoff"
)

// errNotProvisioned: an Attach-mode store found a shared asset missing.
type errNotProvisioned struct{ what string }

func (e errNotProvisioned) Error() string {
	return e.what + " does not exist yet; the process that provisions it (rebalance serve) creates it"
}

// awaitProvisioned runs op until it returns something other than errNotProvisioned, or ctx
// ends, logging what it waits for every 10 s.
func (c *Client) awaitProvisioned(ctx context.Context, op func(context.Context) error) error {
	var logged time.Time
	var np errNotProvisioned
	err := backoff.Retry(ctx, backoff.Policy{Initial: 250 * time.Millisecond, Max: 250 * time.Millisecond, Jitter: backoff.None,
		RetryIf: func(err error) bool { return errors.As(err, &np) },
		OnRetry: func(error, time.Duration) {
			if time.Since(logged) >= 10*time.Second {
				c.opts.Logger.Info("waiting for NATS state", "what", np.what, "why", "the rebalancer (rebalance serve) provisions it")
				logged = time.Now()
			}
		},
	}, op)
	if errors.As(err, &np) && ctx.Err() != nil {
		return fmt.Errorf("%w (waited until %v)", err, ctx.Err())
	}
	return err
}

// EnsureStream creates or updates a stream with the store's replicas and storage.
func (c *Client) EnsureStream(ctx context.Context, cfg jetstream.StreamConfig) error {
	return c.ensureStream(ctx, cfg)
}

// Stream opens an existing stream, trying again while NATS is unavailable or the stream is
// not visible yet (a new cluster), within ctx (default: the creation timeout).
func (c *Client) Stream(ctx context.Context, name string) (jetstream.Stream, error) {
	ctx, cancel := c.boundCreate(ctx)
	defer cancel()
	var st jetstream.Stream
	err := c.tryCreate(ctx, "stream "+name, func(actx context.Context) (err error) {
		st, err = c.js.Stream(actx, name)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("open stream %s: %w", name, err)
	}
	return st, nil
}

// KVSpec describes a service's own bucket for EnsureKV.
type KVSpec struct {
	Bucket, Description string
	// History is how many values are kept per key; 0 is 1.
	History uint8
	// PerKeyTTL lets a write carry a time to live (UpdateKV), after which JetStream removes
	// the value: finished job runs, for example. A bucket made before without it gets it.
	PerKeyTTL bool
}

// EnsureKV creates or opens a bucket with the store's replicas and storage.
func (c *Client) EnsureKV(ctx context.Context, spec KVSpec) (jetstream.KeyValue, error) {
	ctx, cancel := c.boundCreate(ctx)
	defer cancel()
	kv, err := c.createKV(ctx, spec)
	if err != nil || !spec.PerKeyTTL {
		return kv, err
	}
	if err := c.allowMsgTTL(ctx, KVStream(spec.Bucket)); err != nil {
		return nil, fmt.Errorf("bucket %s: allow per-key TTLs: %w", spec.Bucket, err)
	}
	return kv, nil
}

// allowMsgTTL turns on per-message TTLs on stream, a bucket made before without them, unless
// they are on (they cannot be turned off again).
func (c *Client) allowMsgTTL(ctx context.Context, stream string) error {
	ctx, cancel := c.boundCreate(ctx)
	defer cancel()
	return c.tryCreate(ctx, "stream "+stream, func(actx context.Context) error {
		st, err := c.js.Stream(actx, stream)
		if err != nil {
			return err
		}
		cfg := st.CachedInfo().Config
		if cfg.AllowMsgTTL {
			return nil
		}
		cfg.AllowMsgTTL = true
		_, err = c.js.UpdateStream(actx, cfg)
		return err
	})
}

// tryCreate runs op, each attempt bounded to streamAttempt, until it succeeds, fails for good
// or ctx ends: on a cluster that is still forming (or placing what every process creates at
// start) creates go unanswered, find no peers, or find a stream not visible yet. It says what it
// waits for every 10 s.
func (c *Client) tryCreate(ctx context.Context, what string, op func(context.Context) error) error {
	var logged time.Time
	started := time.Now()
	return backoff.Retry(ctx, backoff.Policy{Initial: 100 * time.Millisecond, Max: 100 * time.Millisecond, Jitter: backoff.None,
		RetryIf: creating,
		OnRetry: func(err error, _ time.Duration) {
			if time.Since(logged) >= 10*time.Second && time.Since(started) >= time.Second {
				c.opts.Logger.Info("waiting for NATS to create", "what", what, "err", err, "waited", time.Since(started).Round(time.Second))
				logged = time.Now()
			}
		},
	}, func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, streamAttempt)
		defer cancel()
		return op(ctx)
	})
}

// UpdateKV writes value to key of bucket if key's revision is still rev (0: absent), like
// jetstream.KeyValue.Update, and returns the new revision. A ttl above zero makes JetStream
// remove the value that long after the write; the bucket must allow it (KVSpec.PerKeyTTL).
// A lost race is jetstream.ErrKeyExists.
func (c *Client) UpdateKV(ctx context.Context, bucket, key string, value []byte, rev uint64, ttl time.Duration) (uint64, error) {
	opts := []jetstream.PublishOpt{jetstream.WithExpectLastSequencePerSubject(rev)}
	if ttl > 0 {
		opts = append(opts, jetstream.WithMsgTTL(ttl))
	}
	ack, err := c.js.PublishMsg(ctx, &nats.Msg{Subject: KVSubject(bucket, key), Data: value}, opts...)
	if err != nil {
		if IsConflict(err) {
			return 0, fmt.Errorf("%w: %w", jetstream.ErrKeyExists, err)
		}
		return 0, err
	}
	return ack.Sequence, nil
}

// LeaderGet reads key of bucket from the bucket's stream leader (not a direct get, which any
// replica may answer): it sees every write acknowledged before it was sent. It returns the
// value and its revision; a key never written, deleted, purged or expired is
// jetstream.ErrKeyNotFound. Transient failures are retried within ctx and the store's timeout.
func (c *Client) LeaderGet(ctx context.Context, bucket, key string) ([]byte, uint64, error) {
	ctx, cancel := c.bound(ctx)
	defer cancel()
	var (
		data []byte
		rev  uint64
	)
	err := retry(ctx, transient, readAttempt, func(ctx context.Context) (err error) {
		data, rev, err = c.leaderGet(ctx, bucket, key)
		return err
	})

	return data, rev, err
}

// ensureStream creates or updates a stream; with Options.Attach it waits for it instead.
func (c *Client) ensureStream(ctx context.Context, cfg jetstream.StreamConfig) error {
	ctx, cancel := c.boundCreate(ctx)
	defer cancel()
	if c.opts.Attach {
		return c.awaitProvisioned(ctx, func(ctx context.Context) error {
			return retry(ctx, transient, readAttempt, func(ctx context.Context) error {
				_, err := c.js.Stream(ctx, cfg.Name)
				if errors.Is(err, jetstream.ErrStreamNotFound) {
					return errNotProvisioned{"stream " + cfg.Name}
				}
				return err
			})

		})
	}
	cfg.Replicas = c.opts.Replicas
	cfg.Storage = c.opts.Storage
	// On a cluster, concurrent creates and updates of one replicated stream (every process
	// opening the schema at once) can go unanswered until the callers time out. So a stream
	// that already is as wanted is left alone, and each attempt is bounded and retried: a
	// retry finds the stream another process created.
	err := c.tryCreate(ctx, "stream "+cfg.Name, func(actx context.Context) error { return c.ensureStreamOnce(actx, cfg) })
	if err != nil {
		return fmt.Errorf("ensure stream %s: %w", cfg.Name, err)
	}
	return nil
}

// streamAttempt bounds one attempt at creating or updating a stream.
const streamAttempt = 3 * time.Second

func (c *Client) ensureStreamOnce(ctx context.Context, cfg jetstream.StreamConfig) error {
	if st, err := c.js.Stream(ctx, cfg.Name); err == nil && sameStream(st.CachedInfo().Config, cfg) {
		return nil
	}
	_, err := c.js.CreateOrUpdateStream(ctx, cfg)
	return err
}

// sameStream reports whether have (as the server reports it) already is want, taking the
// server's defaults for the limits want leaves zero.
func sameStream(have, want jetstream.StreamConfig) bool {
	orUnlimited := func(v int64) int64 {
		if v == 0 {
			return -1
		}
		return v
	}
	return have.Description == want.Description && slices.Equal(have.Subjects, want.Subjects) &&
		have.Replicas == max(want.Replicas, 1) && have.Storage == want.Storage &&
		have.Retention == want.Retention && have.Discard == want.Discard &&
		have.AllowDirect == want.AllowDirect && have.MaxAge == want.MaxAge &&
		have.MaxBytes == orUnlimited(want.MaxBytes) &&
		have.MaxMsgsPerSubject == orUnlimited(want.MaxMsgsPerSubject) &&
		(want.Duplicates == 0 || have.Duplicates == want.Duplicates)
}

// EnsureSharedKV opens a bucket other processes share, creating it if missing; with
// Options.Attach it does not create it but waits for another process to (within ctx, default
// two minutes).
func (c *Client) EnsureSharedKV(ctx context.Context, spec KVSpec) (jetstream.KeyValue, error) {
	return c.ensureKV(ctx, spec)
}

func (c *Client) ensureKV(ctx context.Context, spec KVSpec) (jetstream.KeyValue, error) {
	ctx, cancel := c.boundCreate(ctx)
	defer cancel()
	if c.opts.Attach {
		var kv jetstream.KeyValue
		err := c.awaitProvisioned(ctx, func(ctx context.Context) error {
			return retry(ctx, transient, readAttempt, func(ctx context.Context) (err error) {
				kv, err = c.js.KeyValue(ctx, spec.Bucket)
				if errors.Is(err, jetstream.ErrBucketNotFound) {
					return errNotProvisioned{"bucket " + spec.Bucket}
				}
				return err
			})

		})
		if err != nil {
			return nil, fmt.Errorf("open bucket %s: %w", spec.Bucket, err)
		}
		return kv, nil
	}
	return c.createKV(ctx, spec)
}

// createKV opens or creates a bucket.
func (c *Client) createKV(ctx context.Context, spec KVSpec) (jetstream.KeyValue, error) {
	// Bounded attempts, retried, as in ensureStream: concurrent creates of one replicated
	// bucket on a cluster can go unanswered.
	var kv jetstream.KeyValue
	err := c.tryCreate(ctx, "bucket "+spec.Bucket, func(actx context.Context) (err error) {
		kv, err = c.ensureKVOnce(actx, spec)
		return err
	})
	return kv, err
}

func (c *Client) ensureKVOnce(ctx context.Context, spec KVSpec) (jetstream.KeyValue, error) {
	kv, err := c.js.KeyValue(ctx, spec.Bucket)
	if err == nil {
		return kv, nil
	}
	if !errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, fmt.Errorf("open bucket %s: %w", spec.Bucket, err)
	}
	// Another process may create the bucket between the open and this: the config must be
	// what it sends too (a config without TTLs would try to turn them off, which fails).
	kv, err = c.js.CreateOrUpdateKeyValue(ctx, c.kvConfig(spec))
	if err != nil {
		return nil, fmt.Errorf("create bucket %s: %w", spec.Bucket, err)
	}
	return kv, nil
}

// kvConfig is the bucket spec describes, with the store's replicas and storage. Per-key TTLs
// come with delete markers where a TTL runs out (JetStream's LimitMarkerTTL), kept a minute;
// every read here takes a marker for a missing key.
func (c *Client) kvConfig(spec KVSpec) jetstream.KeyValueConfig {
	cfg := jetstream.KeyValueConfig{
		Bucket:      spec.Bucket,
		Description: spec.Description,
		History:     max(spec.History, 1),
		Replicas:    c.opts.Replicas,
		Storage:     c.opts.Storage,
	}
	if spec.PerKeyTTL {
		cfg.LimitMarkerTTL = time.Minute
	}
	return cfg
}

// createTimeout bounds creating a bucket or stream: placing a replicated asset on a cluster
// that is still electing leaders can take far longer than a read or write.
const createTimeout = 30 * time.Second

// boundCreate gives ctx createTimeout unless it already has a deadline.
func (c *Client) boundCreate(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return ctx, func() {}
	}
	if c.opts.Attach {
		return context.WithTimeout(ctx, attachTimeout)
	}
	return context.WithTimeout(ctx, max(createTimeout, c.opts.Timeout))
}

// attachTimeout bounds an Attach-mode store's wait for the rebalancer to provision an asset.
const attachTimeout = 2 * time.Minute

// bound gives ctx the store's timeout unless it already has a deadline.
func (c *Client) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, c.opts.Timeout)
}

// ObjectStore opens the object store bucket, creating it (compressed, with the store's
// replicas and storage) if missing. On a new cluster a creation racing others (every process
// opening it at start) can go unanswered: attempts are bounded and tried again within ctx
// (default: the creation timeout), as for buckets and streams.
func (c *Client) ObjectStore(ctx context.Context, bucket, desc string) (jetstream.ObjectStore, error) {
	ctx, cancel := c.boundCreate(ctx)
	defer cancel()
	var os jetstream.ObjectStore
	err := c.tryCreate(ctx, "object store "+bucket, func(actx context.Context) (err error) {
		os, err = c.js.ObjectStore(actx, bucket)
		if errors.Is(err, jetstream.ErrBucketNotFound) {
			os, err = c.js.CreateOrUpdateObjectStore(actx, jetstream.ObjectStoreConfig{
				Bucket: bucket, Description: desc, Replicas: c.opts.Replicas, Storage: c.opts.Storage, Compression: true,
			})
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("open object store %s: %w", bucket, err)
	}
	return os, nil
}
