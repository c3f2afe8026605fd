package rebalancer

import (
	"fmt"
	"slices"
	"strings"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// InstanceFilter narrows the directory listing (the multi-host design's host list: "filter by
// status or labels"): instances whose derived status is one of Statuses (none: any) and that
// carry every label of Labels.
type InstanceFilter struct {
	Statuses []schema.Status
	Labels   map[string]string
}

// ParseStatuses reads a comma-separated list of statuses (online, degraded, draining, offline).
func ParseStatuses(s string) ([]schema.Status, error) {
	var out []schema.Status
	for part := range strings.SplitSeq(s, ",") {
		st := schema.Status(strings.TrimSpace(part))
		switch st {
		case schema.StatusOnline, schema.StatusDegraded, schema.StatusDraining, schema.StatusOffline:
			out = append(out, st)
		case "":
		default:
			return nil, fmt.Errorf("status %q is not one of online, degraded, draining, offline", st)
		}
	}
	return out, nil
}

// ParseLabels reads labels given as key=value, each argument one or more joined by commas.
func ParseLabels(args []string) (map[string]string, error) {
	out := map[string]string{}
	for _, a := range args {
		for kv := range strings.SplitSeq(a, ",") {
			k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
			if !ok || k == "" {
				return nil, fmt.Errorf("label %q: want key=value", kv)
			}
			out[k] = v
		}
	}
	return out, nil
}

// Match reports whether v passes the filter.
func (f InstanceFilter) Match(v InstanceView) bool {
	if len(f.Statuses) > 0 && !slices.Contains(f.Statuses, v.Status) {
		return false
	}
	for k, want := range f.Labels {
		if got, ok := v.Labels[k]; !ok || got != want {
			return false
		}
	}
	return true
}

// Filter keeps the views that pass f, in order.
func (f InstanceFilter) Filter(views []InstanceView) []InstanceView {
	out := make([]InstanceView, 0, len(views))
	for _, v := range views {
		if f.Match(v) {
			out = append(out, v)
		}
	}
	return out
}
