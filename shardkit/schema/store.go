package schema

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/ctxtime"
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
	// default kinds are not registered. A service's own buckets (EnsureKV) are still created.
	Attach bool
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

// Store reads and writes tenantmesh's state in NATS. It is safe for concurrent use.
type Store struct {
	nc   *nats.Conn
	js   jetstream.JetStream
	opts Options

	kinds, instances, members, routes, signals, rebalance jetstream.KeyValue

	mu         sync.Mutex
	placements map[string]jetstream.KeyValue

	snapMu sync.Mutex // one opening at a time; the handle is kept
	snaps  jetstream.ObjectStore
}

// Open connects a Store to nc, creating every missing bucket and stream, and registering the
// default kinds that are absent.
func Open(ctx context.Context, nc *nats.Conn, opts Options) (*Store, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("schema: jetstream: %w", err)
	}
	s := &Store{nc: nc, js: js, opts: opts.withDefaults(), placements: map[string]jetstream.KeyValue{}}
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
		kv, err := s.ensureKV(ctx, KVSpec{Bucket: b.name, Description: b.desc, History: b.history})
		if err != nil {
			return nil, err
		}
		*b.dst = kv
	}
	if err := s.ensureStream(ctx, jetstream.StreamConfig{
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
		if _, err := s.EnsureKind(ctx, DefaultKindConfig(k)); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// Provision creates what Attach-mode processes wait for beyond Open's buckets: the
// application streams (TM_EVENTS, TM_JOBS) and the placement snapshots' object store. The
// rebalancer provisions at start.
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
	_, err := s.Snapshots(ctx)
	return err
}

// errNotProvisioned: an Attach-mode store found a shared asset missing.
type errNotProvisioned struct{ what string }

func (e errNotProvisioned) Error() string {
	return e.what + " does not exist yet; the rebalancer (rebalance serve) creates it"
}

// awaitProvisioned runs op until it returns something other than errNotProvisioned, or ctx
// ends, logging what it waits for every 10 s.
func (s *Store) awaitProvisioned(ctx context.Context, op func(context.Context) error) error {
	var logged time.Time
	for {
		err := op(ctx)
		var np errNotProvisioned
		if !errors.As(err, &np) {
			return err
		}
		if time.Since(logged) >= 10*time.Second {
			s.opts.Logger.Info("waiting for NATS state", "what", np.what, "why", "the rebalancer (rebalance serve) provisions it")
			logged = time.Now()
		}
		if !ctxtime.Sleep(ctx, 250*time.Millisecond) {
			return fmt.Errorf("schema: %w (waited until %v)", err, ctx.Err())
		}
	}
}

// Conn is the store's NATS connection.
func (s *Store) Conn() *nats.Conn { return s.nc }

// JetStream is the store's JetStream context.
func (s *Store) JetStream() jetstream.JetStream { return s.js }

// Options returns the options the store was opened with, defaults applied.
func (s *Store) Options() Options { return s.opts }

// EnsureStream creates or updates a stream with the store's replicas and storage.
func (s *Store) EnsureStream(ctx context.Context, cfg jetstream.StreamConfig) error {
	return s.ensureStream(ctx, cfg)
}

// Stream opens an existing stream, trying again while NATS is unavailable or the stream is
// not visible yet (a new cluster), within ctx (default: the creation timeout).
func (s *Store) Stream(ctx context.Context, name string) (jetstream.Stream, error) {
	ctx, cancel := s.boundCreate(ctx)
	defer cancel()
	var st jetstream.Stream
	err := s.tryCreate(ctx, "stream "+name, func(actx context.Context) (err error) {
		st, err = s.js.Stream(actx, name)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("schema: open stream %s: %w", name, err)
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
func (s *Store) EnsureKV(ctx context.Context, spec KVSpec) (jetstream.KeyValue, error) {
	ctx, cancel := s.boundCreate(ctx)
	defer cancel()
	kv, err := s.createKV(ctx, spec)
	if err != nil || !spec.PerKeyTTL {
		return kv, err
	}
	if err := s.allowMsgTTL(ctx, KVStream(spec.Bucket)); err != nil {
		return nil, fmt.Errorf("schema: bucket %s: allow per-key TTLs: %w", spec.Bucket, err)
	}
	return kv, nil
}

// allowMsgTTL turns on per-message TTLs on stream, a bucket made before without them, unless
// they are on (they cannot be turned off again).
func (s *Store) allowMsgTTL(ctx context.Context, stream string) error {
	ctx, cancel := s.boundCreate(ctx)
	defer cancel()
	return s.tryCreate(ctx, "stream "+stream, func(actx context.Context) error {
		st, err := s.js.Stream(actx, stream)
		if err != nil {
			return err
		}
		cfg := st.CachedInfo().Config
		if cfg.AllowMsgTTL {
			return nil
		}
		cfg.AllowMsgTTL = true
		_, err = s.js.UpdateStream(actx, cfg)
		return err
	})
}

// tryCreate runs op, each attempt bounded to streamAttempt, until it succeeds, fails for good
// or ctx ends: on a cluster that is still forming (or placing what every process creates at
// start) creates go unanswered, find no peers, or find a stream not visible yet. It says what it
// waits for every 10 s.
func (s *Store) tryCreate(ctx context.Context, what string, op func(context.Context) error) error {
	var logged time.Time
	started := time.Now()
	for {
		actx, cancel := context.WithTimeout(ctx, streamAttempt)
		err := op(actx)
		cancel()
		if err == nil || ctx.Err() != nil || !creating(err) {
			return err
		}
		if time.Since(logged) >= 10*time.Second && time.Since(started) >= time.Second {
			s.opts.Logger.Info("waiting for NATS to create", "what", what, "err", err, "waited", time.Since(started).Round(time.Second))
			logged = time.Now()
		}
		if !ctxtime.Sleep(ctx, 100*time.Millisecond) {
			return err
		}
	}
}

// UpdateKV writes value to key of bucket if key's revision is still rev (0: absent), like
// jetstream.KeyValue.Update, and returns the new revision. A ttl above zero makes JetStream
// remove the value that long after the write; the bucket must allow it (KVSpec.PerKeyTTL).
// A lost race is jetstream.ErrKeyExists.
func (s *Store) UpdateKV(ctx context.Context, bucket, key string, value []byte, rev uint64, ttl time.Duration) (uint64, error) {
	opts := []jetstream.PublishOpt{jetstream.WithExpectLastSequencePerSubject(rev)}
	if ttl > 0 {
		opts = append(opts, jetstream.WithMsgTTL(ttl))
	}
	ack, err := s.js.PublishMsg(ctx, &nats.Msg{Subject: KVSubject(bucket, key), Data: value}, opts...)
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
func (s *Store) LeaderGet(ctx context.Context, bucket, key string) ([]byte, uint64, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	var (
		data []byte
		rev  uint64
	)
	err := retry(ctx, transient, tryFor(readAttempt, func(ctx context.Context) (err error) {
		data, rev, err = s.leaderGet(ctx, bucket, key)
		return err
	}))
	return data, rev, err
}

func (s *Store) ensureStream(ctx context.Context, cfg jetstream.StreamConfig) error {
	ctx, cancel := s.boundCreate(ctx)
	defer cancel()
	if s.opts.Attach {
		return s.awaitProvisioned(ctx, func(ctx context.Context) error {
			return retry(ctx, transient, tryFor(readAttempt, func(ctx context.Context) error {
				_, err := s.js.Stream(ctx, cfg.Name)
				if errors.Is(err, jetstream.ErrStreamNotFound) {
					return errNotProvisioned{"stream " + cfg.Name}
				}
				return err
			}))
		})
	}
	cfg.Replicas = s.opts.Replicas
	cfg.Storage = s.opts.Storage
	// On a cluster, concurrent creates and updates of one replicated stream (every process
	// opening the schema at once) can go unanswered until the callers time out. So a stream
	// that already is as wanted is left alone, and each attempt is bounded and retried: a
	// retry finds the stream another process created.
	err := s.tryCreate(ctx, "stream "+cfg.Name, func(actx context.Context) error { return s.ensureStreamOnce(actx, cfg) })
	if err != nil {
		return fmt.Errorf("schema: ensure stream %s: %w", cfg.Name, err)
	}
	return nil
}

// streamAttempt bounds one attempt at creating or updating a stream.
const streamAttempt = 3 * time.Second

func (s *Store) ensureStreamOnce(ctx context.Context, cfg jetstream.StreamConfig) error {
	if st, err := s.js.Stream(ctx, cfg.Name); err == nil && sameStream(st.CachedInfo().Config, cfg) {
		return nil
	}
	_, err := s.js.CreateOrUpdateStream(ctx, cfg)
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

func (s *Store) ensureKV(ctx context.Context, spec KVSpec) (jetstream.KeyValue, error) {
	ctx, cancel := s.boundCreate(ctx)
	defer cancel()
	if s.opts.Attach {
		var kv jetstream.KeyValue
		err := s.awaitProvisioned(ctx, func(ctx context.Context) error {
			return retry(ctx, transient, tryFor(readAttempt, func(ctx context.Context) (err error) {
				kv, err = s.js.KeyValue(ctx, spec.Bucket)
				if errors.Is(err, jetstream.ErrBucketNotFound) {
					return errNotProvisioned{"bucket " + spec.Bucket}
				}
				return err
			}))
		})
		if err != nil {
			return nil, fmt.Errorf("schema: open bucket %s: %w", spec.Bucket, err)
		}
		return kv, nil
	}
	return s.createKV(ctx, spec)
}

// createKV opens or creates a bucket.
func (s *Store) createKV(ctx context.Context, spec KVSpec) (jetstream.KeyValue, error) {
	// Bounded attempts, retried, as in ensureStream: concurrent creates of one replicated
	// bucket on a cluster can go unanswered.
	var kv jetstream.KeyValue
	err := s.tryCreate(ctx, "bucket "+spec.Bucket, func(actx context.Context) (err error) {
		kv, err = s.ensureKVOnce(actx, spec)
		return err
	})
	return kv, err
}

func (s *Store) ensureKVOnce(ctx context.Context, spec KVSpec) (jetstream.KeyValue, error) {
	kv, err := s.js.KeyValue(ctx, spec.Bucket)
	if err == nil {
		return kv, nil
	}
	if !errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, fmt.Errorf("schema: open bucket %s: %w", spec.Bucket, err)
	}
	// Another process may create the bucket between the open and this: the config must be
	// what it sends too (a config without TTLs would try to turn them off, which fails).
	kv, err = s.js.CreateOrUpdateKeyValue(ctx, s.kvConfig(spec))
	if err != nil {
		return nil, fmt.Errorf("schema: create bucket %s: %w", spec.Bucket, err)
	}
	return kv, nil
}

// kvConfig is the bucket spec describes, with the store's replicas and storage. Per-key TTLs
// come with delete markers where a TTL runs out (JetStream's LimitMarkerTTL), kept a minute;
// every read here takes a marker for a missing key.
func (s *Store) kvConfig(spec KVSpec) jetstream.KeyValueConfig {
	cfg := jetstream.KeyValueConfig{
		Bucket:      spec.Bucket,
		Description: spec.Description,
		History:     max(spec.History, 1),
		Replicas:    s.opts.Replicas,
		Storage:     s.opts.Storage,
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
func (s *Store) boundCreate(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return ctx, func() {}
	}
	if s.opts.Attach {
		return context.WithTimeout(ctx, attachTimeout)
	}
	return context.WithTimeout(ctx, max(createTimeout, s.opts.Timeout))
}

// attachTimeout bounds an Attach-mode store's wait for the rebalancer to provision an asset.
const attachTimeout = 2 * time.Minute

// bound gives ctx the store's timeout unless it already has a deadline.
func (s *Store) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, s.opts.Timeout)
}

// retry runs op until it succeeds, fails for good, or ctx ends, backing off between attempts
// that failed transiently (see ErrUnavailable). retryIf picks the failures worth another
// attempt: any transient one for a read, only "reached nobody" for a write. The error returned
// is op's last, marked ErrUnavailable when transient.
func retry(ctx context.Context, retryIf func(error) bool, op func(context.Context) error) error {
	wait := 25 * time.Millisecond
	for {
		err := op(ctx)
		if err == nil || !retryIf(err) || ctx.Err() != nil {
			return unavailable(err)
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return unavailable(err)
		}
		wait = min(2*wait, 500*time.Millisecond)
	}
}

// readAttempt bounds one attempt of a single-key read (tryFor): a request whose server went
// away (a stream leader stopped) gets no answer, and the next attempt, after the election,
// should not wait the whole store timeout for it. A read is idempotent, so an attempt that
// timed out is simply made again.
const readAttempt = time.Second

// getJSON reads key into v and returns its revision. It reads with a direct get, which any
// replica of the bucket may answer, so on a cluster it can miss a write acknowledged just
// before (a replica that is behind): use getLeaderJSON where the caller must see its own or
// another process's acknowledged writes.
func (s *Store) getJSON(ctx context.Context, kv jetstream.KeyValue, key string, v any) (uint64, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	var e jetstream.KeyValueEntry
	err := retry(ctx, transient, tryFor(readAttempt, func(ctx context.Context) (err error) {
		e, err = kv.Get(ctx, key)
		return err
	}))
	if err != nil {
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return 0, fmt.Errorf("%s/%s: %w", kv.Bucket(), key, ErrNotFound)
		}
		return 0, fmt.Errorf("schema: get %s/%s: %w", kv.Bucket(), key, err)
	}
	if err := json.Unmarshal(e.Value(), v); err != nil {
		return e.Revision(), fmt.Errorf("%s/%s revision %d: %w: %v", kv.Bucket(), key, e.Revision(), ErrCorrupt, err)
	}
	return e.Revision(), nil
}

// getLeaderJSON is getJSON answered by the bucket's stream leader (JetStream's STREAM.MSG.GET
// rather than a direct get): it sees every write acknowledged before it was sent, by this
// process or any other. While the stream has no leader it fails with ErrUnavailable.
func (s *Store) getLeaderJSON(ctx context.Context, kv jetstream.KeyValue, key string, v any) (uint64, error) {
	data, rev, err := s.LeaderGet(ctx, kv.Bucket(), key)
	if err != nil {
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return 0, fmt.Errorf("%s/%s: %w", kv.Bucket(), key, ErrNotFound)
		}
		return 0, fmt.Errorf("schema: get %s/%s from the leader: %w", kv.Bucket(), key, err)
	}
	if err := json.Unmarshal(data, v); err != nil {
		return rev, fmt.Errorf("%s/%s revision %d: %w: %v", kv.Bucket(), key, rev, ErrCorrupt, err)
	}
	return rev, nil
}

// leaderGet asks the stream leader of bucket for key's last message. A deleted or purged key,
// or one never written, is jetstream.ErrKeyNotFound.
func (s *Store) leaderGet(ctx context.Context, bucket, key string) ([]byte, uint64, error) {
	m, err := s.leaderLast(ctx, KVStream(bucket), KVSubject(bucket, key))
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil, 0, jetstream.ErrKeyNotFound
	}
	if err != nil {
		return nil, 0, err
	}
	if len(m.Header) > 0 {
		h, err := nats.DecodeHeadersMsg(m.Header)
		if err != nil {
			return nil, 0, fmt.Errorf("invalid message headers: %w", err)
		}
		// A delete, a purge, or the marker JetStream leaves where a value's TTL ran out.
		if op := h.Get("KV-Operation"); op == "DEL" || op == "PURGE" || h.Get("Nats-Marker-Reason") != "" {
			return nil, 0, jetstream.ErrKeyNotFound
		}
	}
	return m.Data, m.Sequence, nil
}

// storedMsg is a message as JetStream's STREAM.MSG.GET answers it.
type storedMsg struct {
	Sequence uint64 `json:"seq"`
	Header   []byte `json:"hdrs"`
	Data     []byte `json:"data"`
}

// leaderLast asks stream's leader for the last message on subject (wildcards allowed): unlike
// a direct get, which any replica may answer, it sees every write acknowledged before it was
// sent. None is jetstream.ErrMsgNotFound.
func (s *Store) leaderLast(ctx context.Context, stream, subject string) (*storedMsg, error) {
	req, err := json.Marshal(map[string]string{"last_by_subj": subject})
	if err != nil {
		return nil, err
	}
	msg, err := s.nc.RequestWithContext(ctx, "$JS.API.STREAM.MSG.GET."+stream, req)
	if err != nil {
		return nil, err
	}
	var resp struct {
		Error   *jetstream.APIError `json:"error"`
		Message *storedMsg          `json:"message"`
	}
	if err := json.Unmarshal(msg.Data, &resp); err != nil {
		return nil, fmt.Errorf("invalid JetStream response: %w", err)
	}
	switch {
	case resp.Error != nil && resp.Error.ErrorCode == jetstream.JSErrCodeMessageNotFound:
		return nil, jetstream.ErrMsgNotFound
	case resp.Error != nil:
		return nil, resp.Error
	case resp.Message == nil:
		return nil, jetstream.ErrInvalidJetStreamResponse
	}
	return resp.Message, nil
}

// LastSeq is the stream sequence of the newest message of stream on subject (wildcards
// allowed; 0 if none), answered by the stream leader, so it covers every append acknowledged
// before the call: a move's fence is read this way. Transient failures are retried within the
// store's timeout.
func (s *Store) LastSeq(ctx context.Context, stream, subject string) (uint64, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	var seq uint64
	err := retry(ctx, transient, tryFor(readAttempt, func(ctx context.Context) error {
		m, err := s.leaderLast(ctx, stream, subject)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			seq = 0
			return nil
		}
		if err != nil {
			return err
		}
		seq = m.Sequence
		return nil
	}))
	if err != nil {
		return 0, fmt.Errorf("schema: last message of %s on %s: %w", stream, subject, err)
	}
	return seq, nil
}

