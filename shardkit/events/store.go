package events

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/tenantmesh/tenantmesh/internal/backoff"
	"github.com/tenantmesh/tenantmesh/internal/tracing"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// tracer makes the event store's spans: events.append, whose context the event carries in its
// headers (with tracing on, see internal/tracing).
var tracer = tracing.NewTracer("github.com/tenantmesh/tenantmesh/shardkit/events")

// ErrStore marks a failed call to the event store (NATS unreachable, a cluster failing over, an
// answer lost): transient, and for an append of unknown outcome. Clients retry with the same
// idempotency key, which applies the command once either way.
var ErrStore = errors.New("events: event store")

// ErrStale means the subject has events the appender had not seen: another writer (a sibling
// instance, or a stale owner's rival) appended first.
var ErrStale = errors.New("events: subject changed underneath")

// HeaderType carries an event's type; the message id (Nats-Msg-Id) is <tenant>:<key>.
const HeaderType = "Tm-Event-Type"

// HeaderFormat carries the record format (jsx.Format) of the event's envelope: its subject
// layout and headers. An event without it predates formats (format 1).
const HeaderFormat = "Tm-Format"

// CheckFormat refuses an event stored in a newer format than this binary reads
// (schema.ErrNewerFormat): a reader stops there rather than fold an event it may misread.
func CheckFormat(h nats.Header) error {
	v := h.Get(HeaderFormat)
	if v == "" {
		return nil
	}
	f, err := strconv.Atoi(v)
	if err != nil || f > jsx.Format {
		return fmt.Errorf("events: event format %q (this binary reads up to %d): %w", v, jsx.Format, jsx.ErrNewerFormat)
	}
	return nil
}

// store reads and writes one stream and the snapshot object store.
type store struct {
	st     *schema.Store
	js     jetstream.JetStream
	name   string
	stream jetstream.Stream
	snaps  jetstream.ObjectStore // nil: no snapshots
	prefix func(tenant string) string
	// batch is how many events one fetch asks for while replaying.
	batch int
	// retries counts append tries made again.
	retries prometheus.Counter
}

// subject is where tenant's events about subject are stored.
func (es *store) subject(tenant, subject string) string { return es.prefix(tenant) + subject }

// tenantFilter matches all of tenant's events.
func (es *store) tenantFilter(tenant string) string { return es.prefix(tenant) + ">" }

// Append stores ev for tenant if the tenant's last event (on any of its subjects) is still
// expectLast (0: the tenant has no events): JetStream's expected-last-subject-sequence over the
// tenant's subjects (Nats-Expected-Last-Subject-Sequence-Subject), the single-writer fence. It
// covers the tenant as a whole, not one subject, so a takeover's epoch marker (EpochSubject)
// fences every later append of the former owner, to a new subject too. The message id
// <tenant>:<ev.Key> makes a retried command a duplicate JetStream drops; dup reports that. A
// lost race gives ErrStale; NATS failing gives ErrStore (tries are made again within ctx while
// NATS is unavailable, when ev has a key).
func (es *store) append(ctx context.Context, tenant string, ev Event, expectLast uint64) (seq uint64, dup bool, err error) {
	msg := &nats.Msg{Subject: es.subject(tenant, ev.Subject), Data: ev.Data, Header: nats.Header{}}
	msg.Header.Set(HeaderFormat, formatValue)
	if ev.Type != "" {
		msg.Header.Set(HeaderType, ev.Type)
	}
	if tracing.On() {
		var span trace.Span
		ctx, span = tracer.Start(ctx, "events.append", trace.WithAttributes(attribute.String("tm.subject", msg.Subject)))
		defer func() {
			span.SetAttributes(attribute.Int64("tm.seq", int64(seq)), attribute.Bool("tm.duplicate", dup))
			span.End()
		}()
		tracing.Inject(ctx, msg.Header) // the trace goes on with the event, to its readers
	}
	opts := []jetstream.PublishOpt{jetstream.WithExpectLastSequenceForSubject(expectLast, es.tenantFilter(tenant))}
	if ev.Key != "" {
		opts = append(opts, jetstream.WithMsgID(tenant+":"+ev.Key))
	}
	return es.publish(ctx, msg, opts, ev.Key != "")
}

