package runner

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/mail"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/services/ledger"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Saga reacts to a tenant's events (TM_EVENTS, events.<tenant>.>) with effects. The runner
// feeds each owned tenant's events to every saga in stream order, records the effects in the
// outbox with dedupe keys made of the saga, the event's sequence and the effect's index, and
// keeps a per-tenant checkpoint (the last event handled) in KV tm_runner_checkpoints. Delivery
// is at least once per event; effects are deduplicated, so each happens once.
type Saga interface {
	Name() string
	// Step returns the effects for ev, none if the saga ignores it. It must be deterministic:
	// a replayed event must give the same effects.
	Step(ev ledger.Event) []Request
}

// Welcome sends a welcome message when an account is opened (the Cloudlysis PRD section 5's
// transactional email): event "opened" -> one effect to the account's owner.
type Welcome struct {
	// Effect is the provider: "email" (default; To is the owner, which must be an address)
	// or "webhook" (To is URL) or "log".
	Effect string
	// URL is the webhook target when Effect is "webhook".
	URL string
	// Subject of the email. Default "Welcome".
	Subject string
}

// Name implements Saga.
func (Welcome) Name() string { return "welcome" }

// Step implements Saga.
func (w Welcome) Step(ev ledger.Event) []Request {
	if ev.AggregateType != ledger.AccountType || ev.Event != ledger.EvOpened {
		return nil
	}
	var d struct {
		Owner string `json:"owner"`
	}
	_ = json.Unmarshal(ev.Data, &d)
	subject := w.Subject
	if subject == "" {
		subject = "Welcome"
	}
	text := fmt.Sprintf("Welcome, %s: your account %s is open.", d.Owner, ev.AggregateID)
	switch w.Effect {
	case "webhook":
		body, _ := json.Marshal(map[string]string{"event": "welcome", "account": ev.AggregateID, "owner": d.Owner})
		return []Request{{Effect: "webhook", To: w.URL, Body: body}}
	case "log":
		body, _ := json.Marshal(text)
		return []Request{{Effect: "log", To: d.Owner, Subject: subject, Body: body}}
	}
	if _, err := mail.ParseAddress(d.Owner); err != nil {
		return nil // no address to write to
	}
	body, _ := json.Marshal(text)
	return []Request{{Effect: "email", To: d.Owner, Subject: subject, Body: body}}
}

// checkpointState is a tenant's saga progress.
type checkpointState struct {
	Seq uint64    `json:"seq"`
	At  time.Time `json:"at"`
	By  string    `json:"by"`
}

func sagaKey(tenant string) string  { return "saga." + tenant }
func drainKey(tenant string) string { return "drain." + tenant }

// sagas run the sagas over the events of the tenants this instance owns, one batch per ready
// tenant in turn, and keep each tenant's checkpoint.
type sagas struct {
	s      *Service
	checks jetstream.KeyValue // saga checkpoints and drain records per tenant
	ring   []*tenantQ         // tenants with events for the sagas, round robin; under s.mu
	wake   chan struct{}      // nudges the saga loop
}

// checkpoint reads the tenant's saga checkpoint and its revision (0 if none).
func (g *sagas) checkpoint(ctx context.Context, tenant string) (checkpointState, uint64, error) {
	e, err := g.checks.Get(ctx, sagaKey(tenant))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return checkpointState{}, 0, nil
	}
	if err != nil {
		return checkpointState{}, 0, fmt.Errorf("runner: checkpoint of %s: %w", tenant, err)
	}
	var cp checkpointState
	if err := json.Unmarshal(e.Value(), &cp); err != nil {
		return checkpointState{}, 0, fmt.Errorf("runner: checkpoint of %s is corrupt: %w", tenant, err)
	}
	return cp, e.Revision(), nil
}

// Checkpoint is the stream sequence of the last event the tenant's sagas handled.
func (s *Service) Checkpoint(ctx context.Context, tenant string) (uint64, error) {
	cp, _, err := s.sagas.checkpoint(ctx, tenant)
	return cp.Seq, err
}

// markReady puts the tenant in the saga ring if it is acquired and not there yet.
func (g *sagas) markReady(tq *tenantQ) {
	if len(g.s.cfg.Sagas) == 0 {
		return
	}
	g.s.mu.Lock()
	if !tq.sagaReady && tq.acquired && !tq.released {
		tq.sagaReady = true
		g.ring = append(g.ring, tq)
	}
	g.s.mu.Unlock()
	nudge(g.wake)
}

// loop feeds ready tenants' new events to the sagas: one batch per tenant in turn (round
// robin over the saga ring, so one busy tenant does not hold the others back).
func (g *sagas) loop(ctx context.Context) {
	if len(g.s.cfg.Sagas) == 0 {
		return
	}
	for {
		select {
		case <-g.wake:
		case <-ctx.Done():
			return
		}
		for ctx.Err() == nil {
			g.s.mu.Lock()
			if len(g.ring) == 0 {
				g.ring = nil
				g.s.mu.Unlock()
				break
			}
			tq := g.ring[0]
			g.ring[0] = nil
			g.ring = g.ring[1:]
			tq.sagaReady = false
			if !tq.acquired || tq.released {
				g.s.mu.Unlock()
				continue
			}
			tq.work.Add(1)
			tctx := tq.ctx
			g.s.mu.Unlock()
			more, err := g.batch(tctx, tq)
			tq.work.Done()
			if err != nil && ctx.Err() == nil {
				g.s.cfg.Logger.Warn("saga step failed; retrying", "tenant", tq.tenant, "err", err)
				time.AfterFunc(time.Second, func() { g.markReady(tq) })
			} else if more {
				g.markReady(tq)
			}
		}
	}
}

