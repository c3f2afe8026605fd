package runner

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/tenantmesh/tenantmesh/internal/backoff"
	"github.com/tenantmesh/tenantmesh/internal/tracing"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// The outbox. An effect is first recorded on the tenant's outbox subject, jobs.<tenant>.fx,
// with the dedupe key as JetStream message id (a second recording within the stream's
// duplicate window is dropped by the server), then delivered through deliverOnce, then its
// outbox entry is removed. Entries left behind (a failed delivery, a crash) are delivered by
// outbox.flush: at release, and by the next owner when it acquires the tenant.
//
// deliverOnce guards each delivery with a marker in KV tm_runner_outbox, key = dedupe key:
//
//	absent -> create "delivering" (lease) -> provider.Do -> update "delivered" (or "failed")
//
// Only the instance whose create (or takeover of an expired lease or a failed delivery, by
// compare-and-set) won calls the provider; everyone else waits for "delivered" and skips. A
// failed delivery marks its marker "failed" so the next attempt may deliver. "delivered" and
// "failed" are written with the Retention TTL: JetStream removes them then. The one window that can repeat an
// effect is an instance dying after the provider accepted and before "delivered" was written:
// after the lease the effect is delivered again, with the same dedupe key, which an
// idempotent receiver (Idempotency-Key, Message-ID) drops.

// Marker states.
const (
	markDelivering = "delivering"
	markDelivered  = "delivered"
	markFailed     = "failed"
)

type marker struct {
	State string    `json:"state"`
	By    string    `json:"by"`
	At    time.Time `json:"at"`
	Until time.Time `json:"until,omitempty"`
	// Token tells the writer's own marker from anyone else's, so that a write whose answer
	// was lost is recognised on the next read.
	Token string `json:"token,omitempty"`
	// Attempts is the provider's count for the delivery that succeeded.
	Attempts int `json:"attempts,omitempty"`
}

// outbox records a job's effects before they are delivered and delivers each at most once:
// a delivery marker in tm_runner_outbox (created only if absent) makes a retried job, a
// second instance or a new owner skip an effect that was delivered. It also flushes the
// outboxes of tenants an instance takes over.
type outbox struct {
	s         *Service
	markers   jetstream.KeyValue
	effects   map[string]Effect // providers by name
	flushq    []*tenantQ        // tenants whose outbox is to be flushed; under s.mu
	flushWake chan struct{}
}

// deliverAll records every request in the outbox, then delivers each once. When a delivery
// fails for good (a permanent error, or last is set: no attempt follows), the entries are
// removed: the effects are abandoned with the job, which is marked failed.
func (o *outbox) deliverAll(ctx context.Context, reqs []Request, last bool) (err error) {
	seqs := make([]uint64, len(reqs))
	var trace string
	if tracing.On() {
		h := nats.Header{}
		tracing.Inject(ctx, h)
		trace = h.Get("traceparent")
	}
	for i := range reqs {
		reqs[i].Trace = trace
		seq, err := o.record(ctx, reqs[i])
		if err != nil {
			return err
		}
		seqs[i] = seq
	}
	defer func() {
		if err != nil && (last || errors.Is(err, ErrPermanent)) {
			for _, seq := range seqs {
				o.s.exec.dropEntry(seq)
			}
		}
	}()
	for i, req := range reqs {
		if err := ctx.Err(); err != nil {
			return err // cancelled (drain bound, shutdown): start no new delivery
		}
		// A delivery that started is not cancelled with its run: cutting a request the
		// receiver may already have acted on would make the next attempt repeat it. It is
		// bounded by RunTimeout instead.
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), o.s.cfg.RunTimeout)
		err := o.deliverOnce(dctx, req)
		cancel()
		if err != nil {
			return err
		}
		o.s.exec.dropEntry(seqs[i])
	}
	return nil
}

// record stores req on the tenant's outbox subject; a duplicate returns the first's sequence,
// so a try whose answer was lost (a leader election) is simply made again.
func (o *outbox) record(ctx context.Context, req Request) (uint64, error) {
	if o.effects[req.Effect] == nil {
		return 0, fmt.Errorf("%w: no effect provider %q", ErrPermanent, req.Effect)
	}
	b, err := json.Marshal(req)
	if err != nil {
		return 0, err
	}
	var seq uint64
	err = o.s.cfg.whileUnavailable(ctx, func(octx context.Context) error {
		ack, err := o.s.js.PublishMsg(octx, &nats.Msg{Subject: outboxSubject(req.Tenant), Data: b}, jetstream.WithMsgID(req.Key))
		if err == nil {
			seq = ack.Sequence
		}
		return err
	}, "recording an effect", "key", req.Key)
	if err != nil {
		return 0, fmt.Errorf("runner: record effect %s in the outbox: %w", req.Key, err)
	}
	return seq, nil
}