// casJSON writes v to key if its revision is still rev (0: only if absent) and returns the
// new revision. A lost race is a *ConflictError.
//
// Each attempt is bounded to writeTry, and an attempt that went unanswered is made again: after
// a stream leader dies, the next leader answers in about two seconds, and waiting out the
// store's whole timeout would hold a move's handoff that long. An unanswered attempt may have
// been stored, so a conflict after one is checked against the key's newest value: if it is
// what this call wrote, the write was ours and succeeded.
func (s *Store) casJSON(ctx context.Context, kv jetstream.KeyValue, key string, rev uint64, v any) (uint64, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return 0, fmt.Errorf("schema: encode %s/%s: %w", kv.Bucket(), key, err)
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	var newRev uint64
	var doubt inDoubt
	err = retry(ctx, doubt.note, tryFor(writeTry, func(ctx context.Context) (err error) {
		if rev == 0 {
			newRev, err = kv.Create(ctx, key, b)
		} else {
			newRev, err = kv.Update(ctx, key, b, rev)
		}
		return err
	}))
	if err != nil && IsConflict(err) && doubt.was {
		if got, ok := s.recognise(ctx, kv.Bucket(), key, b); ok {
			return got, nil
		}
	}
	if err != nil {
		if IsConflict(err) {
			return 0, &ConflictError{Bucket: kv.Bucket(), Key: key, Expected: rev, Err: err}
		}
		return 0, fmt.Errorf("schema: write %s/%s: %w", kv.Bucket(), key, err)
	}
	return newRev, nil
}