// publish sends msg with opts, each try bounded and made again while NATS is unavailable if
// retry (msg has an id, so a stored try is recognised as a duplicate).
func (es *store) publish(ctx context.Context, msg *nats.Msg, opts []jetstream.PublishOpt, retry bool) (seq uint64, dup bool, err error) {
	// Each try is bounded on its own and made again while NATS is unavailable: a publish whose
	// stream leader died before answering would otherwise hold the command for all of its time
	// and fail it. A try again is safe: the message id makes a stored first try a duplicate (or
	// its expected sequence makes it stale), and both paths learn the stored outcome.
	p := backoff.Policy{Initial: 50 * time.Millisecond, Max: 500 * time.Millisecond, TryTimeout: appendAttempt,
		RetryIf: func(err error) bool { return retry && schema.IsUnavailable(err) && !schema.IsConflict(err) }}
	if es.retries != nil {
		p.OnRetry = func(error, time.Duration) { es.retries.Inc() }
	}
	var ack *jetstream.PubAck
	err = backoff.Retry(ctx, p, func(ctx context.Context) (err error) {
		ack, err = es.js.PublishMsg(ctx, msg, opts...)
		return err
	})
	switch {
	case err == nil:
		return ack.Sequence, ack.Duplicate, nil
	case schema.IsConflict(err):
		return 0, false, fmt.Errorf("%w: %v", ErrStale, err)
	default:
		return 0, false, fmt.Errorf("%w: append to %s: %w", ErrStore, msg.Subject, err)
	}
}

// appendAttempt bounds the first try of an append, each later one twice the one before (at
// most 4x); a command has Config.Timeout (5 s) for all of them. A healthy append takes a few
// milliseconds, a leader election well under a second: an append whose answer was lost with
// a stream leader that stopped is made again after half a second, not one and a half.
const appendAttempt = 500 * time.Millisecond

// EpochSubject is the subject, within a tenant's events, of the epoch markers a takeover
// writes (Log.Takeover): a service must not use it for events of its own.
const EpochSubject = "tm-epoch"

// epochMarker is an epoch marker's body.
type epochMarker struct {
	Epoch uint64 `json:"tm_epoch"`
}

// writeEpoch stores tenant's epoch marker for epoch, once per epoch however many instances of
// the new owner write it (its message id), and returns its sequence: from then on every append
// of the tenant that expects an earlier last event fails, the former owner's included.
func (es *store) writeEpoch(ctx context.Context, tenant string, epoch uint64) (uint64, error) {
	data, _ := json.Marshal(epochMarker{Epoch: epoch})
	msg := &nats.Msg{Subject: es.subject(tenant, EpochSubject), Data: data, Header: nats.Header{}}
	msg.Header.Set(HeaderType, EpochSubject)
	id := tenant + ":" + EpochSubject + ":" + strconv.FormatUint(epoch, 10)
	seq, _, err := es.publish(ctx, msg, []jetstream.PublishOpt{jetstream.WithMsgID(id)}, true)
	return seq, err
}

var formatValue = strconv.Itoa(jsx.Format)

// decode makes an Event of a stored message of tenant.
func (es *store) decode(tenant string, m jetstream.Msg, seq uint64) Event {
	ev := Event{Subject: strings.TrimPrefix(m.Subject(), es.prefix(tenant)), Data: m.Data(), Seq: seq}
	if h := m.Headers(); h != nil {
		ev.Type = h.Get(HeaderType)
		ev.Key = strings.TrimPrefix(h.Get(jetstream.MsgIDHeader), tenant+":")
	}
	return ev
}

