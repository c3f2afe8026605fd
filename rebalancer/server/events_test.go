package server

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/rebalancer/sweeper"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// The live event stream carries the runners' job events (the multi-host design's WebSocket
// job.created and job_run.done), as a runner instance publishes them.
func TestEventStreamCarriesJobEvents(t *testing.T) {
	srv := natstest.Server(t)
	st := openStore(t, srv.URL())
	r := start(t, st, "r1", sweeper.Config{})
	events := sse(t, r.ts.URL)
	r.await(t, "leadership", leading)
	for _, ev := range []schema.JobEvent{
		{Event: schema.JobCreated, Kind: "runner", Tenant: "acme", Job: "j1", Type: "webhook", Status: "pending"},
		{Event: schema.JobRunDone, Kind: "runner", Tenant: "acme", Job: "j1", Type: "webhook", RanOn: "runner.runner-1.a", Status: "succeeded", Attempts: 1},
	} {
		if err := st.PublishJobEvent(ev); err != nil {
			t.Fatal(err)
		}
		got := awaitSSE(t, events, ev.Event)
		var dec schema.JobEvent
		if err := json.Unmarshal(got.Data, &dec); err != nil || dec.Job != "j1" || dec.Status != ev.Status || dec.Tenant != "acme" {
			t.Fatalf("%s on the stream: %s (%v)", ev.Event, got.Data, err)
		}
	}
}

// awaitSSE reads the stream until an event of type typ.
func awaitSSE(t *testing.T, events <-chan Event, typ string) Event {
	t.Helper()
	deadline := time.After(20 * time.Second)
	for {
		select {
		case ev := <-events:
			if ev.Type == typ {
				return ev
			}
		case <-deadline:
			t.Fatalf("no %s event on the stream", typ)
		}
	}
}
