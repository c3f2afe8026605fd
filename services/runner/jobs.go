package runner

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/tracing"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Status is a job run's state.
type Status string

const (
	StatusPending   Status = "pending"
	StatusRunning   Status = "running"
	StatusSucceeded Status = "succeeded"
	StatusFailed    Status = "failed"
)

func (s Status) valid() bool {
	return s == StatusPending || s == StatusRunning || s == StatusSucceeded || s == StatusFailed
}

func (s Status) done() bool { return s == StatusSucceeded || s == StatusFailed }

// Domain errors, mapped to HTTP in one place (writeErr).
var (
	ErrBadJob      = errors.New("bad job")
	ErrNoJob       = errors.New("no such job")
	ErrQueueFull   = errors.New("tenant queue full")
	ErrUnknownType = errors.New("unknown job type")
)

// NewJob is what a client submits (POST /jobs).
type NewJob struct {
	Type    string          `json:"type"`
	Payload json.RawMessage `json:"payload,omitempty"`
	// Instance pins the job to one instance of the owning shard (the multi-host design's hostId): only that
	// instance runs it. Empty: any instance of the shard.
	Instance string `json:"instance,omitempty"`
	// IdempotencyKey makes a retried create return the first job (also the Idempotency-Key
	// header).
	IdempotencyKey string `json:"idempotency_key,omitempty"`
	// RunAt holds the job until this time; Delay (a Go duration such as "90s") until that long
	// after the create. At most one of them; see [MaxDelay].
	RunAt *time.Time `json:"run_at,omitempty"`
	Delay string     `json:"delay,omitempty"`

	// schedule and due are set by the scheduler for the job of one due time of a schedule.
	schedule string
	due      time.Time
}

// MaxDelay bounds how far ahead run_at and delay may hold a job (a recurring schedule has no
// such bound).
const MaxDelay = 366 * 24 * time.Hour

// notBefore is the time nj asks to wait for (zero: run now).
func (nj NewJob) notBefore(now time.Time) (time.Time, error) {
	if nj.RunAt != nil && nj.Delay != "" {
		return time.Time{}, fmt.Errorf("%w: give run_at or delay, not both", ErrBadJob)
	}
	var at time.Time
	switch {
	case nj.RunAt != nil:
		at = nj.RunAt.UTC()
	case nj.Delay != "":
		d, err := time.ParseDuration(nj.Delay)
		if err != nil || d < 0 {
			return time.Time{}, fmt.Errorf("%w: delay %q is not a duration >= 0 such as \"90s\" or \"2h\"", ErrBadJob, nj.Delay)
		}
		at = now.Add(d)
	default:
		return time.Time{}, nil
	}
	if at.Sub(now) > MaxDelay {
		return time.Time{}, fmt.Errorf("%w: the job would wait until %s, more than %v ahead; use a schedule", ErrBadJob, at.Format(time.RFC3339), MaxDelay)
	}
	if !at.After(now) {
		return time.Time{}, nil
	}
	return at, nil
}

// Run is a job and its run state, the value of key <tenant>.<id> in tm_runner_runs.
type Run struct {
	ID       string          `json:"id"`
	Tenant   string          `json:"tenant"`
	Type     string          `json:"type"`
	Payload  json.RawMessage `json:"payload,omitempty"`
	Instance string          `json:"instance,omitempty"`
	Status   Status          `json:"status"`
	Attempts int             `json:"attempts"`
	// RanOn is the instance running or that ran the last attempt.
	RanOn  string          `json:"ran_on,omitempty"`
	Result json.RawMessage `json:"result,omitempty"`
	Error  string          `json:"error,omitempty"`
	// Effects are the dedupe keys of the effects the job recorded.
	Effects    []string   `json:"effects,omitempty"`
	CreatedAt  time.Time  `json:"created_at"`
	StartedAt  *time.Time `json:"started_at,omitempty"`
	FinishedAt *time.Time `json:"finished_at,omitempty"`
	// NotBefore delays the next attempt after a failure (backoff).
	NotBefore *time.Time `json:"not_before,omitempty"`
	// LeaseUntil is when a running attempt is presumed dead and may be taken over.
	LeaseUntil *time.Time `json:"lease_until,omitempty"`
	// Seq is the queue entry's stream sequence (0 until enqueued).
	Seq uint64 `json:"seq,omitempty"`
	// Due is when the job was asked to run (run_at, delay, or its schedule's due time);
	// Schedule names the schedule that created it.
	Due      *time.Time `json:"due,omitempty"`
	Schedule string     `json:"schedule,omitempty"`

	rev uint64
}