// sagaBatchSize bounds the events one tenant handles per turn.
const sagaBatchSize = 128

// batch handles up to sagaBatchSize of the tenant's events after its checkpoint, then
// advances the checkpoint (compare-and-set: if a sibling moved it, its progress wins; the
// effects both recorded are deduplicated). more: the tenant may have further events.
func (g *sagas) batch(ctx context.Context, tq *tenantQ) (more bool, err error) {
	cp, rev, err := g.checkpoint(ctx, tq.tenant)
	if err != nil {
		return false, err
	}
	last := cp.Seq
	defer func() {
		if last == cp.Seq {
			return
		}
		b, _ := json.Marshal(checkpointState{Seq: last, At: time.Now().UTC(), By: g.s.cfg.ID.Instance})
		wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), g.s.cfg.OpTimeout)
		defer cancel()
		var werr error
		if rev == 0 {
			_, werr = g.checks.Create(wctx, sagaKey(tq.tenant), b)
		} else {
			_, werr = g.checks.Update(wctx, sagaKey(tq.tenant), b, rev)
		}
		if werr != nil && !schema.IsConflict(werr) && err == nil {
			err = fmt.Errorf("runner: write checkpoint of %s: %w", tq.tenant, werr)
		}
	}()
	for range sagaBatchSize {
		g.s.mu.Lock()
		stop := tq.released || !tq.acquired
		g.s.mu.Unlock()
		if stop {
			return false, nil
		}
		gctx, cancel := context.WithTimeout(ctx, g.s.cfg.OpTimeout)
		m, gerr := g.s.events.GetMsg(gctx, last+1, jetstream.WithGetMsgSubject(schema.TenantEvents(tq.tenant)))
		cancel()
		if errors.Is(gerr, jetstream.ErrMsgNotFound) {
			// The event that woke us may not be stored yet (see wakeWindow): look again soon.
			g.s.mu.Lock()
			recent := time.Since(tq.sagaWokeAt) < wakeWindow
			g.s.mu.Unlock()
			if recent {
				time.AfterFunc(20*time.Millisecond, func() { g.markReady(tq) })
			}
			return false, nil
		}
		if gerr != nil {
			return false, gerr
		}
		var ev ledger.Event
		if json.Unmarshal(m.Data, &ev) == nil {
			ev.Seq = m.Sequence
			for _, sg := range g.s.cfg.Sagas {
				reqs := sg.Step(ev)
				for i := range reqs {
					reqs[i].Key = fmt.Sprintf("%s.saga.%s.%d.%d", tq.tenant, sg.Name(), m.Sequence, i)
					reqs[i].Tenant = tq.tenant
				}
				if len(reqs) == 0 {
					continue
				}
				dctx, cancel := context.WithTimeout(ctx, g.s.cfg.RunTimeout)
				derr := g.s.outbox.deliverAll(dctx, reqs, false)
				cancel()
				if derr != nil && !errors.Is(derr, ErrPermanent) {
					return false, derr // retried from this event; delivered effects are skipped
				}
				if derr != nil {
					g.s.cfg.Logger.Warn("saga effect cannot be delivered; skipped", "tenant", tq.tenant, "saga", sg.Name(), "seq", m.Sequence, "err", derr)
				}
			}
		} else {
			g.s.cfg.Logger.Warn("skipping a corrupt event", "tenant", tq.tenant, "seq", m.Sequence)
		}
		last = m.Sequence
	}
	return true, nil
}

// writeDrainRecord persists what a release left: when, by whom, the runs it had to cancel,
// the outbox entries it flushed and the saga checkpoint.
func (g *sagas) writeDrainRecord(ctx context.Context, tenant string, cancelled, flushed int) error {
	cp, _, err := g.checkpoint(ctx, tenant)
	if err != nil {
		return err
	}
	b, _ := json.Marshal(struct {
		Tenant    string    `json:"tenant"`
		By        string    `json:"by"`
		At        time.Time `json:"at"`
		Cancelled int       `json:"cancelled"`
		Flushed   int       `json:"outbox_flushed"`
		SagaSeq   uint64    `json:"saga_seq"`
	}{tenant, g.s.cfg.ID.Key(), time.Now().UTC(), cancelled, flushed, cp.Seq})
	err = g.s.cfg.whileUnavailable(ctx, func(octx context.Context) error {
		_, err := g.checks.Put(octx, drainKey(tenant), b)
		return err
	}, "writing a drain record", "tenant", tenant)
	if err != nil {
		return fmt.Errorf("runner: drain record of %s: %w", tenant, err)
	}
	return nil
}

func sorted(s []string) []string { slices.Sort(s); return s }
