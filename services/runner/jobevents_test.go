package runner

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// A runner announces each job it creates and each attempt it finishes (the multi-host design's
// job.created and job_run.done), for the rebalancer's live event stream: a job that fails once
// and then succeeds shows job.created, job_run.done pending (its retry), job_run.done succeeded.
func TestJobEventsAnnounced(t *testing.T) {
	st := openStore(t)
	events := make(chan schema.JobEvent, 16)
	sub, err := st.SubscribeJobEvents(func(_ []byte, ev schema.JobEvent) { events <- ev })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	var calls atomic.Int32
	flaky := func(context.Context, Run) (Output, error) {
		if calls.Add(1) == 1 {
			return Output{}, errors.New("first attempt fails")
		}
		return Output{}, nil
	}
	s := startService(t, st, "runner-1", "i1", Config{RetryBackoff: 10 * time.Millisecond, Handlers: map[string]Handler{"flaky": flaky}})
	place(t, st, "acme", "runner-1")
	owning(t, s, "acme", true)
	r, _, err := s.Create(context.Background(), "acme", NewJob{Type: "flaky"})
	if err != nil {
		t.Fatal(err)
	}
	want := []struct{ event, status string }{{schema.JobCreated, "pending"}, {schema.JobRunDone, "pending"}, {schema.JobRunDone, "succeeded"}}
	for i, w := range want {
		select {
		case ev := <-events:
			if ev.Event != w.event || ev.Status != w.status || ev.Job != r.ID || ev.Tenant != "acme" || ev.Kind != Kind || ev.Type != "flaky" {
				t.Fatalf("event %d: %+v, want %s %s of %s", i, ev, w.event, w.status, r.ID)
			}
			if ev.Event == schema.JobRunDone && (ev.RanOn != s.cfg.ID.Instance || ev.Attempts != i) {
				t.Fatalf("event %d: ran on %q, attempts %d", i, ev.RanOn, ev.Attempts)
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("no %s event (%d)", w.event, i)
		}
	}
}

// Per-tenant retries and latency (the Cloudlysis PRD's Runner 4) in the tenant's figures and
// as bounded metrics, and the Lag hook: the tenant's jobs waiting.
func TestTenantRunFiguresAndLag(t *testing.T) {
	st := openStore(t)
	reg := prometheus.NewRegistry()
	var calls atomic.Int32
	flaky := func(context.Context, Run) (Output, error) {
		if calls.Add(1) == 1 {
			return Output{}, errors.New("first attempt fails")
		}
		return Output{}, nil
	}
	s := startService(t, st, "runner-1", "i1", Config{RetryBackoff: 10 * time.Millisecond, SizeEvery: 50 * time.Millisecond,
		Registerer: reg, Handlers: map[string]Handler{"flaky": flaky}})
	place(t, st, "acme", "runner-1")
	owning(t, s, "acme", true)
	ids := create(t, s, "acme", 1, NewJob{Type: "flaky"})
	waitDone(t, s, "acme", ids, 20*time.Second)
	ctx := context.Background()
	var stats TenantStats
	waitUntil(t, 10*time.Second, "the second attempt counted", func() bool {
		var err error
		stats, err = s.Stats(ctx, "acme")
		return err == nil && stats.Runs.Attempts == 2
	})
	if r := stats.Runs; r.Retries != 1 || r.Failed != 0 || r.LatencyP50MS <= 0 || r.LatencyP99MS < r.LatencyP50MS {
		t.Fatalf("acme's run figures: %+v", r)
	}
	if got := counterValue(t, reg, "tm_runner_tenant_retries_total", "acme"); got != 1 {
		t.Fatalf("tm_runner_tenant_retries_total{tenant=acme} = %v", got)
	}
	// The Lag hook reads the figures refreshed every SizeEvery: the finished job leaves them
	// at the next refresh.
	waitUntil(t, 10*time.Second, "the Lag hook to count nothing waiting", func() bool { return s.Lag("acme") == 0 })
	create(t, s, "acme", 3, NewJob{Type: "noop", Delay: "1h"})
	waitUntil(t, 10*time.Second, "the Lag hook to count the 3 waiting jobs", func() bool { return s.Lag("acme") == 3 })
}

// counterValue reads a counter's value for one tenant label from reg.
func counterValue(t *testing.T, reg *prometheus.Registry, name, tenant string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "tenant" && l.GetValue() == tenant {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return -1
}
