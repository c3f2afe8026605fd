package runner

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"

	"github.com/tenantmesh/tenantmesh/internal/ctxtime"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
	"github.com/tenantmesh/tenantmesh/shardkit/kvwatch"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Move verification (shardkit's Digest hook): the runner keeps no state of its own, so what a
// move's source and target compare is how each sees the tenant's queue and outbox at the
// fence. Two parts:
//
//   - queue: the jobs waiting that no instance has claimed (pending, no attempt): from the
//     source's fence until the target's first claim nothing can change them (the source stops
//     acquiring at the fence, the target starts at the commit, new jobs wait in the gateway's
//     hold), so both sides must list the same;
//   - outbox: the effects recorded and not being delivered (no marker) whose producer is done
//     with them: a finished job's, or a saga's for an event at or below the saga checkpoint.
//
// Jobs in flight at the fence, and their effects, are left out: the source finishes them
// while the move goes on, so they legitimately change between the two digests. The source's
// digest is read from the fence on, beside the handoff rather than in it (its drained note goes
// out at once), and so is the target's (shardkit's DigestBeside): both leave out the jobs
// queued after the handoff's epoch (by the new owner), and the target acquires the tenant only
// once both digests are recorded (awaitDigests), so no claim of its own changes what either
// reads. The handoff pause carries none of their round trips; the target's first claims of the
// tenant wait for them. Even so the runner takes them only when its kind's config says
// verify.

// followVerify keeps s.verify equal to the kind config's verify flag, from a watch of the
// kind's key: the runner takes its digest (NATS reads inside the handoff pause) only for a kind
// that asked for verified moves.
func (s *Service) followVerify(ctx context.Context) {
	for ctx.Err() == nil {
		w, err := s.st.KV(schema.BucketKinds).Watch(ctx, s.cfg.ID.Kind)
		if err == nil {
			for e := range w.Updates() {
				if e == nil {
					continue
				}
				var kc schema.KindConfig
				if e.Operation() == jetstream.KeyValuePut && json.Unmarshal(e.Value(), &kc) == nil {
					s.verify.Store(kc.Verify)
				} else {
					s.verify.Store(false)
				}
			}
			_ = w.Stop()
		}
		ctxtime.Sleep(ctx, time.Second)
	}
}

// errNotVerifying is the Digest hook's answer for a kind that does not verify its moves.
var errNotVerifying = errors.New("runner: the kind does not verify moves (set verify in its config): no digest taken in the handoff")

// maxDigestEntries bounds the queue and outbox entries a digest reads; a tenant with more
// leaves its moves unverified rather than lengthen the handoff pause.
const maxDigestEntries = 2000

// captured is a digest the source takes from its fence on: done is closed once d and err are
// set.
type captured struct {
	done chan struct{}
	d    schema.Digest
	err  error
}

// captureAtFence starts reading the tenant's digest as a move's source stops acquiring it; it
// does not wait for the read (the handoff goes on meanwhile; see awaitSourceDigest). The read
// waits (within OpTimeout) for settled, the claims under way at the fence: a claim that then
// finds the tenant released gives its job back to pending, and a read before that give-back
// saw the job running where the target, reading later, sees it queued (a false mismatch that
// a quiet 1,000-move e2e run once hit).
func (s *Service) captureAtFence(tenant string, settled <-chan struct{}) {
	if !s.verify.Load() {
		return
	}
	// Read after the fence, possibly once the target has the tenant: what it queues then
	// (at a later epoch) is not the source's.
	epoch := s.handoffEpoch(tenant)
	c := &captured{done: make(chan struct{})}
	s.mu.Lock()
	s.fenced[tenant] = c
	s.mu.Unlock()
	s.housekeeping.Go(func() {
		defer close(c.done)
		t := time.NewTimer(s.cfg.OpTimeout)
		select {
		case <-settled:
		case <-t.C:
			s.cfg.Logger.Warn("a claim under way at the fence has not settled; reading the digest without it", "tenant", tenant, "waited", s.cfg.OpTimeout)
		}
		t.Stop()
		ctx, cancel := context.WithTimeout(context.Background(), s.cfg.OpTimeout)
		defer cancel()
		c.d, c.err = s.queueDigest(ctx, tenant, epoch)
	})
}

// Digest is the tenant's queue and outbox at the fence: on a move's source what it captured
// from its fence, on its target what it reads now. shardkit hook.
func (s *Service) Digest(ctx context.Context, tenant string, _ uint64) (schema.Digest, error) {
	s.mu.Lock()
	c, ok := s.fenced[tenant]
	delete(s.fenced, tenant)
	s.mu.Unlock()
	if ok {
		select {
		case <-c.done:
			return c.d, c.err
		case <-ctx.Done():
			return schema.Digest{}, ctx.Err()
		}
	}
	if !s.verify.Load() {
		return schema.Digest{}, errNotVerifying
	}
	return s.queueDigest(ctx, tenant, s.handoffEpoch(tenant))
}

// queueDigest reads the tenant's queue and outbox and digests the settled part of them: the
// count of its entries (nothing more when there are none), one ordered consumer over its
// subjects, then the runs of its queue entries, the markers of its outbox entries and its saga
// checkpoint, in parallel. Jobs queued at a placement epoch after epoch are left out (0: none).
func (s *Service) queueDigest(ctx context.Context, tenant string, epoch uint64) (schema.Digest, error) {
	var queue, fx schema.DigestSet
	// The stream's count of the tenant's entries first: one round trip, and for an empty
	// queue and outbox (most moves) the only one.
	info, err := s.jobs.Info(ctx, jetstream.WithSubjectFilter(schema.TenantJobs(tenant)))
	if err != nil {
		return schema.Digest{}, fmt.Errorf("runner: digest of %s: %w", tenant, err)
	}
	if len(info.State.Subjects) == 0 {
		return schema.NewDigest(0, queue.Part("queue"), fx.Part("outbox")), nil
	}
	jobs, effects, err := s.readEntries(ctx, tenant, epoch)
	if err != nil {
		return schema.Digest{}, err
	}
	if len(jobs) == 0 && len(effects) == 0 {
		return schema.NewDigest(0, queue.Part("queue"), fx.Part("outbox")), nil
	}
	var runs map[string]Run
	marked := make([]bool, len(effects))
	var checkpoint uint64
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(64)
	if len(jobs) > 0 {
		g.Go(func() (err error) {
			runs, err = s.readRuns(gctx, tenant, jobs)
			return err
		})
	}
	for i, req := range effects {
		g.Go(func() error {
			_, _, err := s.outbox.readMarker(gctx, req.Key)
			if errors.Is(err, jetstream.ErrKeyNotFound) {
				return nil
			}
			marked[i] = true
			return err
		})
	}
	if len(effects) > 0 {
		g.Go(func() error {
			cp, _, err := s.sagas.checkpoint(gctx, tenant)
			checkpoint = cp.Seq
			return err
		})
	}
	if err := g.Wait(); err != nil {
		return schema.Digest{}, fmt.Errorf("runner: digest of %s: %w", tenant, err)
	}
	done := map[string]bool{}
	for _, r := range runs {
		switch {
		case r.Status == StatusPending && r.Attempts == 0:
			queue.Add(schema.RowEncoder(nil).String(r.ID).String(r.Type).String(r.Instance).Time(r.CreatedAt))
		case r.Status.done():
			done[r.ID] = true
		}
	}
	for i, req := range effects {
		if !marked[i] && settledEffect(req.Key, tenant, done, checkpoint) {
			fx.Add(schema.RowEncoder(nil).String(req.Key).String(req.Effect).String(req.To))
		}
	}
	return schema.NewDigest(0, queue.Part("queue"), fx.Part("outbox")), nil
}

// settledEffect reports whether the effect with dedupe key is one its producer is done with:
// <tenant>.job.<id>.<n> of a finished job, <tenant>.saga.<saga>.<seq>.<n> at or below the
// tenant's saga checkpoint.
func settledEffect(key, tenant string, doneJobs map[string]bool, checkpoint uint64) bool {
	rest, ok := strings.CutPrefix(key, tenant+".")
	if !ok {
		return false
	}
	parts := strings.Split(rest, ".")
	switch {
	case len(parts) == 3 && parts[0] == "job":
		return doneJobs[parts[1]]
	case len(parts) == 4 && parts[0] == "saga":
		seq, err := strconv.ParseUint(parts[2], 10, 64)
		return err == nil && seq <= checkpoint
	}
	return false
}

// readEntries reads the tenant's queue entries (job ids) and outbox entries (effect requests)
// with one ordered consumer, at most maxDigestEntries of them.
func (s *Service) readEntries(ctx context.Context, tenant string, epoch uint64) (jobs []string, effects []Request, err error) {
	cons, err := s.jobs.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{schema.TenantJobs(tenant)}, DeliverPolicy: jetstream.DeliverAllPolicy})
	if err != nil {
		return nil, nil, fmt.Errorf("runner: read the queue of %s: %w", tenant, err)
	}
	fx := outboxSubject(tenant)
	for got := 0; ; {
		// No wait: the server answers with what the consumer has (the tenant's entries), and
		// nothing when it has none; a fetch that waited would hold the handoff.
		batch, err := cons.FetchNoWait(maxDigestEntries + 1 - got)
		if err != nil {
			return nil, nil, fmt.Errorf("runner: read the queue of %s: %w", tenant, err)
		}
		before, done := got, false
		for m := range batch.Messages() {
			got++
			if m.Subject() == fx {
				var req Request
				if json.Unmarshal(m.Data(), &req) == nil {
					effects = append(effects, req)
				}
			} else {
				var e queueEntry
				if json.Unmarshal(m.Data(), &e) == nil && validID(e.ID) && (epoch == 0 || e.Epoch <= epoch) {
					jobs = append(jobs, e.ID)
				}
			}
			if md, err := m.Metadata(); err == nil && md.NumPending == 0 {
				done = true
			}
		}
		if batch.Error() != nil && !errors.Is(batch.Error(), jetstream.ErrNoMessages) {
			return nil, nil, fmt.Errorf("runner: read the queue of %s: %w", tenant, batch.Error())
		}
		switch {
		case got > maxDigestEntries:
			return nil, nil, fmt.Errorf("runner: %s has more than %d queue and outbox entries, more than a digest at the fence reads", tenant, maxDigestEntries)
		case done || got == before:
			return jobs, effects, nil
		}
	}
}