// markerMargin is how much of a delivering marker's lease its holder leaves unused: the other
// instances judge it by their own clocks.
const markerMargin = time.Second

// effectLease is how long a delivering marker is trusted before another instance may take the
// delivery over: longer than any attempt, whose effects run inside RunTimeout.
func (o *outbox) effectLease() time.Duration { return o.s.cfg.RunTimeout + 10*time.Second }

// deliverOnce delivers req unless it was delivered before (see the outbox comment above).
func (o *outbox) deliverOnce(ctx context.Context, req Request) error {
	eff := o.effects[req.Effect]
	if eff == nil {
		return fmt.Errorf("%w: no effect provider %q", ErrPermanent, req.Effect)
	}
	if h := (nats.Header{"traceparent": {req.Trace}}); req.Trace != "" && tracing.Traced(h) {
		var span trace.Span
		ctx, span = tracer.Start(tracing.Extract(ctx, h), "effect.deliver", trace.WithAttributes(
			attribute.String("tm.tenant", req.Tenant), attribute.String("tm.effect", req.Effect), attribute.String("tm.effect.key", req.Key)))
		defer span.End()
	}
	h, err := o.takeMarker(ctx, req.Key, newID("", ""))
	if errors.Is(err, errDelivered) {
		o.s.m.effects.WithLabelValues(req.Effect, "deduped").Inc()
		o.s.mu.Lock()
		o.s.totals.Deduped++
		o.s.mu.Unlock()
		return nil
	}
	if err != nil {
		return err
	}
	// Writes after the delivery are tried while the marker is ours (then another instance may
	// take the delivery over), whether or not the run was cancelled meanwhile.
	mctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), h.until)
	defer cancel()
	// The delivery itself starts only while the marker is ours by this process's own
	// monotonic clock, with a margin for the other instances' clocks, and cannot outlast it: a
	// process frozen (or cut off) after taking the marker wakes past its lease and delivers
	// nothing the instance that took the delivery over may deliver too. What stays is a
	// delivery the receiver took while its deliverer could not write "delivered" in time.
	mine := time.Now().Add(time.Until(h.until) - markerMargin)
	if !time.Now().Before(mine) {
		return fmt.Errorf("runner: effect %s: its marker's lease ran out before the delivery began; the next attempt takes it again", req.Key)
	}
	dctx, dcancel := context.WithDeadline(ctx, mine)
	defer dcancel()
	res, err := eff.Do(dctx, req)
	if err != nil {
		o.s.m.effects.WithLabelValues(req.Effect, "failed").Inc()
		b, _ := json.Marshal(marker{State: markFailed, By: o.s.cfg.ID.Instance, Token: h.token, At: time.Now().UTC()})
		_ = o.s.cfg.whileUnavailable(mctx, func(octx context.Context) error {
			_, err := o.s.st.JS().UpdateKV(octx, o.markers.Bucket(), req.Key, b, h.rev, o.s.cfg.Retention)
			return err
		}, "freeing an effect's marker", "key", req.Key)
		return fmt.Errorf("effect %s (%s): %w", req.Key, req.Effect, err)
	}
	o.s.m.effects.WithLabelValues(req.Effect, "delivered").Inc()
	o.s.mu.Lock()
	o.s.totals.Effects++
	o.s.mu.Unlock()
	b, _ := json.Marshal(marker{State: markDelivered, By: o.s.cfg.ID.Instance, Token: h.token, At: time.Now().UTC(), Attempts: res.Attempts})
	err = o.s.cfg.whileUnavailable(mctx, func(octx context.Context) error {
		_, err := o.s.st.JS().UpdateKV(octx, o.markers.Bucket(), req.Key, b, h.rev, o.s.cfg.Retention)
		if schema.IsConflict(err) {
			// Stored by an earlier try whose answer was lost? Ask the leader: a replica may
			// not have it yet.
			var m marker
			if b, _, gerr := o.s.st.JS().LeaderGet(octx, o.markers.Bucket(), req.Key); gerr == nil &&
				json.Unmarshal(b, &m) == nil && m.Token == h.token && m.State == markDelivered {
				return nil
			}
		}
		return err
	}, "marking an effect delivered", "key", req.Key)
	if err != nil {
		// Delivered, but the marker says otherwise: a later attempt may repeat the effect
		// (with the same Idempotency-Key). Say so loudly.
		o.s.cfg.Logger.Error("effect delivered but its marker was not written", "key", req.Key, "err", err)
	}
	return nil
}

var errDelivered = errors.New("already delivered")

