package autopilot

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
)

// The balance detector acts on max/mean above the trigger once it held for Sustain, and on
// max/mean above the tolerance (under the trigger) only once it held for Settle; within the
// tolerance, never.
func TestBalanceTriggersAndSettles(t *testing.T) {
	clock := time.Unix(1_000_000, 0)
	a := &Autopilot{cfg: Config{Sustain: time.Minute, Settle: 4 * time.Minute}.withDefaults(), since: map[string]time.Time{},
		now: func() time.Time { return clock }}
	a.m = newMetrics(prometheus.NewRegistry(), a)
	world := func(hot float64) planner.World { // two shards of capacity 100; max/mean = 2*hot/(hot+100)
		return planner.World{Kind: "aggregate", Shards: []planner.Shard{{Name: "s-1", Capacity: 100}, {Name: "s-2", Capacity: 100}},
			Tenants: []planner.Tenant{{ID: "a", Shard: "s-1", Load: hot}, {ID: "b", Shard: "s-2", Load: 100}}}
	}
	for _, tc := range []struct {
		name      string
		hot       float64 // max/mean 1.05, 1.15, 1.33
		wait      time.Duration
		threshold string // "": no plan
	}{
		{"within the tolerance", 110.5, 10 * time.Minute, ""},
		{"above the tolerance, before Settle", 135.3, 3 * time.Minute, ""},
		{"above the tolerance, after Settle", 135.3, 4 * time.Minute, "max/mean > 1.10 for 4m0s"},
		{"above the trigger, before Sustain", 200, 30 * time.Second, ""},
		{"above the trigger, after Sustain", 200, time.Minute, "max/mean > 1.25 for 1m0s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clear(a.since)
			if c := a.balance(world(tc.hot)); c != nil {
				t.Fatalf("a plan at once: %+v", c.trigger)
			}
			clock = clock.Add(tc.wait)
			c := a.balance(world(tc.hot))
			switch {
			case tc.threshold == "" && c != nil:
				t.Fatalf("a plan after %s: %+v", tc.wait, c.trigger)
			case tc.threshold != "" && (c == nil || !strings.HasPrefix(c.trigger.Threshold, tc.threshold)):
				t.Fatalf("after %s: %+v, want a plan for %q", tc.wait, c, tc.threshold)
			}
		})
	}
}