// readRuns reads the runs of ids with one ordered consumer on the runs bucket's stream, each
// key's last value (a consumer is served by the stream's leader side, so it sees every write
// acknowledged before, as a claim's read does). A run deleted meanwhile is absent.
func (s *Service) readRuns(ctx context.Context, tenant string, ids []string) (map[string]Run, error) {
	bucket := s.store.runs.Bucket()
	subjects := make([]string, len(ids))
	for i, id := range ids {
		subjects[i] = jsx.KVSubject(bucket, runKey(tenant, id))
	}
	stream, err := s.runsStream(ctx)
	if err != nil {
		return nil, err
	}
	cons, err := stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{FilterSubjects: subjects,
		DeliverPolicy: jetstream.DeliverLastPerSubjectPolicy})
	if err != nil {
		return nil, fmt.Errorf("runner: read the runs of %s: %w", tenant, err)
	}
	prefix := jsx.KVSubject(bucket, runKey(tenant, ""))
	out := make(map[string]Run, len(ids))
	for got := 0; got < len(ids); {
		batch, err := cons.FetchNoWait(len(ids) - got)
		if err != nil {
			return nil, fmt.Errorf("runner: read the runs of %s: %w", tenant, err)
		}
		before, done := got, false
		for m := range batch.Messages() {
			got++
			id := strings.TrimPrefix(m.Subject(), prefix)
			if op := m.Headers().Get("KV-Operation"); op == "" {
				md, _ := m.Metadata()
				var rev uint64
				if md != nil {
					rev = md.Sequence.Stream
				}
				if r, err := decodeRun(id, m.Data(), rev); err == nil {
					out[id] = r
				}
			}
			if md, err := m.Metadata(); err == nil && md.NumPending == 0 {
				done = true
			}
		}
		if batch.Error() != nil && !errors.Is(batch.Error(), jetstream.ErrNoMessages) {
			return nil, fmt.Errorf("runner: read the runs of %s: %w", tenant, batch.Error())
		}
		if done || got == before {
			break
		}
	}
	return out, nil
}