// writeTry bounds one attempt of a write (see casJSON). A healthy write takes milliseconds,
// under load tens of them.
const writeTry = 1500 * time.Millisecond

// tryFor is op with each call bounded to d.
func tryFor(d time.Duration, op func(context.Context) error) func(context.Context) error {
	return func(ctx context.Context) error {
		actx, cancel := context.WithTimeout(ctx, d)
		defer cancel()
		return op(actx)
	}
}

// inDoubt is a write's retry rule that remembers whether an attempt may have been stored: any
// transient failure but "reached nobody" leaves the outcome unknown.
type inDoubt struct{ was bool }

func (d *inDoubt) note(err error) bool {
	if !transient(err) {
		return false
	}
	if !noResponders(err) {
		d.was = true
	}
	return true
}

// recognise reports whether key's newest value, read from the stream leader, is exactly b (a
// write whose answer was lost landed), and its revision. Values written through the store
// carry their write time, so another writer's value does not match by accident.
func (s *Store) recognise(ctx context.Context, bucket, key string, b []byte) (uint64, bool) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), writeTry)
	defer cancel()
	var data []byte
	var rev uint64
	err := retry(rctx, transient, func(ctx context.Context) (err error) {
		data, rev, err = s.leaderGet(ctx, bucket, key)
		return err
	})
	return rev, err == nil && bytes.Equal(data, b)
}

