package runner

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// TenantStats are one tenant's figures for placement decisions (the Cloudlysis PRD Runner 4): queue and
// outbox depth, and how far its sagas are behind its events. Per-tenant figures are served
// here, per request, rather than as metric labels.
type TenantStats struct {
	Tenant string `json:"tenant"`
	// Queued is the tenant's unfinished jobs (waiting, delayed for a retry, running).
	Queued int `json:"queued"`
	// Outbox is the effects recorded and not delivered yet.
	Outbox int `json:"outbox"`
	// SagaCheckpoint is the last event the sagas handled; LastEvent the tenant's newest event.
	// SagaBehind is true while the sagas have events to handle.
	SagaCheckpoint uint64 `json:"saga_checkpoint"`
	LastEvent      uint64 `json:"last_event"`
	SagaBehind     bool   `json:"saga_behind"`
	// Acquired tells whether this instance acquires the tenant's jobs now; Running how many of
	// them it runs.
	Acquired bool `json:"acquired"`
	Running  int  `json:"running"`
	// Schedules is the tenant's recurring schedules; Due how many of them have a due time that
	// came and whose job is not created yet (the Cloudlysis PRD's "schedule due items");
	// NextDue the soonest due time.
	Schedules int        `json:"schedules"`
	Due       int        `json:"due"`
	NextDue   *time.Time `json:"next_due,omitempty"`
	// Runs are this instance's attempts of the tenant's jobs since it started: retries,
	// failures and the latency of the recent ones (the Cloudlysis PRD's "work processing
	// latency and retries by tenant").
	Runs RunFigures `json:"runs"`
}

// Stats reads a tenant's figures.
func (s *Service) Stats(ctx context.Context, tenant string) (TenantStats, error) {
	if err := schema.CheckTenant(tenant); err != nil {
		return TenantStats{}, err
	}
	st := TenantStats{Tenant: tenant}
	info, err := s.jobs.Info(ctx, jetstream.WithSubjectFilter(schema.TenantJobs(tenant)))
	if err != nil {
		return TenantStats{}, fmt.Errorf("runner: queue of %s: %w", tenant, err)
	}
	fx := outboxSubject(tenant)
	for subj, n := range info.State.Subjects {
		if subj == fx {
			st.Outbox += int(n)
		} else {
			st.Queued += int(n)
		}
	}
	if st.SagaCheckpoint, err = s.Checkpoint(ctx, tenant); err != nil {
		return TenantStats{}, err
	}
	m, err := s.events.GetLastMsgForSubject(ctx, schema.TenantEvents(tenant))
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
	case err != nil:
		return TenantStats{}, fmt.Errorf("runner: last event of %s: %w", tenant, err)
	default:
		st.LastEvent = m.Sequence
	}
	st.SagaBehind = len(s.cfg.Sagas) > 0 && st.LastEvent > st.SagaCheckpoint
	schs, err := s.sched.List(ctx, tenant)
	if err != nil {
		return TenantStats{}, err
	}
	now := s.sched.now()
	for _, sch := range schs {
		st.Schedules++
		if !sch.Next.After(now) {
			st.Due++
		}
		if st.NextDue == nil || sch.Next.Before(*st.NextDue) {
			next := sch.Next
			st.NextDue = &next
		}
	}
	s.mu.Lock()
	if tq := s.tenants[tenant]; tq != nil {
		st.Acquired, st.Running = tq.acquired && !tq.released, tq.inflight
	}
	s.mu.Unlock()
	st.Runs = s.runs.figures(tenant)
	return st, nil
}

func (a *api) handleTenant(w http.ResponseWriter, r *http.Request) {
	tenant := r.URL.Query().Get("tenant_id")
	ctx, cancel := context.WithTimeout(r.Context(), a.s.cfg.OpTimeout)
	defer cancel()
	st, err := a.s.Stats(ctx, tenant)
	if err != nil {
		writeErr(w, r, err, tenant)
		return
	}
	tmhttp.WriteJSON(w, http.StatusOK, st)
}
