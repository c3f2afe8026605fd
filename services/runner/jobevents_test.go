package runner

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

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
