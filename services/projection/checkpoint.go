package projection

import (
	"context"
	"sync"
	"time"
)

// flush stores the tenant's views if they changed since they were last stored: the head and
// the pages of transactions that became full since (stored.go).
func (s *Service) flush(ctx context.Context, ts *tenantState) error {
	ts.mu.RLock()
	if ts.applied == ts.flushed {
		ts.mu.RUnlock()
		return nil
	}
	snap, prev := ts.views(), ts.stored
	ts.mu.RUnlock()
	next, wrote, err := s.st.save(ctx, snap, prev)
	if err != nil {
		s.cfg.Logger.Warn("storing views failed", "tenant", ts.tenant, "err", err)
		return err
	}
	ts.mu.Lock()
	if snap.Applied > ts.flushed {
		ts.flushed = snap.Applied
	}
	if len(next.pages) >= len(ts.stored.pages) {
		ts.stored = next
	}
	ts.since = 0
	ts.mu.Unlock()
	ts.viewBytes.Store(uint64(next.size()))
	s.m.flushes.Inc()
	s.m.flushBytes.Observe(float64(wrote))
	return nil
}

func (s *Service) queueFlush(tenant string) {
	s.fmu.Lock()
	s.flushq[tenant] = true
	s.fmu.Unlock()
	select {
	case s.fwake <- struct{}{}:
	default:
	}
}

// flushLoop stores views queued by the tail (every CheckpointEvery events) and, on a timer, of
// every changed tenant.
func (s *Service) flushLoop(ctx context.Context) {
	tick := time.NewTicker(s.cfg.CheckpointInterval)
	defer tick.Stop()
	for {
		var due []*tenantState
		select {
		case <-ctx.Done():
			return
		case <-s.fwake:
			s.fmu.Lock()
			q := s.flushq
			s.flushq = map[string]bool{}
			s.fmu.Unlock()
			for t := range q {
				if ts := s.lookup(t); ts != nil {
					due = append(due, ts)
				}
			}
		case <-tick.C:
			due = s.hosted()
		}
		s.flushAll(ctx, due)
	}
}

// flushAll stores the views of due, a few tenants at a time.
func (s *Service) flushAll(ctx context.Context, due []*tenantState) {
	work := make(chan *tenantState)
	var wg sync.WaitGroup
	for range min(len(due), flushWorkers) {
		wg.Go(func() {
			for ts := range work {
				fctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				_ = s.flush(fctx, ts)
				cancel()
			}
		})
	}
	for _, ts := range due {
		work <- ts
	}
	close(work)
	wg.Wait()
}

// flushWorkers bounds concurrent view stores.
const flushWorkers = 16
