package rebalancer

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Health derives an instance's status for operators (the multi-host design's host view): the directory's
// heartbeat rule (schema.Thresholds), and degraded when the instance's last reported error
// rate is at least DegradedErrorRate. The zero value uses the defaults.
type Health struct {
	Thresholds schema.Thresholds
	// DegradedErrorRate marks a live instance degraded when its error rate (errors/requests
	// over its last interval) reaches it. Default 0.5; negative disables the rule.
	DegradedErrorRate float64
}

// Status is i's status at now.
func (h Health) Status(i schema.Instance, now time.Time) schema.Status {
	st := h.Thresholds.Status(i, now)
	limit := h.DegradedErrorRate
	if limit == 0 {
		limit = 0.5
	}
	if st == schema.StatusOnline && limit > 0 && i.Metrics != nil && i.Metrics.ErrorRate >= limit {
		return schema.StatusDegraded
	}
	return st
}

// InstanceView is one directory entry as the CLI and the API show it.
type InstanceView struct {
	schema.Instance
	Key    string        `json:"key"`
	Status schema.Status `json:"derived_status"`
	// HeartbeatAge is the time since the directory entry was written, in seconds (on an instance's
	// page: since its last load report when that is newer, the heartbeat between directory writes).
	HeartbeatAge float64 `json:"heartbeat_age_seconds"`
}

// Instances lists the directory of kind ("" all) with derived statuses, sorted by key.
func Instances(ctx context.Context, st *schema.Store, kind string, h Health, now time.Time) ([]InstanceView, error) {
	insts, err := st.Directory().Instances(ctx, kind)
	if err != nil {
		return nil, err
	}
	out := make([]InstanceView, 0, len(insts))
	for _, i := range insts {
		out = append(out, InstanceView{Instance: i, Key: i.Key(), Status: h.Status(i, now), HeartbeatAge: now.Sub(i.Heartbeat).Seconds()})
	}
	slices.SortFunc(out, func(a, b InstanceView) int { return strings.Compare(a.Key, b.Key) })
	return out, nil
}

// PlanSummary is a plan record with its moves counted by state.
type PlanSummary struct {
	PlanRecord
	Moves map[MoveState]int `json:"move_states"`
}

// Count is the number of moves in state s.
func (p PlanSummary) Count(s MoveState) int { return p.Moves[s] }

// Summaries lists plans newest first with their move counts, at most limit (0: all).
func (e *Engine) Summaries(ctx context.Context, limit int) ([]PlanSummary, error) {
	recs, err := e.Plans(ctx)
	if err != nil {
		return nil, err
	}
	if limit > 0 && len(recs) > limit {
		recs = recs[:limit]
	}
	out := make([]PlanSummary, 0, len(recs))
	for _, r := range recs {
		_, moves, err := e.Plan(ctx, r.ID)
		if err != nil {
			return nil, err
		}
		out = append(out, Summarize(r, moves))
	}
	return out, nil
}

// Summarize counts moves by state.
func Summarize(r PlanRecord, moves []MoveRecord) PlanSummary {
	s := PlanSummary{PlanRecord: r, Moves: map[MoveState]int{}}
	for _, m := range moves {
		s.Moves[m.State]++
	}
	return s
}

// Lease reads the leader lease (ok false when nobody holds it or it expired).
func Lease(ctx context.Context, st *schema.Store, now time.Time) (jsx.Lease, bool, error) {
	var l jsx.Lease
	rev, err := st.Rebalance().Latest(ctx, schema.LeaderLease, &l)
	if err != nil {
		if errors.Is(err, schema.ErrNotFound) {
			return jsx.Lease{}, false, nil
		}
		return jsx.Lease{}, false, err
	}
	l.Revision = rev
	return l, now.Before(l.Expires), nil
}

// LabelString renders labels as k=v,k=v sorted by key.
func LabelString(l map[string]string) string {
	keys := slices.Sorted(maps.Keys(l))
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + l[k]
	}
	return strings.Join(parts, ",")
}

// ParseSince reads a lower time bound: an RFC 3339 time, or a duration back from now ("1h").
func ParseSince(v string, now time.Time) (time.Time, error) {
	if d, err := time.ParseDuration(v); err == nil {
		return now.Add(-d), nil
	}
	t, err := time.Parse(time.RFC3339, v)
	if err != nil {
		return time.Time{}, fmt.Errorf("since %q: want a duration back from now (30m, 2h) or an RFC 3339 time", v)
	}
	return t, nil
}
