package test

import (
	"os"
	"strconv"
	"testing"
	"time"
)

// clusterStarts is how many fresh-cluster starts TestFreshClusterStarts makes: 2 in make test,
// TM_CLUSTER_STARTS (make e2e: 20).
func clusterStarts() int {
	if n, err := strconv.Atoi(os.Getenv("TM_CLUSTER_STARTS")); err == nil && n > 0 {
		return n
	}
	return 2
}

// The whole stack starts on a new 3-node NATS cluster, every time: processes that come up
// while the cluster still forms and places the platform's streams wait for it instead of
// exiting. startStack tries again only when a port it picked was taken meanwhile. The last
// start is ended by killing devstack: no process of the stack may outlive it.
func TestFreshClusterStarts(t *testing.T) {
	if testing.Short() {
		t.Skip("starts the whole platform on a new cluster")
	}
	n := clusterStarts()
	var took []time.Duration
	for i := range n {
		start := time.Now()
		s := startStack(t, "--nats-cluster", "--instances", "2")
		took = append(took, time.Since(start))
		if i == n-1 {
			s.kill(t) // the last start ends as a crash would: its children stop with it
		} else {
			s.stop(t)
		}
		t.Logf("start %d of %d on a fresh cluster: ready in %s", i+1, n, took[i].Round(100*time.Millisecond))
	}
	t.Logf("%d of %d fresh-cluster starts succeeded; ready p50 %s max %s", n, n, pct(took, 0.5).Round(100*time.Millisecond), pct(took, 1).Round(100*time.Millisecond))
}