// putJSON writes v to key unconditionally. An unanswered attempt is simply made again (see
// casJSON): writing the same value twice leaves the same value.
func (s *Store) putJSON(ctx context.Context, kv jetstream.KeyValue, key string, v any) (uint64, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return 0, fmt.Errorf("schema: encode %s/%s: %w", kv.Bucket(), key, err)
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	var rev uint64
	err = retry(ctx, transient, tryFor(writeTry, func(ctx context.Context) (err error) {
		rev, err = kv.Put(ctx, key, b)
		return err
	}))
	if err != nil {
		return 0, fmt.Errorf("schema: put %s/%s: %w", kv.Bucket(), key, err)
	}
	return rev, nil
}

// deleteKey deletes key; with rev > 0 only if its revision is still rev. An unanswered
// attempt is made again; a conflict after one, with the key gone, was our delete.
func (s *Store) deleteKey(ctx context.Context, kv jetstream.KeyValue, key string, rev uint64) error {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	var opts []jetstream.KVDeleteOpt
	if rev > 0 {
		opts = append(opts, jetstream.LastRevision(rev))
	}
	var doubt inDoubt
	err := retry(ctx, doubt.note, tryFor(writeTry, func(ctx context.Context) error { return kv.Delete(ctx, key, opts...) }))
	if err != nil && IsConflict(err) && doubt.was {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), writeTry)
		_, _, gerr := s.leaderGet(rctx, kv.Bucket(), key)
		cancel()
		if errors.Is(gerr, jetstream.ErrKeyNotFound) {
			return nil
		}
	}
	if err != nil {
		if IsConflict(err) {
			return &ConflictError{Bucket: kv.Bucket(), Key: key, Expected: rev, Err: err}
		}
		return fmt.Errorf("schema: delete %s/%s: %w", kv.Bucket(), key, err)
	}
	return nil
}

