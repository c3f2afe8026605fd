package runner

import (
	"sync"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// recentRuns is a bounded ring of the instance's newest job runs (claimed or finished), which
// its load reports carry to the rebalancer's instance view.
type recentRuns struct {
	mu   sync.Mutex
	buf  [schema.MaxReportRuns]schema.RunSummary
	next int
	n    int
}

// note records r's current state; a run already in the ring is updated in place.
func (rr *recentRuns) note(r *Run) {
	sum := schema.RunSummary{ID: r.ID, Tenant: r.Tenant, Type: r.Type, Status: string(r.Status), Attempts: r.Attempts,
		Started: r.StartedAt, Finished: r.FinishedAt, Error: truncateError(r.Error)}
	rr.mu.Lock()
	defer rr.mu.Unlock()
	for i := range rr.n {
		j := (rr.next - 1 - i + len(rr.buf)) % len(rr.buf)
		if rr.buf[j].ID == r.ID && rr.buf[j].Tenant == r.Tenant {
			rr.buf[j] = sum
			return
		}
	}
	rr.buf[rr.next] = sum
	rr.next = (rr.next + 1) % len(rr.buf)
	rr.n = min(rr.n+1, len(rr.buf))
}

// report puts the runs, newest first, in a load report (shardkit Hooks.Report).
func (rr *recentRuns) report(lr *schema.LoadReport) {
	rr.mu.Lock()
	defer rr.mu.Unlock()
	lr.Runs = make([]schema.RunSummary, 0, rr.n)
	for i := range rr.n {
		lr.Runs = append(lr.Runs, rr.buf[(rr.next-1-i+len(rr.buf))%len(rr.buf)])
	}
}

func truncateError(s string) string {
	if len(s) > 200 {
		return s[:200] + "…"
	}
	return s
}

// announce publishes a job event for the live event stream (the multi-host design's job.created
// and job_run.done): core NATS, so a lost one costs nothing but the event.
func (s *Service) announce(event string, r *Run) {
	ev := schema.JobEvent{Event: event, Kind: s.cfg.ID.Kind, Tenant: r.Tenant, Job: r.ID, Type: r.Type, Instance: r.Instance,
		RanOn: r.RanOn, Status: string(r.Status), Attempts: r.Attempts, Error: truncateError(r.Error)}
	if event == schema.JobCreated {
		ev.RanOn = ""
	}
	if err := s.st.PublishJobEvent(ev); err != nil {
		s.cfg.Logger.Debug("publishing a job event", "event", event, "tenant", r.Tenant, "job", r.ID, "err", err)
	}
}
