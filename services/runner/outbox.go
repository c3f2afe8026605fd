package runner

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The outbox. An effect is first recorded on the tenant's outbox subject, jobs.<tenant>.fx,
// with the dedupe key as JetStream message id (a second recording within the stream's
// duplicate window is dropped by the server), then delivered through deliverOnce, then its
// outbox entry is removed. Entries left behind (a failed delivery, a crash) are delivered by
// flushOutbox: at release, and by the next owner when it acquires the tenant.
//
// deliverOnce guards each delivery with a marker in KV tm_runner_outbox, key = dedupe key:
//
//	absent -> create "delivering" (lease) -> provider.Do -> update "delivered"
//
// Only the instance whose create (or takeover of an expired lease, by compare-and-set) won
// calls the provider; everyone else waits for "delivered" and skips. A failed delivery
// deletes its marker so the next attempt may deliver. The one window that can repeat an
// effect is an instance dying after the provider accepted and before "delivered" was written:
// after the lease the effect is delivered again, with the same dedupe key, which an
// idempotent receiver (Idempotency-Key, Message-ID) drops.

// Marker states.
const (
	markDelivering = "delivering"
	markDelivered  = "delivered"
)

type marker struct {
	State string    `json:"state"`
	By    string    `json:"by"`
	At    time.Time `json:"at"`
	Until time.Time `json:"until,omitempty"`
	// Attempts is the provider's count for the delivery that succeeded.
	Attempts int `json:"attempts,omitempty"`
}

// deliverAll records every request in the outbox, then delivers each once. When a delivery
// fails for good (a permanent error, or last is set: no attempt follows), the entries are
// removed: the effects are abandoned with the job, which is marked failed.
func (s *Service) deliverAll(ctx context.Context, reqs []Request, last bool) (err error) {
	seqs := make([]uint64, len(reqs))
	for i, req := range reqs {
		seq, err := s.record(ctx, req)
		if err != nil {
			return err
		}
		seqs[i] = seq
	}
	defer func() {
		if err != nil && (last || errors.Is(err, ErrPermanent)) {
			for _, seq := range seqs {
				s.dropEntry(seq)
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
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.RunTimeout)
		err := s.deliverOnce(dctx, req)
		cancel()
		if err != nil {
			return err
		}
		s.dropEntry(seqs[i])
	}
	return nil
}

// record stores req on the tenant's outbox subject; a duplicate returns the first's sequence.
func (s *Service) record(ctx context.Context, req Request) (uint64, error) {
	if s.effects[req.Effect] == nil {
		return 0, fmt.Errorf("%w: no effect provider %q", ErrPermanent, req.Effect)
	}
	b, err := json.Marshal(req)
	if err != nil {
		return 0, err
	}
	ack, err := s.js.PublishMsg(ctx, &nats.Msg{Subject: outboxSubject(req.Tenant), Data: b}, jetstream.WithMsgID(req.Key))
	if err != nil {
		return 0, fmt.Errorf("runner: record effect %s in the outbox: %w", req.Key, err)
	}
	return ack.Sequence, nil
}

// effectLease is how long a delivering marker is trusted before another instance may take the
// delivery over: longer than any attempt, whose effects run inside RunTimeout.
func (s *Service) effectLease() time.Duration { return s.cfg.RunTimeout + 10*time.Second }

// deliverOnce delivers req unless it was delivered before (see the outbox comment above).
func (s *Service) deliverOnce(ctx context.Context, req Request) error {
	eff := s.effects[req.Effect]
	if eff == nil {
		return fmt.Errorf("%w: no effect provider %q", ErrPermanent, req.Effect)
	}
	rev, err := s.takeMarker(ctx, req.Key)
	if errors.Is(err, errDelivered) {
		s.m.effects.WithLabelValues(req.Effect, "deduped").Inc()
		s.mu.Lock()
		s.totals.Deduped++
		s.mu.Unlock()
		return nil
	}
	if err != nil {
		return err
	}
	res, err := eff.Do(ctx, req)
	if err != nil {
		s.m.effects.WithLabelValues(req.Effect, "failed").Inc()
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.OpTimeout)
		_ = s.markers.Delete(dctx, req.Key, jetstream.LastRevision(rev))
		cancel()
		return fmt.Errorf("effect %s (%s): %w", req.Key, req.Effect, err)
	}
	s.m.effects.WithLabelValues(req.Effect, "delivered").Inc()
	s.mu.Lock()
	s.totals.Effects++
	s.mu.Unlock()
	b, _ := json.Marshal(marker{State: markDelivered, By: s.cfg.ID.Instance, At: time.Now().UTC(), Attempts: res.Attempts})
	uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.OpTimeout)
	defer cancel()
	if _, err := s.markers.Update(uctx, req.Key, b, rev); err != nil {
		// Delivered, but the marker says otherwise: a later attempt may repeat the effect
		// (with the same Idempotency-Key). Say so loudly.
		s.cfg.Logger.Error("effect delivered but its marker was not written", "key", req.Key, "err", err)
	}
	return nil
}