// listJSON decodes every live value under filter, calling fn once per key (in key order) with
// its newest value. Corrupt values are logged and skipped; their count is returned.
//
// It reads the bucket's stream with an ordered consumer delivering the last message per key,
// until the server reports nothing pending. (nats.go's KeyValue.Watch marks the end of the
// initial values after the first message when its consumer-info call fails, which truncates a
// list under load.)
//
// On a cluster, making the consumer or fetching from it can fail for a moment (no responders
// while a leader is elected or before the new consumer's interest reached this server): such
// a read is started again, with a new consumer, within the store's timeout.
func listJSON[T any](ctx context.Context, s *Store, kv jetstream.KeyValue, filter string, fn func(key string, rev uint64, v T)) (corrupt int, err error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	var latest map[string]listItem
	err = retry(ctx, transient, func(ctx context.Context) (err error) {
		latest, err = s.listLatest(ctx, kv, filter)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("schema: list %s: %w", kv.Bucket(), err)
	}
	keys := make([]string, 0, len(latest))
	for k, it := range latest {
		if !it.del {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	for _, k := range keys {
		it := latest[k]
		var v T
		if err := json.Unmarshal(it.data, &v); err != nil {
			corrupt++
			s.opts.Logger.Warn("skipping corrupt value", "bucket", kv.Bucket(), "key", k, "revision", it.rev, "err", err)
			continue
		}
		fn(k, it.rev, v)
	}
	return corrupt, nil
}

// listItem is the newest message of one key, as listLatest read it.
type listItem struct {
	rev  uint64
	data []byte
	del  bool
}

// listLatest is one attempt of listJSON: the newest message of every key under filter.
func (s *Store) listLatest(ctx context.Context, kv jetstream.KeyValue, filter string) (map[string]listItem, error) {
	prefix := KVSubject(kv.Bucket(), "")
	cons, done, err := OrderedRead(ctx, s.js, KVStream(kv.Bucket()), jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{prefix + filter},
		DeliverPolicy:  jetstream.DeliverLastPerSubjectPolicy,
	})
	if err != nil {
		return nil, err
	}
	defer done()
	latest := map[string]listItem{}
	pending := cons.CachedInfo().NumPending
	for pending > 0 {
		batch, err := cons.Fetch(int(min(pending, 1000)), jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			return nil, err
		}
		got := 0
		for m := range batch.Messages() {
			got++
			md, err := m.Metadata()
			if err != nil {
				return nil, err
			}
			pending = md.NumPending
			op := m.Headers().Get("KV-Operation")
			del := op == "DEL" || op == "PURGE" || m.Headers().Get("Nats-Marker-Reason") != ""
			latest[strings.TrimPrefix(m.Subject(), prefix)] = listItem{rev: md.Sequence.Stream, data: m.Data(), del: del}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) {
			return nil, err
		}
		if got == 0 {
			// Nothing arrived within the fetch's wait though messages are pending: the
			// consumer is stuck (its server went away, say); a new one may do better.
			return nil, fmt.Errorf("%w: no progress with %d pending", ErrUnavailable, pending)
		}
	}
	return latest, nil
}

// IsConflict reports whether err is a compare-and-set write losing: the key's (or subject's)
// last revision was not the one expected.
func IsConflict(err error) bool {
	if errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
		return true
	}
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && (apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
		apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant)
}

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
		os, err := s.js.ObjectStore(ctx, BucketSnapshots)
		if err != nil {
			return nil, fmt.Errorf("schema: open object store %s: %w", BucketSnapshots, err)
		}
		s.snaps = os
		return os, nil
	}
	os, err := s.ObjectStore(ctx, BucketSnapshots, "tenantmesh compacted placement snapshots")
	if err == nil {
		s.snaps = os
	}
	return os, err
}

