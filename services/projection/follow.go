package projection

import (
	"context"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// placementChanged runs on the placement watcher's goroutine: it only queues the tenant.
func (s *Service) placementChanged(c placement.Change) {
	s.pmu.Lock()
	s.placed[c.Tenant] = true
	s.pmu.Unlock()
	s.wakeFollow()
}

// Reload checks every hosted tenant against the placement again, dropping those no longer
// placed on (or moving to) this shard. shardkit calls it for POST /admin/reload.
func (s *Service) Reload(context.Context) error {
	if s.cfg.Shard == "" {
		return nil
	}
	hosted := s.Tenants()
	s.pmu.Lock()
	for _, t := range hosted {
		s.placed[t] = true
	}
	s.pmu.Unlock()
	s.wakeFollow()
	return nil
}

func (s *Service) wakeFollow() {
	select {
	case s.pwake <- struct{}{}:
	default:
	}
}

// followPlacement hosts the tenants placed on this shard or moving to it, and drops a tenant
// once a move away from the shard completed (shardkit's Release usually did already), unless it
// was the move's fenced source and shardkit has not released it: move verification holds a
// source whose target's views differ (shardkit releases it once an operator says so).
func (s *Service) followPlacement(ctx context.Context, w *placement.Watcher) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.pwake:
		}
		s.pmu.Lock()
		q := s.placed
		s.placed = map[string]bool{}
		s.pmu.Unlock()
		for tenant := range q {
			e, ok := w.Lookup(Kind, tenant)
			switch {
			case ok && (e.Shard == s.cfg.Shard || e.Target == s.cfg.Shard):
				s.host(tenant)
			case !ok || e.Phase == schema.PhaseActive:
				if ts := s.lookup(tenant); ts != nil && !ts.heldAsSource() {
					rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
					_ = s.Release(rctx, tenant)
					cancel()
				}
			}
		}
		s.m.passes.Inc()
	}
}