var errDelivered = errors.New("already delivered")

// takeMarker makes this instance the deliverer of key and returns the marker's revision, or
// errDelivered. It waits while another live deliverer holds the key.
func (s *Service) takeMarker(ctx context.Context, key string) (uint64, error) {
	pause := 10 * time.Millisecond
	for {
		now := time.Now().UTC()
		mine, _ := json.Marshal(marker{State: markDelivering, By: s.cfg.ID.Instance, At: now, Until: now.Add(s.effectLease())})
		e, err := s.markers.Get(ctx, key)
		switch {
		case errors.Is(err, jetstream.ErrKeyNotFound):
			rev, err := s.markers.Create(ctx, key, mine)
			if err == nil {
				return rev, nil
			}
			if !isConflict(err) {
				return 0, fmt.Errorf("runner: marker %s: %w", key, err)
			}
			continue // someone else created it: look again
		case err != nil:
			return 0, fmt.Errorf("runner: marker %s: %w", key, err)
		}
		var m marker
		if json.Unmarshal(e.Value(), &m) != nil {
			m = marker{} // corrupt: treat as an expired lease
		}
		if m.State == markDelivered {
			return 0, errDelivered
		}
		if m.Until.Before(now) {
			rev, err := s.markers.Update(ctx, key, mine, e.Revision())
			if err == nil {
				s.cfg.Logger.Warn("taking over an effect whose deliverer's lease ran out; the receiver may see it twice", "key", key, "was", m.By)
				return rev, nil
			}
			if !isConflict(err) {
				return 0, fmt.Errorf("runner: marker %s: %w", key, err)
			}
			continue
		}
		// Another deliverer is at work: wait for it, bounded by ctx.
		t := time.NewTimer(pause)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return 0, fmt.Errorf("runner: waiting for effect %s held by %s: %w", key, m.By, ctx.Err())
		}
		pause = min(pause*2, time.Second)
	}
}

// flushOutbox delivers every entry left in the tenant's outbox and removes it. It returns the
// number of entries it handled.
func (s *Service) flushOutbox(ctx context.Context, tenant string) (int, error) {
	n := 0
	var seq uint64 = 1
	for {
		gctx, cancel := context.WithTimeout(ctx, s.cfg.OpTimeout)
		m, err := s.jobs.GetMsg(gctx, seq, jetstream.WithGetMsgSubject(outboxSubject(tenant)))
		cancel()
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return n, nil
		}
		if err != nil {
			return n, err
		}
		seq = m.Sequence + 1
		var req Request
		if err := json.Unmarshal(m.Data, &req); err != nil || req.Tenant != tenant {
			s.cfg.Logger.Warn("dropping a corrupt outbox entry", "tenant", tenant, "seq", m.Sequence)
			s.dropEntry(m.Sequence)
			continue
		}
		dctx, cancel := context.WithTimeout(ctx, s.cfg.RunTimeout)
		err = s.deliverOnce(dctx, req)
		cancel()
		if err != nil {
			if errors.Is(err, ErrPermanent) {
				s.cfg.Logger.Warn("dropping an effect that cannot be delivered", "key", req.Key, "err", err)
				s.dropEntry(m.Sequence)
				continue
			}
			return n, err
		}
		s.dropEntry(m.Sequence)
		n++
	}
}
