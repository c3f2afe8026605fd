package aggregate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/tenantmesh/tenantmesh/internal/tracing"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// errStore marks a failed call to the event store (NATS unreachable, a cluster failing over, an
// answer lost): transient, and for an append of unknown outcome. Clients retry with the same
// idempotency key, which applies the command once either way.
var errStore = errors.New("aggregate: event store")

// errStale means the aggregate's stream has events this instance has not applied: another
// writer (a sibling instance, or a stale owner's rival) appended first.
var errStale = errors.New("aggregate changed underneath")

// eventStore reads and writes TM_EVENTS and the snapshot object store.
type eventStore struct {
	st     *schema.Store
	js     jetstream.JetStream
	stream jetstream.Stream
	snaps  jetstream.ObjectStore
	// batch is how many events one fetch asks for while replaying.
	batch int
	// retries counts append tries made again (tm_aggregate_append_retries_total).
	retries prometheus.Counter
}

func openEventStore(ctx context.Context, st *schema.Store) (*eventStore, error) {
	if err := st.EnsureEventsStream(ctx); err != nil {
		return nil, err
	}
	js := st.JetStream()
	stream, err := st.Stream(ctx, schema.StreamEvents)
	if err != nil {
		return nil, fmt.Errorf("aggregate: open %s: %w", schema.StreamEvents, err)
	}
	snaps, err := st.ObjectStore(ctx, schema.ServiceBucket("aggregate", "snapshots"), "aggregate service: per-tenant ledger snapshots")
	if err != nil {
		return nil, fmt.Errorf("aggregate: %w", err)
	}
	return &eventStore{st: st, js: js, stream: stream, snaps: snaps, batch: 4096}, nil
}

// append stores ev if its aggregate's last event is still expectLast (0: the aggregate has no
// events). The message id makes a retried command a duplicate JetStream drops; dup reports that.
func (es *eventStore) append(ctx context.Context, ev Event, expectLast uint64) (seq uint64, dup bool, err error) {
	b, err := json.Marshal(ev)
	if err != nil {
		return 0, false, err
	}
	msg := &nats.Msg{
		Subject: schema.EventSubject(ev.Tenant, ev.AggregateType, ev.AggregateID),
		Data:    b,
		Header:  nats.Header{},
	}
	if tracing.On() {
		var span trace.Span
		ctx, span = tracer.Start(ctx, "command.append", trace.WithAttributes(attribute.String("tm.subject", msg.Subject)))
		defer func() {
			span.SetAttributes(attribute.Int64("tm.seq", int64(seq)), attribute.Bool("tm.duplicate", dup))
			span.End()
		}()
		tracing.Inject(ctx, msg.Header)
	}
	opts := []jetstream.PublishOpt{jetstream.WithExpectLastSequencePerSubject(expectLast)}
	if ev.CommandKey != "" {
		opts = append(opts, jetstream.WithMsgID(ev.Tenant+":"+ev.CommandKey))
	}
	wait := 50 * time.Millisecond
	for {
		// Each try is bounded on its own and made again while NATS is unavailable: a publish
		// whose stream leader died before answering would otherwise hold the command for all
		// of its time and fail it. A try again is safe: the message id makes a stored first
		// try a duplicate (or its expected sequence makes it stale), and both paths learn
		// the stored outcome.
		actx, cancel := context.WithTimeout(ctx, appendAttempt)
		ack, err := es.js.PublishMsg(actx, msg, opts...)
		cancel()
		if err == nil {
			return ack.Sequence, ack.Duplicate, nil
		}
		if schema.IsConflict(err) {
			return 0, false, fmt.Errorf("%w: %v", errStale, err)
		}
		if ev.CommandKey == "" || !schema.IsUnavailable(err) || ctx.Err() != nil {
			return 0, false, fmt.Errorf("%w: append to %s: %w", errStore, msg.Subject, err)
		}
		if es.retries != nil {
			es.retries.Inc()
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return 0, false, fmt.Errorf("%w: append to %s: %w", errStore, msg.Subject, err)
		}
		wait = min(2*wait, 500*time.Millisecond)
	}
}

// appendAttempt bounds one try of an append; a command has CommandTimeout (5 s) for all of
// them. A healthy append takes a few milliseconds, a leader election well under a second.
const appendAttempt = 1500 * time.Millisecond

