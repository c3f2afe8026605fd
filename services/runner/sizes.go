package runner

import (
	"context"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// sizer keeps the queue and outbox depth of every tenant the instance acquires, for shardkit's
// Sizes hook (telemetry every heartbeat, /admin/tenants). One subject-filtered info of TM_JOBS
// every SizeEvery counts every tenant's subjects at once, where a read per tenant per heartbeat
// would cost a round trip per tenant per second.
type sizer struct {
	s  *Service
	mu sync.Mutex
	by map[string]schema.TenantSize
}

func newSizer(s *Service) *sizer { return &sizer{s: s, by: map[string]schema.TenantSize{}} }

func (z *sizer) run(ctx context.Context) {
	t := time.NewTicker(z.s.cfg.SizeEvery)
	defer t.Stop()
	for {
		z.refresh(ctx)
		select {
		case <-t.C:
		case <-ctx.Done():
			return
		}
	}
}

// refresh recounts the acquired tenants' queues and outboxes.
func (z *sizer) refresh(ctx context.Context) {
	owned := z.s.Owned()
	if len(owned) == 0 {
		z.mu.Lock()
		clear(z.by)
		z.mu.Unlock()
		return
	}
	ictx, cancel := context.WithTimeout(ctx, 4*z.s.cfg.OpTimeout)
	info, err := z.s.jobs.Info(ictx, jetstream.WithSubjectFilter(schema.SubjectJobsAll))
	cancel()
	if err != nil {
		if ctx.Err() == nil {
			z.s.cfg.Logger.Warn("counting the queues", "err", err)
		}
		return
	}
	by := make(map[string]schema.TenantSize, len(owned))
	for _, t := range owned {
		by[t] = schema.TenantSize{Tenant: t}
	}
	for subj, n := range info.State.Subjects {
		_, rest, _ := strings.Cut(subj, ".") // jobs.<tenant>.<rest>
		tenant, rest, _ := strings.Cut(rest, ".")
		ts, ok := by[tenant]
		if !ok {
			continue
		}
		if rest == "fx" {
			ts.Outbox += int(n)
		} else {
			ts.Queued += int(n)
		}
		by[tenant] = ts
	}
	z.mu.Lock()
	z.by = by
	z.mu.Unlock()
}

// Sizes are the acquired tenants' queue and outbox depth (as of the last count) and due
// schedules. shardkit's Sizes hook.
func (z *sizer) Sizes() []schema.TenantSize {
	due := z.s.sched.dueCounts()
	z.mu.Lock()
	defer z.mu.Unlock()
	out := make([]schema.TenantSize, 0, len(z.by))
	for t, ts := range z.by {
		ts.Due = due[t]
		out = append(out, ts)
	}
	return out
}
