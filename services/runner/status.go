package runner

import (
	"context"
	"encoding/json"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// InstanceStatus is the runner's own view of an instance (the multi-host design's host): its running count
// against its limits, the tenants it acquires and its totals. Each instance writes it to KV
// tm_runner_status every StatusEvery, key <kind>.<shard>.<instance>.
type InstanceStatus struct {
	schema.InstanceID
	At            time.Time         `json:"at"`
	Started       time.Time         `json:"started"`
	Running       int               `json:"running"`
	MaxConcurrent int               `json:"max_concurrent"`
	JobsPerMinute int               `json:"jobs_per_minute,omitempty"`
	TenantPerMin  int               `json:"tenant_jobs_per_minute,omitempty"`
	Tenants       int               `json:"tenants"`
	ReadyTenants  int               `json:"ready_tenants"`
	Labels        map[string]string `json:"labels,omitempty"`
	Totals        Totals            `json:"totals"`
	// Verify tells whether the instance takes digests at a move's fence (its kind verifies
	// moves).
	Verify bool `json:"verify"`
}

// Status returns this instance's runner status now.
func (s *Service) Status() InstanceStatus {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := InstanceStatus{InstanceID: s.cfg.ID, At: time.Now().UTC(), Started: s.started, Running: s.running,
		MaxConcurrent: s.cfg.MaxConcurrent, JobsPerMinute: s.cfg.InstanceJobsPerMinute, TenantPerMin: s.cfg.TenantJobsPerMinute,
		ReadyTenants: len(s.ring), Labels: s.cfg.Labels, Totals: s.totals, Verify: s.verify.Load()}
	for _, tq := range s.tenants {
		if tq.acquired && !tq.released {
			st.Tenants++
		}
	}
	return st
}

// statusBoard writes the instance's runner status to tm_runner_status every StatusEvery, and
// counts the shard's live instances from it for the per-tenant rate split.
type statusBoard struct {
	s      *Service
	status jetstream.KeyValue
}

func (b *statusBoard) loop(ctx context.Context) {
	t := time.NewTicker(b.s.cfg.StatusEvery)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-ctx.Done():
			dctx, cancel := context.WithTimeout(context.Background(), b.s.cfg.OpTimeout)
			_ = b.status.Delete(dctx, b.s.cfg.ID.Key())
			cancel()
			return
		}
		b.write(ctx)
		if b.s.cfg.TenantJobsPerMinute > 0 {
			pctx, cancel := context.WithTimeout(ctx, b.s.cfg.OpTimeout)
			b.s.setSiblings(b.countSiblings(pctx))
			cancel()
		}
	}
}

// write puts the instance's runner status in tm_runner_status.
func (b *statusBoard) write(ctx context.Context) {
	data, _ := json.Marshal(b.s.Status())
	pctx, cancel := context.WithTimeout(ctx, b.s.cfg.OpTimeout)
	defer cancel()
	if _, err := b.status.Put(pctx, b.s.cfg.ID.Key(), data); err != nil && ctx.Err() == nil {
		b.s.cfg.Logger.Debug("writing runner status", "err", err)
	}
}

// countSiblings counts the live instances of this shard (itself included) from their runner
// status: written within the last three StatusEvery (plus a second).
func (b *statusBoard) countSiblings(ctx context.Context) int {
	n := 0
	fresh := time.Now().Add(-3*b.s.cfg.StatusEvery - time.Second)
	_, err := jsx.ListJSON(ctx, b.s.st.JS().Records(b.status), b.s.cfg.ID.Kind+"."+b.s.cfg.ID.Shard+".*", func(_ string, _ uint64, st InstanceStatus) {
		if st.At.After(fresh) {
			n++
		}
	})
	if err != nil {
		return 0
	}
	return n
}

// setSiblings splits the per-tenant rate evenly over the shard's n live instances, so the cap
// holds for the shard, not for each instance (a cap, not a target: an instance that gets
// fewer of a tenant's jobs leaves part of its share unused).
func (s *Service) setSiblings(n int) {
	if n < 1 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if n == s.siblings {
		return
	}
	s.siblings = n
	s.resplits++
	rate := s.tenantRate()
	for _, tq := range s.tenants {
		if tq.rate != nil {
			tq.rate.setRate(rate)
		}
	}
	s.cfg.Logger.Info("per-tenant rate split over the shard's instances", "instances", n, "per_instance_per_minute", rate)
}

// tenantRate is this instance's share of the per-tenant rate. Call with s.mu held (or before
// Run).
func (s *Service) tenantRate() int {
	return max(s.cfg.TenantJobsPerMinute/max(s.siblings, 1), 1)
}

// InstanceView is one runner instance as the multi-host design's host health dashboard shows it: the
// directory entry (status derived from the heartbeat's age, last metrics, labels, version)
// joined with the runner's status (running count, limits, totals).
type InstanceView struct {
	schema.InstanceID
	URL       string                  `json:"url,omitempty"`
	Status    schema.Status           `json:"status"`
	Heartbeat time.Time               `json:"last_heartbeat"`
	Version   string                  `json:"version,omitempty"`
	Labels    map[string]string       `json:"labels,omitempty"`
	Metrics   *schema.InstanceMetrics `json:"last_metrics,omitempty"`
	Running   int                     `json:"running"`
	Runner    *InstanceStatus         `json:"runner,omitempty"`
}

// Instances lists every runner instance in the directory with its runner status. An instance
// whose runner status is missing shows its directory entry only; a runner status without a
// directory entry (an instance not registered, such as in tests) is listed as offline.
func (s *Service) Instances(ctx context.Context) ([]InstanceView, error) {
	dir, err := s.st.Directory().Instances(ctx, Kind)
	if err != nil {
		return nil, err
	}
	statuses := map[string]*InstanceStatus{}
	if _, err := jsx.ListJSON(ctx, s.st.JS().Records(s.board.status), ">", func(k string, _ uint64, st InstanceStatus) {
		statuses[k] = &st
	}); err != nil {
		return nil, err
	}
	now := time.Now()
	var th schema.Thresholds
	out := []InstanceView{}
	for _, i := range dir {
		v := InstanceView{InstanceID: i.InstanceID, URL: i.URL, Status: th.Status(i, now), Heartbeat: i.Heartbeat,
			Version: i.Version, Labels: i.Labels, Metrics: i.Metrics}
		if st := statuses[i.Key()]; st != nil {
			v.Runner, v.Running = st, st.Running
			delete(statuses, i.Key())
		}
		out = append(out, v)
	}
	for _, st := range statuses {
		out = append(out, InstanceView{InstanceID: st.InstanceID, Status: schema.StatusOffline, Heartbeat: st.At,
			Labels: st.Labels, Running: st.Running, Runner: st})
	}
	return out, nil
}