// replay calls fn with every event on filter after sequence after, in order, up to the last
// one present when it started, and returns the sequence of the last event it delivered.
func (es *eventStore) replay(ctx context.Context, filter string, after uint64, fn func(Event) error) (uint64, error) {
	cfg := jetstream.OrderedConsumerConfig{FilterSubjects: []string{filter}}
	if after > 0 {
		cfg.DeliverPolicy = jetstream.DeliverByStartSequencePolicy
		cfg.OptStartSeq = after + 1
	}
	cons, done, err := schema.OrderedRead(ctx, es.js, schema.StreamEvents, cfg)
	if err != nil {
		return 0, fmt.Errorf("%w: replay %s: %w", errStore, filter, err)
	}
	defer done()
	pending := cons.CachedInfo().NumPending
	last := after
	for pending > 0 {
		batch, err := cons.Fetch(int(min(pending, uint64(es.batch))), jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			return last, fmt.Errorf("%w: replay %s: %w", errStore, filter, err)
		}
		got := 0
		for m := range batch.Messages() {
			md, err := m.Metadata()
			if err != nil {
				return last, err
			}
			var ev Event
			if err := json.Unmarshal(m.Data(), &ev); err != nil {
				return last, fmt.Errorf("aggregate: event %d on %s is corrupt: %w", md.Sequence.Stream, m.Subject(), err)
			}
			ev.Seq = md.Sequence.Stream
			if err := fn(ev); err != nil {
				return last, err
			}
			got++
			last, pending = ev.Seq, md.NumPending
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) {
			return last, fmt.Errorf("%w: replay %s: %w", errStore, filter, err)
		}
		if got == 0 {
			return last, fmt.Errorf("%w: replay %s stalled at %d with %d pending", errStore, filter, last, pending)
		}
	}
	return last, nil
}

// lastSeq is the stream sequence of the newest event matching subject (0 if none), read from
// the stream leader: it covers every append acknowledged before, which a replica's direct get
// might not (a catch-up skipped, a rejection decided on old state, a fence too low).
func (es *eventStore) lastSeq(ctx context.Context, subject string) (uint64, error) {
	seq, err := es.st.LastSeq(ctx, schema.StreamEvents, subject)
	if err != nil {
		return 0, fmt.Errorf("%w: %w", errStore, err)
	}
	return seq, nil
}

// tenantEvents counts a tenant's events in the stream (its size, for choosing a warm-up
// strategy).
func (es *eventStore) tenantEvents(ctx context.Context, tenant string) (uint64, error) {
	info, err := es.stream.Info(ctx, jetstream.WithSubjectFilter(schema.TenantEvents(tenant)))
	if err != nil {
		return 0, fmt.Errorf("%w: count events of %s: %w", errStore, tenant, err)
	}
	var n uint64
	for _, c := range info.State.Subjects {
		n += c
	}
	return n, nil
}

// snapshot is a tenant's ledger at one applied sequence.
type snapshot struct {
	Tenant   string              `json:"tenant"`
	Applied  uint64              `json:"applied"`
	Accounts map[string]*Account `json:"accounts"`
	Totals   Totals              `json:"totals"`
	Recent   []idemEntry         `json:"recent"`
}

func (es *eventStore) saveSnapshot(ctx context.Context, s *snapshot) (int, error) {
	b, err := json.Marshal(s)
	if err != nil {
		return 0, err
	}
	if _, err := es.snaps.PutBytes(ctx, s.Tenant, b); err != nil {
		return 0, fmt.Errorf("aggregate: save snapshot of %s: %w", s.Tenant, err)
	}
	return len(b), nil
}

// loadSnapshot returns the tenant's newest snapshot, or nil if it has none.
func (es *eventStore) loadSnapshot(ctx context.Context, tenant string) (*snapshot, int, error) {
	b, err := es.snaps.GetBytes(ctx, tenant)
	if errors.Is(err, jetstream.ErrObjectNotFound) {
		return nil, 0, nil
	}
	if err != nil {
		return nil, 0, fmt.Errorf("%w: load snapshot of %s: %w", errStore, tenant, err)
	}
	var s snapshot
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, 0, fmt.Errorf("aggregate: snapshot of %s is corrupt: %w", tenant, err)
	}
	return &s, len(b), nil
}
