package runner

import (
	"context"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// The instance view joins the directory entry (status, last metrics, labels) with the
// runner's running count and limits: the multi-host design's host dashboard.
func TestInstanceView(t *testing.T) {
	st := openStore(t)
	release := make(chan struct{})
	hold := func(ctx context.Context, r Run) (Output, error) {
		select {
		case <-release:
		case <-ctx.Done():
		}
		return Output{}, nil
	}
	id := schema.InstanceID{Kind: Kind, Shard: "runner-1", Instance: "a"}
	// shardkit registers and heartbeats the instance; here the test does.
	if _, err := st.Directory().Register(context.Background(), schema.Instance{InstanceID: id, URL: "http://127.0.0.1:1", Capacity: 100,
		Labels: map[string]string{"region": "eu"}, Metrics: &schema.InstanceMetrics{InFlight: 1, CPU: 12}}); err != nil {
		t.Fatal(err)
	}
	place(t, st, "acme", "runner-1")
	s := startService(t, st, "runner-1", "a", Config{MaxConcurrent: 3, InstanceJobsPerMinute: 600, StatusEvery: 20 * time.Millisecond,
		Labels: map[string]string{"region": "eu"}, Handlers: map[string]Handler{"hold": hold}})
	owning(t, s, "acme", true)
	ids := create(t, s, "acme", 5, NewJob{Type: "hold"})
	var view InstanceView
	waitUntil(t, 10*time.Second, "the view to show 3 running", func() bool {
		vs, err := s.Instances(context.Background())
		if err != nil || len(vs) != 1 {
			return false
		}
		view = vs[0]
		return view.Running == 3
	})
	if !view.Status.Live() || view.Labels["region"] != "eu" || view.Metrics == nil || view.Metrics.CPU != 12 ||
		view.Runner == nil || view.Runner.MaxConcurrent != 3 || view.Runner.JobsPerMinute != 600 || view.Runner.Tenants != 1 {
		t.Fatalf("view %+v (runner %+v)", view, view.Runner)
	}
	close(release)
	waitDone(t, s, "acme", ids, 10*time.Second)
}