// held is a delivering marker this instance wrote: its revision, the token that tells it from
// any other writer's, and the end of its lease.
type held struct {
	rev   uint64
	token string
	until time.Time
}

// readMarker reads key's marker; a corrupt one reads as an expired lease.
func (o *outbox) readMarker(ctx context.Context, key string) (marker, uint64, error) {
	e, err := o.markers.Get(ctx, key)
	if err != nil {
		return marker{}, 0, err
	}
	var m marker
	if json.Unmarshal(e.Value(), &m) != nil {
		m = marker{}
	}
	return m, e.Revision(), nil
}

// takeMarker makes this instance the deliverer of key, or returns errDelivered. It waits while
// another live deliverer holds the key. Each NATS call is tried again while NATS is
// unavailable; a create or takeover whose answer was lost shows up, on the next read, as a
// marker carrying token, unique to this call.
func (o *outbox) takeMarker(ctx context.Context, key, token string) (held, error) {
	pauses := backoff.Policy{Initial: 10 * time.Millisecond, Max: time.Second}.Pauses()
	for {
		var m marker
		var rev uint64
		err := o.s.cfg.whileUnavailable(ctx, func(octx context.Context) (err error) {
			m, rev, err = o.readMarker(octx, key)
			return err
		}, "reading an effect's marker", "key", key)
		now := time.Now().UTC()
		h := held{token: token, until: now.Add(o.effectLease())}
		mine, _ := json.Marshal(marker{State: markDelivering, By: o.s.cfg.ID.Instance, Token: token, At: now, Until: h.until})
		switch {
		case errors.Is(err, jetstream.ErrKeyNotFound):
			err = o.s.cfg.whileUnavailable(ctx, func(octx context.Context) (err error) {
				h.rev, err = o.markers.Create(octx, key, mine)
				return err
			}, "taking an effect's marker", "key", key)
		case err != nil:
			return held{}, fmt.Errorf("runner: marker %s: %w", key, err)
		case m.Token == token && m.State == markDelivering:
			return held{rev: rev, token: token, until: m.Until}, nil // an earlier try of ours landed
		case m.State == markDelivered:
			return held{}, errDelivered
		case m.State == markFailed || m.Until.Before(now):
			err = o.s.cfg.whileUnavailable(ctx, func(octx context.Context) (err error) {
				h.rev, err = o.markers.Update(octx, key, mine, rev)
				return err
			}, "taking over an effect's marker", "key", key)
			if err == nil && m.State != markFailed {
				o.s.cfg.Logger.Warn("taking over an effect whose deliverer's lease ran out; the receiver may see it twice", "key", key, "was", m.By)
			}
		default:
			err = errHeld // another deliverer is at work
		}
		if err == nil {
			return h, nil
		}
		if !schema.IsConflict(err) && !errors.Is(err, errHeld) {
			return held{}, fmt.Errorf("runner: marker %s: %w", key, err)
		}
		// Someone else wrote the marker first, or holds it: look again shortly, bounded by ctx.
		if !pauses.Wait(ctx) {
			return held{}, fmt.Errorf("runner: waiting for effect %s held by %s: %w", key, m.By, ctx.Err())
		}
	}
}

var errHeld = errors.New("held by another deliverer")

// flush delivers every entry left in the tenant's outbox and removes it. It returns the
// number of entries it handled.
func (o *outbox) flush(ctx context.Context, tenant string) (int, error) {
	n := 0
	var seq uint64 = 1
	for {
		var m *jetstream.RawStreamMsg
		err := o.s.cfg.whileUnavailable(ctx, func(octx context.Context) (err error) {
			m, err = o.s.jobs.GetMsg(octx, seq, jetstream.WithGetMsgSubject(outboxSubject(tenant)))
			return err
		}, "reading the outbox", "tenant", tenant)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return n, nil
		}
		if err != nil {
			return n, err
		}
		seq = m.Sequence + 1
		var req Request
		if err := json.Unmarshal(m.Data, &req); err != nil || req.Tenant != tenant {
			o.s.cfg.Logger.Warn("dropping a corrupt outbox entry", "tenant", tenant, "seq", m.Sequence)
			o.s.exec.dropEntry(m.Sequence)
			continue
		}
		dctx, cancel := context.WithTimeout(ctx, o.s.cfg.RunTimeout)
		err = o.deliverOnce(dctx, req)
		cancel()
		if err != nil {
			if errors.Is(err, ErrPermanent) {
				o.s.cfg.Logger.Warn("dropping an effect that cannot be delivered", "key", req.Key, "err", err)
				o.s.exec.dropEntry(m.Sequence)
				continue
			}
			return n, err
		}
		o.s.exec.dropEntry(m.Sequence)
		n++
	}
}