// ObjectStore opens the object store bucket, creating it (compressed, with the store's
// replicas and storage) if missing. On a new cluster a creation racing others (every process
// opening it at start) can go unanswered: attempts are bounded and tried again within ctx
// (default: the creation timeout), as for buckets and streams.
func (s *Store) ObjectStore(ctx context.Context, bucket, desc string) (jetstream.ObjectStore, error) {
	ctx, cancel := s.boundCreate(ctx)
	defer cancel()
	var os jetstream.ObjectStore
	err := s.tryCreate(ctx, "object store "+bucket, func(actx context.Context) (err error) {
		os, err = s.js.ObjectStore(actx, bucket)
		if errors.Is(err, jetstream.ErrBucketNotFound) {
			os, err = s.js.CreateOrUpdateObjectStore(actx, jetstream.ObjectStoreConfig{
				Bucket: bucket, Description: desc, Replicas: s.opts.Replicas, Storage: s.opts.Storage, Compression: true,
			})
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("schema: open object store %s: %w", bucket, err)
	}
	return os, nil
}

// OpenRetry is Open retried with backoff (250ms doubling to 5s) until it succeeds or ctx ends,
// so a process may start before NATS is reachable or while a new cluster still places its
// streams. Failures are logged at warn level through opts.Logger.
func OpenRetry(ctx context.Context, nc *nats.Conn, opts Options) (*Store, error) {
	log := opts.withDefaults().Logger
	wait := 250 * time.Millisecond
	for {
		octx, cancel := context.WithTimeout(ctx, createTimeout)
		st, err := Open(octx, nc, opts)
		cancel()
		if err == nil {
			return st, nil
		}
		log.Warn("NATS state not ready; retrying", "err", err, "in", wait)
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return nil, fmt.Errorf("schema: open: %w (last error: %v)", ctx.Err(), err)
		}
		wait = min(2*wait, 5*time.Second)
	}
}

// QuickHeartbeat is the idle heartbeat to pull an ordered consumer's messages with. nats.go's
// default is 5 s, and an ordered consumer notices its server went away only after two missed
// heartbeats: a consumer whose stream leader or server died (a NATS node stopped) went silent
// for 10 s before it was made again, which held a projection's warm-up, and so a move, that
// long. With 500 ms (kvwatch's followers' too) it is made again within about a second; the
// price is two heartbeat messages a second per open consumer.
var QuickHeartbeat jetstream.PullMessagesOpt = jetstream.PullHeartbeat(500 * time.Millisecond)

// OrderedRead makes an ordered consumer for a one-off read of stream. Unlike nats.go's default
// (an inactive ordered consumer lingers 5 minutes), it expires 5 s after its last pull, and done
// deletes it at once, so frequent reads cannot pile up consumers on the server.
func OrderedRead(ctx context.Context, js jetstream.JetStream, stream string, cfg jetstream.OrderedConsumerConfig) (jetstream.Consumer, func(), error) {
	if cfg.InactiveThreshold == 0 {
		cfg.InactiveThreshold = 5 * time.Second
	}
	cons, err := js.OrderedConsumer(ctx, stream, cfg)
	if err != nil {
		return nil, nil, err
	}
	done := func() {
		name := cons.CachedInfo().Name
		dctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = js.DeleteConsumer(dctx, stream, name)
	}
	return cons, done, nil
}