// queueEntry is the body of a queue message: enough to find the run, and the placement epoch
// of the tenant when it was queued (a verified move's digest leaves out what its new owner
// queued: digest.go).
type queueEntry struct {
	ID    string `json:"id"`
	Epoch uint64 `json:"epoch,omitempty"`
}

var jobType = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,64}$`)

// MaxPayloadBytes bounds a job's payload.
const MaxPayloadBytes = 256 << 10

func runKey(tenant, id string) string { return tenant + "." + id }

// Subjects inside the tenant's jobs.<tenant>.> space: the shared queue, one queue per pinned
// instance, and the outbox.
func anySubject(tenant string) string           { return schema.JobSubject(tenant, "any") }
func pinSubject(tenant, instance string) string { return schema.JobSubject(tenant, "pin."+instance) }
func outboxSubject(tenant string) string        { return schema.JobSubject(tenant, "fx") }

func newID(tenant, idemKey string) string {
	if idemKey != "" {
		h := sha256.Sum256([]byte(tenant + "\x00" + idemKey))
		return hex.EncodeToString(h[:10])
	}
	var b [10]byte
	_, _ = rand.Read(b[:])
	// A time prefix keeps ids roughly sortable by creation.
	return fmt.Sprintf("%011x", time.Now().UnixMilli()) + hex.EncodeToString(b[:])[:9]
}

// Create validates nj, records the run (pending) and enqueues it on the tenant's queue. It
// answers ErrQueueFull when the tenant already has MaxQueued unfinished jobs. A create with an
// idempotency key that was used before returns the first run and created=false.
func (s *Service) Create(ctx context.Context, tenant string, nj NewJob) (Run, bool, error) {
	if err := schema.CheckTenant(tenant); err != nil {
		return Run{}, false, err
	}
	if !jobType.MatchString(nj.Type) {
		return Run{}, false, fmt.Errorf("%w: type %q must be 1 to 64 characters of [A-Za-z0-9_.-]", ErrBadJob, nj.Type)
	}
	if s.handlers[nj.Type] == nil {
		return Run{}, false, fmt.Errorf("%w %q: this runner knows %s", ErrUnknownType, nj.Type, strings.Join(s.types(), ", "))
	}
	if len(nj.Payload) > MaxPayloadBytes {
		return Run{}, false, fmt.Errorf("%w: payload is %d bytes, at most %d", ErrBadJob, len(nj.Payload), MaxPayloadBytes)
	}
	if nj.Instance != "" {
		if err := schema.CheckName("instance", nj.Instance); err != nil {
			return Run{}, false, fmt.Errorf("%w: %w", ErrBadJob, err)
		}
	}
	if len(nj.IdempotencyKey) > 200 {
		return Run{}, false, fmt.Errorf("%w: idempotency key longer than 200 bytes", ErrBadJob)
	}
	now := time.Now().UTC()
	notBefore, err := nj.notBefore(now)
	if err != nil {
		return Run{}, false, err
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.OpTimeout)
	defer cancel()
	if nj.Instance != "" && !s.store.knownInstance(ctx, nj.Instance) {
		return Run{}, false, fmt.Errorf("%w: %q is not an instance of shard %s (the multi-host design: the host must exist; an offline one still gets the job)",
			ErrBadJob, nj.Instance, s.cfg.ID.Shard)
	}
	id := newID(tenant, nj.IdempotencyKey)
	// A key used before is found by the run record's create itself, not by a read first. A
	// create without a key reads the queue's depth beside that create, and takes its run back
	// if the queue is full (the rare refusal pays a round trip more): two round trips with the
	// enqueue, where it was three. A keyed create reads the depth first, so it never takes a
	// run back: a retry with its key could replay that run in the meantime (three round trips,
	// where it was four).
	var depth int
	var derr error
	depthRead := make(chan struct{})
	if nj.IdempotencyKey != "" {
		depth, derr = s.Depth(ctx, tenant)
		close(depthRead)
		if derr != nil {
			return Run{}, false, derr
		}
		if depth >= s.cfg.MaxQueued {
			if r, err := s.Get(ctx, tenant, id); err == nil {
				return s.store.replayed(ctx, r) // its key's job: the answer it had
			}
			return Run{}, false, s.queueFull(depth)
		}
	} else {
		go func() {
			defer close(depthRead)
			depth, derr = s.Depth(ctx, tenant)
		}()
	}
	r, created, err := s.record(ctx, tenant, id, now, notBefore, nj)
	<-depthRead
	if err != nil || !created {
		return r, false, err
	}
	if derr != nil || depth >= s.cfg.MaxQueued {
		// Unenqueued, and its id known to no one yet: no claim or replay saw the run.
		_ = s.store.runs.Delete(context.WithoutCancel(ctx), runKey(tenant, id), jetstream.LastRevision(r.rev))
		if derr != nil {
			return Run{}, false, derr
		}
		return Run{}, false, s.queueFull(depth)
	}
	// Announced before the queue has it, so no instance can run it (and announce its run)
	// before this event is out: the live stream shows job.created first. A create whose
	// enqueue then fails was announced all the same; its client got the error.
	s.announce(schema.JobCreated, &r)
	seq, err := s.store.enqueue(ctx, r)
	if err != nil {
		if nj.IdempotencyKey == "" {
			// The client cannot retry this job: remove the run so it does not wait for ever.
			// (If the entry was stored after all, its claim finds no run and drops it.)
			_ = s.store.runs.Delete(context.WithoutCancel(ctx), runKey(tenant, id), jetstream.LastRevision(r.rev))
		}
		// With a key the run stays: the retry the client is told to make enqueues it.
		return Run{}, false, err
	}
	r.Seq = seq
	s.m.created.Inc()
	return r, true, nil
}

// record writes the pending run of a new job (created), or finds the job its key made before
// and answers as a replay of it (not created; a pending one is enqueued again).
func (s *Service) record(ctx context.Context, tenant, id string, now, notBefore time.Time, nj NewJob) (Run, bool, error) {
	r := Run{ID: id, Tenant: tenant, Type: nj.Type, Payload: nj.Payload, Instance: nj.Instance,
		Status: StatusPending, CreatedAt: now, Schedule: nj.schedule}
	switch {
	case !notBefore.IsZero():
		r.NotBefore, r.Due = &notBefore, &notBefore
	case !nj.due.IsZero():
		due := nj.due.UTC()
		r.Due = &due
	}
	b, _ := json.Marshal(r)
	var rev uint64
	err := s.cfg.whileUnavailable(ctx, func(octx context.Context) (err error) {
		rev, err = s.store.runs.Create(octx, runKey(tenant, id), b)
		return err
	}, "recording a job", "tenant", tenant, "job", id)
	if errors.Is(err, jetstream.ErrKeyExists) {
		got, gerr := s.store.getLatest(ctx, tenant, id) // it exists: a replica may not have it yet
		if errors.Is(gerr, ErrNoJob) {
			// The create found the key taken and the stream's leader does not have it: NATS is
			// changing leaders under us (a node restarting). Not a 404 for a job the client
			// is creating: unknown for now, and its retry with the same key sorts it out. The
			// fault harness found it, a NATS node restarted after its disk filled.
			return Run{}, false, fmt.Errorf("runner: job %s exists but its run cannot be read yet: %w", id, schema.ErrUnavailable)
		}
		if gerr != nil {
			return Run{}, false, gerr
		}
		if !got.CreatedAt.Equal(r.CreatedAt) || got.Status != StatusPending || got.Attempts != 0 {
			return s.store.replayed(ctx, got)
		}
		rev, err = got.rev, nil // our own create, whose answer was lost: carry on
	}
	if err != nil {
		return Run{}, false, fmt.Errorf("runner: record job %s: %w", id, err)
	}
	r.rev = rev
	return r, true, nil
}

// runStore keeps the run records (tm_runner_runs) and the queue entries (TM_JOBS): what a
// create writes, and the reads a claim must make from the stream leader.
type runStore struct {
	s    *Service
	runs jetstream.KeyValue
	// behind, if set, answers a claim's direct gets in their place: a test's replica behind.
	behind func(tenant, id string) (Run, bool)
}

// enqueue puts the run's entry on its queue. The message id makes a repeat within the
// stream's duplicate window a no-op; a later repeat is a second entry, which the claim of
// whichever comes second finds finished and drops.
func (q *runStore) enqueue(ctx context.Context, r Run) (uint64, error) {
	subj := anySubject(r.Tenant)
	if r.Instance != "" {
		subj = pinSubject(r.Tenant, r.Instance)
	}
	qb, _ := json.Marshal(queueEntry{ID: r.ID, Epoch: q.s.placementOf(r.Tenant).Epoch})
	msg := &nats.Msg{Subject: subj, Data: qb, Header: nats.Header{}}
	tracing.Inject(ctx, msg.Header)
	var ack *jetstream.PubAck
	err := q.s.cfg.whileUnavailable(ctx, func(octx context.Context) (err error) {
		ack, err = q.s.js.PublishMsg(octx, msg, jetstream.WithMsgID(r.Tenant+":"+r.ID))
		return err
	}, "enqueueing a job", "tenant", r.Tenant, "job", r.ID)
	if err != nil {
		return 0, fmt.Errorf("runner: enqueue job %s: %w", r.ID, err)
	}
	return ack.Sequence, nil
}

// replayed answers a create whose idempotency key was used before: the first run. A run still
// pending is enqueued again, in case the first create failed after recording it.
func (q *runStore) replayed(ctx context.Context, r Run) (Run, bool, error) {
	if r.Status == StatusPending && r.Attempts == 0 {
		if _, err := q.enqueue(ctx, r); err != nil {
			return Run{}, false, err
		}
	}
	return r, false, nil
}

// Depth is the number of the tenant's unfinished jobs (queued, waiting for a retry, running).
// Finished jobs leave the queue, so this is the count of messages on its queue subjects.
func (s *Service) Depth(ctx context.Context, tenant string) (int, error) {
	var info *jetstream.StreamInfo
	err := s.cfg.whileUnavailable(ctx, func(octx context.Context) (err error) {
		info, err = s.jobs.Info(octx, jetstream.WithSubjectFilter(schema.TenantJobs(tenant)))
		return err
	}, "reading a queue's depth", "tenant", tenant)
	if err != nil {
		return 0, fmt.Errorf("runner: queue depth of %s: %w", tenant, err)
	}
	n := 0
	fx := outboxSubject(tenant)
	for subj, c := range info.State.Subjects {
		if subj != fx {
			n += int(c)
		}
	}
	return n, nil
}

// Get reads one run.
func (s *Service) Get(ctx context.Context, tenant, id string) (Run, error) {
	if !validID(id) {
		return Run{}, fmt.Errorf("%w: %q", ErrNoJob, id)
	}
	var e jetstream.KeyValueEntry
	err := s.cfg.whileUnavailable(ctx, func(octx context.Context) (err error) {
		e, err = s.store.runs.Get(octx, runKey(tenant, id))
		return err
	}, "reading a job", "tenant", tenant, "job", id)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return Run{}, fmt.Errorf("%w: %s", ErrNoJob, id)
	}
	if err != nil {
		return Run{}, fmt.Errorf("runner: read job %s: %w", id, err)
	}
	return decodeRun(id, e.Value(), e.Revision())
}

func decodeRun(id string, b []byte, rev uint64) (Run, error) {
	var r Run
	if err := json.Unmarshal(b, &r); err != nil {
		return Run{}, fmt.Errorf("runner: job %s is corrupt: %w", id, err)
	}
	r.rev = rev
	return r, nil
}

// getDirect reads one run with a direct get (any replica, no JetStream API request): it may be
// a moment behind the leader (see getLatest).
func (q *runStore) getDirect(ctx context.Context, tenant, id string) (Run, error) {
	if q.behind != nil {
		if r, ok := q.behind(tenant, id); ok {
			return r, nil
		}
	}
	e, err := q.runs.Get(ctx, runKey(tenant, id))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return Run{}, fmt.Errorf("%w: %s", ErrNoJob, id)
	}
	if err != nil {
		return Run{}, err
	}
	return decodeRun(id, e.Value(), e.Revision())
}

// getLatest reads one run from the leader of the runs bucket's stream. Get is a direct get,
// which any replica that is nearly caught up (or a mirror) may answer: it can miss a run
// created a moment ago, or show an older state of it. A claim decides on what it reads (a
// missing run drops the queue entry for good), so it reads here.
func (q *runStore) getLatest(ctx context.Context, tenant, id string) (Run, error) {
	if !validID(id) {
		return Run{}, fmt.Errorf("%w: %q", ErrNoJob, id)
	}
	b, rev, err := q.s.st.JS().LeaderGet(ctx, q.runs.Bucket(), runKey(tenant, id))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return Run{}, fmt.Errorf("%w: %s", ErrNoJob, id)
	}
	if err != nil {
		return Run{}, fmt.Errorf("runner: read job %s: %w", id, err)
	}
	return decodeRun(id, b, rev)
}

func validID(id string) bool {
	if id == "" || len(id) > 64 {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

// List returns up to limit of the tenant's runs, newest first, optionally only those in status.
func (s *Service) List(ctx context.Context, tenant string, status Status, limit int) ([]Run, error) {
	if status != "" && !status.valid() {
		return nil, fmt.Errorf("%w: status %q is not one of pending, running, succeeded, failed", ErrBadJob, status)
	}
	// Not KeyValue.ListKeys: under load it can end the list early (see jsx.Records.Keys).
	keys, err := s.st.JS().Records(s.store.runs).Keys(ctx, tenant+".*")
	if err != nil {
		return nil, fmt.Errorf("runner: list jobs: %w", err)
	}
	slices.Reverse(keys)
	out := []Run{}
	for _, k := range keys {
		_, id, _ := strings.Cut(k, ".")
		r, err := s.Get(ctx, tenant, id)
		if errors.Is(err, ErrNoJob) {
			continue
		}
		if err != nil {
			return nil, err
		}
		if status == "" || r.Status == status {
			out = append(out, r)
			if len(out) >= limit {
				break
			}
		}
	}
	return out, nil
}

// putRun writes r by compare-and-set on its revision. A finished run is kept for Retention.
func (q *runStore) putRun(ctx context.Context, r *Run) error {
	b, _ := json.Marshal(r)
	var ttl time.Duration
	if r.Status.done() {
		ttl = q.s.cfg.Retention
	}
	rev, err := q.s.st.JS().UpdateKV(ctx, q.runs.Bucket(), runKey(r.Tenant, r.ID), b, r.rev, ttl)
	if err != nil {
		return err
	}
	r.rev = rev
	return nil
}

// queueFullError is ErrQueueFull with the time after which a create may succeed.
type queueFullError struct {
	depth, max int
	retry      time.Duration
}

func (e *queueFullError) Error() string {
	return fmt.Sprintf("%v: %d jobs are waiting or running, the cap is %d", ErrQueueFull, e.depth, e.max)
}

func (e *queueFullError) Is(target error) bool { return target == ErrQueueFull }

// queueFull counts a create refused at the queue's cap and says when to try again.
func (s *Service) queueFull(depth int) error {
	s.m.rejected.Inc()
	return &queueFullError{depth: depth, max: s.cfg.MaxQueued, retry: s.store.retryAfter(depth)}
}

// retryAfter estimates when the tenant's queue drops under its cap: the jobs over it at the
// tenant's rate, if it has one; else a second. At most a minute.
func (q *runStore) retryAfter(depth int) time.Duration {
	d := time.Second
	if r := q.s.cfg.TenantJobsPerMinute; r > 0 {
		d = max(d, time.Duration(depth-q.s.cfg.MaxQueued+1)*time.Minute/time.Duration(r))
	}
	return min(d, time.Minute)
}

// knownInstance reports whether instance belongs to this shard: it is in the instance
// directory (online or not: a job for an offline instance waits for it) or has written its
// runner status.
func (q *runStore) knownInstance(ctx context.Context, instance string) bool {
	id := schema.InstanceID{Kind: q.s.cfg.ID.Kind, Shard: q.s.cfg.ID.Shard, Instance: instance}
	if instance == q.s.cfg.ID.Instance {
		return true
	}
	if _, err := q.s.board.status.Get(ctx, id.Key()); err == nil {
		return true
	}
	_, err := q.s.st.Directory().Instance(ctx, id)
	return err == nil
}
