package runner

import (
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// The instance's load reports carry its recent runs (shardkit Hooks.Report), newest first, for
// the rebalancer's instance view (the multi-host design's recent job runs of a host).
func TestRecentRunsInLoadReport(t *testing.T) {
	st := openStore(t)
	rc := newReceiver(t)
	place(t, st, "acme", "runner-1")
	s := startService(t, st, "runner-1", "a", Config{})
	srv := serve(t, s)
	owning(t, s, "acme", true)
	var ids []string
	for i := range 2 {
		body, _ := json.Marshal(hookJob(rc.URL, map[string]int{"n": i}))
		resp, p := call(t, srv, "POST", "/jobs", "acme", string(body))
		if resp.StatusCode != http.StatusAccepted {
			t.Fatalf("create: %d %v", resp.StatusCode, p)
		}
		ids = append(ids, p["id"].(string))
		waitDone(t, s, "acme", ids[i:], 10*time.Second)
	}
	var lr schema.LoadReport
	waitUntil(t, 10*time.Second, "both runs reported finished", func() bool {
		lr = schema.LoadReport{}
		s.Hooks().Report(&lr)
		return len(lr.Runs) == 2 && lr.Runs[0].Finished != nil && lr.Runs[1].Finished != nil
	})
	if lr.Runs[0].ID != ids[1] || lr.Runs[1].ID != ids[0] || lr.Runs[0].Status != string(StatusSucceeded) || lr.Runs[0].Tenant != "acme" {
		t.Fatalf("runs %+v, want %v newest first, succeeded", lr.Runs, ids)
	}
}