// replay calls fn with every event of tenant on filter after sequence after, in order, up to
// the last one present when it started, and returns the sequence of the last event it
// delivered. Versions are left to the caller.
func (es *store) replay(ctx context.Context, tenant, filter string, after uint64, fn func(Event) error) (uint64, error) {
	r, err := jsx.Read(ctx, es.js, es.name, jsx.ReadConfig{Filters: []string{filter}, Start: after + 1, Batch: es.batch})
	if err != nil {
		return 0, fmt.Errorf("%w: replay %s: %w", ErrStore, filter, err)
	}
	defer r.Stop()
	last := after
	for pending := r.Pending(); pending > 0; {
		wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		m, md, err := r.Next(wctx)
		cancel()
		if err != nil {
			if ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
				err = fmt.Errorf("stalled at %d with %d pending: %w", last, pending, err)
			}
			return last, fmt.Errorf("%w: replay %s: %w", ErrStore, filter, err)
		}
		if err := CheckFormat(m.Headers()); err != nil {
			return last, fmt.Errorf("replay %s at %d: %w", filter, md.Sequence.Stream, err)
		}
		if err := fn(es.decode(tenant, m, md.Sequence.Stream)); err != nil {
			return last, err
		}
		last, pending = md.Sequence.Stream, md.NumPending
	}
	return last, nil
}

// lastSeq is the stream sequence of the newest event matching subject (0 if none), read from
// the stream leader: it covers every append acknowledged before, which a replica's direct get
// might not (a catch-up skipped, a rejection decided on old state, a fence too low).
func (es *store) lastSeq(ctx context.Context, subject string) (uint64, error) {
	seq, err := es.st.JS().LastSeq(ctx, es.name, subject)
	if err != nil {
		return 0, fmt.Errorf("%w: %w", ErrStore, err)
	}
	return seq, nil
}

// count counts tenant's events in the stream (its size, for choosing a warm-up strategy).
func (es *store) count(ctx context.Context, tenant string) (uint64, error) {
	info, err := es.stream.Info(ctx, jetstream.WithSubjectFilter(es.tenantFilter(tenant)))
	if err != nil {
		return 0, fmt.Errorf("%w: count events of %s: %w", ErrStore, tenant, err)
	}
	var n uint64
	for _, c := range info.State.Subjects {
		n += c
	}
	return n, nil
}

// snapshotFormat is written in every snapshot; one of another format is not read (the tenant
// is rebuilt from its events instead). Format 3 added Epoch; a format 2 snapshot is read as
// one at epoch 0 (its writer knew no markers).
const snapshotFormat = 3

// snapshot is a tenant's state at one applied sequence.
type snapshot[S any] struct {
	Format   int                 `json:"format"`
	Tenant   string              `json:"tenant"`
	Applied  uint64              `json:"applied"`
	Subjects map[string]Position `json:"subjects"`
	Recent   []Event             `json:"recent"`
	State    S                   `json:"state"`
	// Events and Bytes are the tenant's size up to the snapshot (see eventBytes); a snapshot
	// written before they were kept has 0, and the size counts from its sequence on.
	Events uint64 `json:"events,omitempty"`
	Bytes  uint64 `json:"bytes,omitempty"`
	// Epoch is the newest epoch marker applied (0: none).
	Epoch uint64 `json:"epoch,omitempty"`
}

func (es *store) saveSnapshot(ctx context.Context, tenant string, b []byte) error {
	if _, err := es.snaps.PutBytes(ctx, tenant, b); err != nil {
		return fmt.Errorf("events: save snapshot of %s: %w", tenant, err)
	}
	return nil
}

// loadSnapshot returns the tenant's newest snapshot, or nil if it has none (or none of this
// format).
func loadSnapshot[S any](ctx context.Context, es *store, tenant string, newState func() S) (*snapshot[S], int, error) {
	if es.snaps == nil {
		return nil, 0, nil
	}
	b, err := es.snaps.GetBytes(ctx, tenant)
	if errors.Is(err, jetstream.ErrObjectNotFound) {
		return nil, 0, nil
	}
	if err != nil {
		return nil, 0, fmt.Errorf("%w: load snapshot of %s: %w", ErrStore, tenant, err)
	}
	s := snapshot[S]{State: newState()}
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, 0, fmt.Errorf("events: snapshot of %s is corrupt: %w", tenant, err)
	}
	if s.Format != snapshotFormat && s.Format != 2 {
		return nil, 0, nil
	}
	return &s, len(b), nil
}
