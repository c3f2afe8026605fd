package shardkit

import (
	"fmt"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// Per-tenant request labels stay bounded: the N busiest tenants since the last recomputation
// get their own series, everyone else counts as "other", and tenants that drop out lose theirs.
func TestTopNLabelsAreBounded(t *testing.T) {
	reg := prometheus.NewRegistry()
	s := &Shard{}
	m := newMetrics(reg, s)
	sm := newStateMap(m.seriesFor)
	var states []*tenantState
	for i := range 30 {
		ts := sm.getOrCreate(fmt.Sprintf("t%02d", i))
		ts.requests.Store(uint64(i)) // t29 busiest
		states = append(states, ts)
	}
	m.setTop(states, 5)
	for _, ts := range states {
		ts.labels.Load().requests[1].Inc()
	}
	labels := tenantLabels(t, reg)
	if len(labels) != 6 || labels["other"] != 25 {
		t.Fatalf("labels after the first ranking: %v", labels)
	}
	for _, want := range []string{"t25", "t26", "t27", "t28", "t29"} {
		if labels[want] != 1 {
			t.Fatalf("%s not labelled: %v", want, labels)
		}
	}
	// Now only t00 and t01 are busy: the old top drops out.
	states[0].requests.Add(100)
	states[1].requests.Add(50)
	m.setTop(states, 5)
	labels = tenantLabels(t, reg)
	_, has00 := labels["t00"]
	_, has01 := labels["t01"]
	if len(labels) != 3 || !has00 || !has01 || labels["other"] != 25 {
		t.Fatalf("labels after the second ranking (want t00, t01, other): %v", labels)
	}
}

// tenantLabels sums tm_shard_requests_total by tenant label.
func tenantLabels(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "tm_shard_requests_total" {
			continue
		}
		for _, mt := range mf.GetMetric() {
			for _, l := range mt.GetLabel() {
				if l.GetName() == "tenant" {
					out[l.GetValue()] += mt.GetCounter().GetValue()
				}
			}
		}
	}
	return out
}
