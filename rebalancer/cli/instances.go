package cli

import (
	"context"
	"io"
	"time"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// InstancesCommand is `rebalance instances [<key>]`.
type InstancesCommand struct {
	m *Main
	common
	kind                    string
	status                  string
	labels                  labelsFlag
	degradedAfter, offAfter time.Duration
	errorRate               float64
	degrade                 string
	undegrade               bool
	listen                  time.Duration
}

const instancesAbout = `Shows the instance directory (the multi-host design's host view): every instance's status (online,
degraded, draining, offline), the age of its last heartbeat, its capacity, last metrics (CPU,
memory, disk), version and labels; --status and --label keep the instances in those statuses
and with those labels. Statuses are derived now: no heartbeat for --degraded-after is degraded,
for --offline-after offline; an error rate of at least --degraded-error-rate is degraded, and so
is an instance an operator flagged.

With a key (<kind>.<shard>.<instance>), shows that instance's page: its fields, the tenants of
its shard, its recent job runs and circuit in each gateway (both heard from telemetry for
--listen), and its status history. --degrade REASON flags it degraded by hand (gateways and
planners treat it like any degraded instance; heartbeats keep the flag); --undegrade clears it.`

const instancesExamples = `  rebalance instances
  rebalance instances --kind runner --output json
  rebalance instances --status degraded,offline --label region=eu
  rebalance instances runner.runner-1.runner-1-0
  rebalance instances runner.runner-1.runner-1-0 --degrade "disk replacement"
  rebalance instances runner.runner-1.runner-1-0 --undegrade
`

// Run lists the directory, or shows or flags one instance.
func (c *InstancesCommand) Run(ctx context.Context, args []string) error {
	fs := c.m.newFlags("instances", "[<key>] [flags]", instancesAbout, instancesExamples)
	c.register(fs)
	fs.StringVar(&c.kind, "kind", "", "only this kind")
	fs.StringVar(&c.status, "status", "", "only instances in these statuses: online, degraded, draining, offline (comma-separated)")
	fs.Var(&c.labels, "label", "only instances carrying these labels, k=v[,k=v] (repeatable)")
	fs.DurationVar(&c.degradedAfter, "degraded-after", 3*time.Second, "heartbeat age that makes an instance degraded")
	fs.DurationVar(&c.offAfter, "offline-after", 2*time.Minute, "heartbeat age that makes an instance offline")
	fs.Float64Var(&c.errorRate, "degraded-error-rate", 0.5, "error rate that makes an instance degraded (negative: never)")
	fs.StringVar(&c.degrade, "degrade", "", "with a key: flag the instance degraded, for this reason")
	fs.BoolVar(&c.undegrade, "undegrade", false, "with a key: clear the instance's degraded flag")
	fs.DurationVar(&c.listen, "listen", 3*time.Second, "with a key: how long to hear telemetry (recent runs, circuits)")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if err := c.check(); err != nil {
		return err
	}
	switch {
	case len(pos) > 1:
		return usagef("instances takes at most one instance key")
	case len(pos) == 0 && (c.degrade != "" || c.undegrade):
		return usagef("--degrade and --undegrade need an instance key")
	case c.degrade != "" && c.undegrade:
		return usagef("--degrade and --undegrade exclude each other")
	}
	st, closeFn, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer closeFn()
	h := rebalancer.Health{Thresholds: schema.Thresholds{DegradedAfter: c.degradedAfter, OfflineAfter: c.offAfter}, DegradedErrorRate: c.errorRate}
	if len(pos) == 1 {
		return c.one(ctx, st, pos[0], h)
	}
	statuses, err := rebalancer.ParseStatuses(c.status)
	if err != nil {
		return usagef("--status: %v", err)
	}
	views, err := rebalancer.Instances(ctx, st, c.kind, h, c.m.Now())
	if err != nil {
		return err
	}
	views = rebalancer.InstanceFilter{Statuses: statuses, Labels: c.labels.m}.Filter(views)
	return c.emit(c.m.Stdout, views, func(w io.Writer) error { return renderInstances(w, views) })
}

// one flags, or shows, one instance.
func (c *InstancesCommand) one(ctx context.Context, st *schema.Store, key string, h rebalancer.Health) error {
	if c.degrade != "" || c.undegrade {
		inst, err := rebalancer.SetDegraded(ctx, st, key, c.degrade != "", c.degrade, actor())
		if err != nil {
			return err
		}
		now := c.m.Now()
		v := rebalancer.InstanceView{Instance: inst, Key: inst.Key(), Status: h.Status(inst, now), HeartbeatAge: now.Sub(inst.Heartbeat).Seconds()}
		return c.emit(c.m.Stdout, v, func(w io.Writer) error { return renderInstances(w, []rebalancer.InstanceView{v}) })
	}
	tel, err := rebalancer.WatchTelemetry(st, "")
	if err != nil {
		return err
	}
	defer tel.Stop()
	circuits, err := rebalancer.WatchCircuits(st)
	if err != nil {
		return err
	}
	defer circuits.Stop()
	if _, err := st.Directory().Instance(ctx, mustID(key)); err == nil && c.listen > 0 { // hear telemetry only for a real instance
		t := time.NewTimer(c.listen)
		select {
		case <-t.C:
		case <-ctx.Done():
		}
		t.Stop()
	}
	d, err := rebalancer.Detail(ctx, st, key, h, rebalancer.DetailSources{Telemetry: tel, Circuits: circuits}, time.Now())
	if err != nil {
		return err
	}
	return c.emit(c.m.Stdout, d, func(w io.Writer) error { return renderInstance(w, d, c.m.Now()) })
}

// mustID parses key, or returns the zero id (whose lookups fail) for Detail to report.
func mustID(key string) schema.InstanceID {
	id, _ := schema.ParseInstanceID(key)
	return id
}