// runsStream is the runs bucket's stream, opened once.
func (s *Service) runsStream(ctx context.Context) (jetstream.Stream, error) {
	s.mu.Lock()
	st := s.runsStr
	s.mu.Unlock()
	if st != nil {
		return st, nil
	}
	st, err := s.js.Stream(ctx, jsx.KVStream(s.store.runs.Bucket()))
	if err != nil {
		return nil, fmt.Errorf("runner: open the runs stream: %w", err)
	}
	s.mu.Lock()
	s.runsStr = st
	s.mu.Unlock()
	return st, nil
}

// handoffEpoch is the epoch of the tenant's handoff this shard takes part in, from its
// placement view: the handoff's own while it lasts, the one before the commit's after (a
// digest taken beside the handoff may run after the commit).
func (s *Service) handoffEpoch(tenant string) uint64 {
	e := s.placementOf(tenant)
	if e.Phase == schema.PhaseHandoff || e.Epoch == 0 {
		return e.Epoch
	}
	return e.Epoch - 1
}

// digestWait bounds how long a verified move's target waits for the move's digests before it
// acquires the tenant anyway (a source that died after its fence records none).
const digestWait = 5 * time.Second

// awaitDigests reports whether acquiring tenant at placement e, which this shard owns now, must
// wait for the digests of a verified move (the source's and this instance's read the queue as
// the fence left it only while nothing here claims from it), and starts that wait once per
// move: when both records are in tm_verify, or digestWait passed, the tenant is reconciled
// again. Called under s.mu.
func (s *Service) awaitDigests(ctx context.Context, e placement.Entry, tq *tenantQ) bool {
	if !s.verify.Load() || e.Phase != schema.PhaseDraining || e.Source == "" || e.Source == s.cfg.ID.Shard || e.Epoch == 0 {
		return false
	}
	epoch := e.Epoch - 1 // the handoff's, which the digests carry
	if tq.digested == epoch {
		return false
	}
	if tq.awaiting == epoch {
		return true
	}
	tq.awaiting = epoch
	tenant := tq.tenant
	s.housekeeping.Go(func() {
		if !s.watchDigests(ctx, tenant, epoch) && ctx.Err() == nil {
			s.cfg.Logger.Warn("the move's digests are not in; acquiring the tenant without them", "tenant", tenant, "epoch", epoch, "waited", digestWait)
		}
		s.mu.Lock()
		tq.digested = epoch
		s.changed[tenant] = struct{}{}
		s.mu.Unlock()
		nudge(s.recon)
	})
	return true
}

