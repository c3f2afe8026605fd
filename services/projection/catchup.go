package projection

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/backoff"
	"github.com/tenantmesh/tenantmesh/services/ledger"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// catchUpLoop runs catch-ups: it takes up to CatchUpBatch queued tenants at a time, loads
// their stored views, replays their later events (with one consumer filtering all of them when
// they are near the stream's end, else one consumer each) and hands them to the tail
// consumers. A failed batch is retried.
func (s *Service) catchUpLoop(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.cwake:
		}
		for {
			batch, more := s.takeCatchUps()
			if len(batch) == 0 {
				break
			}
			if more {
				s.wakeCatchUp() // another worker takes the next batch meanwhile
			}
			s.catchUpBatch(ctx, batch)
			if ctx.Err() != nil {
				return
			}
		}
	}
}

func (s *Service) takeCatchUps() (batch []*tenantState, more bool) {
	s.cmu.Lock()
	defer s.cmu.Unlock()
	n := min(len(s.cq), s.cfg.CatchUpBatch)
	batch = slices.Clone(s.cq[:n])
	s.cq = slices.Delete(s.cq, 0, n)
	return batch, len(s.cq) > 0
}

func (s *Service) queueCatchUp(ts *tenantState) {
	s.cmu.Lock()
	s.cq = append(s.cq, ts)
	s.cmu.Unlock()
	s.wakeCatchUp()
}

func (s *Service) wakeCatchUp() {
	select {
	case s.cwake <- struct{}{}:
	default:
	}
}

func (s *Service) catchUpBatch(ctx context.Context, batch []*tenantState) {
	pauses := backoff.Policy{Initial: 500 * time.Millisecond, Max: 5 * time.Second}.Pauses()
	for attempt := 0; ; attempt++ {
		live := batch[:0]
		for _, ts := range batch {
			if ts.dropped() {
				continue
			}
			live = append(live, ts)
		}
		batch = live
		if len(batch) == 0 {
			return
		}
		start := time.Now()
		covered, n, err := s.catchUpOnce(ctx, batch, attempt == 0)
		if err == nil {
			s.m.catchUps.Observe(time.Since(start).Seconds())
			s.cfg.Logger.Debug("tenants caught up", "tenants", len(batch), "replayed", n, "took", time.Since(start))
			for _, ts := range batch {
				close(ts.caught)
				s.tailOf(ts.tenant).join(ts, covered)
				ts.mu.RLock()
				due := ts.since >= s.cfg.CheckpointEvery
				ts.mu.RUnlock()
				if due { // a long replay: store its result
					s.queueFlush(ts.tenant)
				}
			}
			return
		}
		for _, ts := range batch {
			ts.mu.Lock()
			ts.err = err
			ts.mu.Unlock()
		}
		if ctx.Err() != nil {
			return
		}
		s.cfg.Logger.Warn("catch-up failed; retrying", "tenants", len(batch), "attempt", attempt+1, "err", err)
		if !pauses.Wait(ctx) {
			return
		}
	}
}

func (s *Service) catchUpOnce(ctx context.Context, batch []*tenantState, first bool) (covered uint64, n int, err error) {
	byName := make(map[string]*tenantState, len(batch))
	filters := make([]string, 0, len(batch))
	var after uint64
	for i, ts := range batch {
		if first {
			snap, err := s.st.load(ctx, ts.tenant)
			if err != nil {
				s.cfg.Logger.Warn("stored views unusable; replaying from the start", "tenant", ts.tenant, "err", err)
			} else if snap != nil {
				ts.restore(snap)
			}
		}
		byName[ts.tenant] = ts
		filters = append(filters, schema.TenantEvents(ts.tenant))
		if a := ts.appliedSeq(); i == 0 || a < after {
			after = a
		}
	}
	var info *jetstream.StreamInfo
	err = s.st.jsc.ReadTries(ctx, func(ctx context.Context) (err error) {
		info, err = s.st.stream.Info(ctx)
		return err
	})
	if err != nil {
		return 0, 0, fmt.Errorf("projection: read %s state: %w", schema.StreamEvents, err)
	}
	covered = info.State.LastSeq
	n, err = s.replayInto(ctx, filters, after, covered, s.cfg.FilterBacklog, byName)
	if !errors.Is(err, errTooFar) {
		return covered, n, err
	}
	// Far behind: one consumer per tenant, each served from the subject index.
	for _, ts := range batch {
		m, err := s.replayInto(ctx, []string{schema.TenantEvents(ts.tenant)}, ts.appliedSeq(), covered, 0, byName)
		n += m
		if err != nil {
			return covered, n, err
		}
	}
	return covered, n, nil
}

// replayInto replays filters into the tenants of byName.
func (s *Service) replayInto(ctx context.Context, filters []string, after, until uint64, maxPending int, byName map[string]*tenantState) (int, error) {
	return s.st.replay(ctx, filters, after, until, maxPending, func(subject string, ev ledger.Event, derr error) error {
		ts := byName[tenantOfSubject(subject)]
		if ts == nil {
			return nil
		}
		ts.mu.Lock()
		defer ts.mu.Unlock()
		if ts.phase == phaseDropped || ev.Seq <= ts.applied || ts.refused != nil {
			return nil
		}
		if errors.Is(derr, jsx.ErrNewerFormat) {
			s.refuse(ts, derr)
			return nil
		}
		if derr != nil {
			ts.advance(ev.Seq)
			s.corrupt(ts.tenant, derr)
			return nil
		}
		ts.apply(ev)
		s.m.applied.Inc()
		return nil
	})
}

func (ts *tenantState) dropped() bool {
	ts.mu.RLock()
	defer ts.mu.RUnlock()
	return ts.phase == phaseDropped
}
