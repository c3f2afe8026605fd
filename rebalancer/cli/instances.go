package cli

import (
	"context"
	"io"
	"time"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// InstancesCommand is `rebalance instances`.
type InstancesCommand struct {
	m *Main
	common
	kind                    string
	degradedAfter, offAfter time.Duration
	errorRate               float64
}

const instancesAbout = `Shows the instance directory (the multi-host design's host view): every instance's status (online,
degraded, draining, offline), the age of its last heartbeat, its capacity, last metrics,
version and labels. Statuses are derived now: no heartbeat for --degraded-after is degraded,
for --offline-after offline; an error rate of at least --degraded-error-rate is degraded.`

const instancesExamples = `  rebalance instances
  rebalance instances --kind runner --output json
`

// Run lists the directory.
func (c *InstancesCommand) Run(ctx context.Context, args []string) error {
	fs := c.m.newFlags("instances", "[flags]", instancesAbout, instancesExamples)
	c.register(fs)
	fs.StringVar(&c.kind, "kind", "", "only this kind")
	fs.DurationVar(&c.degradedAfter, "degraded-after", 3*time.Second, "heartbeat age that makes an instance degraded")
	fs.DurationVar(&c.offAfter, "offline-after", 2*time.Minute, "heartbeat age that makes an instance offline")
	fs.Float64Var(&c.errorRate, "degraded-error-rate", 0.5, "error rate that makes an instance degraded (negative: never)")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if err := c.check(); err != nil {
		return err
	}
	if len(pos) > 0 {
		return usagef("instances takes no arguments")
	}
	st, closeFn, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer closeFn()
	h := rebalancer.Health{Thresholds: schema.Thresholds{DegradedAfter: c.degradedAfter, OfflineAfter: c.offAfter}, DegradedErrorRate: c.errorRate}
	views, err := rebalancer.Instances(ctx, st, c.kind, h, c.m.Now())
	if err != nil {
		return err
	}
	return c.emit(c.m.Stdout, views, func(w io.Writer) error { return renderInstances(w, views) })
}