// watchDigests waits up to digestWait until tm_verify holds the source's digest of tenant's
// handoff at epoch and this instance's, and reports whether they came: one watch of the move's
// keys, where asking again every few milliseconds made a consumer each time.
func (s *Service) watchDigests(ctx context.Context, tenant string, epoch uint64) bool {
	ctx, cancel := context.WithTimeout(ctx, digestWait)
	defer cancel()
	w := &digestWatch{self: s.cfg.ID.Instance, done: make(chan struct{})}
	f, err := kvwatch.New(kvwatch.Config{JS: s.st.JS().JetStream(), Bucket: schema.BucketVerify,
		Filter: schema.DigestFilter(Kind, tenant, epoch)}, w)
	if err != nil {
		return false
	}
	ran := make(chan struct{})
	go func() { defer close(ran); _ = f.Run(ctx) }() // ends with ctx, before watchDigests returns
	defer func() { cancel(); <-ran }()
	select {
	case <-w.done:
		return true
	case <-ctx.Done():
		return false
	}
}

// digestWatch is watchDigests' handler: done closes once both digests are seen.
type digestWatch struct {
	self           string
	source, target bool
	done           chan struct{}
}

func (w *digestWatch) Apply(e kvwatch.Entry) {
	var r schema.DigestRecord
	if e.Op != kvwatch.Put || jsx.Unmarshal(e.Value, &r) != nil || w.source && w.target {
		return
	}
	w.source = w.source || r.Role == schema.RoleSource
	w.target = w.target || r.Role == schema.RoleTarget && r.Instance == w.self
	if w.source && w.target {
		close(w.done)
	}
}

func (w *digestWatch) Synced() {}
