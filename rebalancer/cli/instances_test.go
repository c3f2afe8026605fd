package cli

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// The instance list filtered by status and labels (the multi-host design's "filter by status or
// labels"), and each instance's last memory and disk figures beside its CPU (its "last
// CPU/RAM/disk"), from real shard instances.
func TestInstancesFilterAndHostMetrics(t *testing.T) {
	e := newEnv(t)
	kittest.Shard(t, shardkit.Config{Store: e.st, ID: schema.InstanceID{Kind: "aggregate", Shard: "s-1"}, Labels: map[string]string{"region": "eu", "env": "prod"}})
	kittest.Shard(t, shardkit.Config{Store: e.st, ID: schema.InstanceID{Kind: "aggregate", Shard: "s-2"}, Labels: map[string]string{"region": "us", "env": "prod"}})
	if _, err := e.st.Directory().Register(context.Background(), schema.Instance{InstanceID: schema.InstanceID{Kind: "aggregate", Shard: "s-3", Instance: "gone"},
		URL: "http://127.0.0.1:9", Labels: map[string]string{"region": "eu"}, Heartbeat: time.Now().Add(-time.Hour)}); err != nil {
		t.Fatal(err)
	}
	var views []rebalancer.InstanceView
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("both instances' metrics in the directory", func() bool {
		views = decode[[]rebalancer.InstanceView](t, e.run(t, "", "instances", "--status", "online", "--output", "json").stdout)
		return len(views) == 2 && views[0].Metrics != nil && views[1].Metrics != nil
	}))
	for _, v := range views {
		if m := v.Metrics; m.MemBytes == 0 || m.MemPercent <= 0 || m.DiskPercent <= 0 || m.DiskPercent > 100 || m.DiskFreeBytes == 0 {
			t.Errorf("%s: memory and disk not in its last metrics: %+v", v.Key, m)
		}
	}
	for _, c := range []struct {
		args []string
		want []string
	}{
		{[]string{"--label", "region=eu"}, []string{"aggregate.s-1.i1", "aggregate.s-3.gone"}},
		{[]string{"--label", "region=eu", "--status", "online"}, []string{"aggregate.s-1.i1"}},
		{[]string{"--label", "env=prod,region=us"}, []string{"aggregate.s-2.i1"}},
		{[]string{"--status", "offline,degraded"}, []string{"aggregate.s-3.gone"}},
		{[]string{"--label", "region=ap"}, nil},
	} {
		got := decode[[]rebalancer.InstanceView](t, e.run(t, "", append([]string{"instances", "--output", "json"}, c.args...)...).stdout)
		var keys []string
		for _, v := range got {
			keys = append(keys, v.Key)
		}
		if strings.Join(keys, " ") != strings.Join(c.want, " ") {
			t.Errorf("instances %v: %v, want %v", c.args, keys, c.want)
		}
	}
	if r := e.run(t, "", "instances", "--status", "asleep"); r.code != 2 {
		t.Fatalf("an unknown status: exit %d %s", r.code, r.stderr)
	}
	if r := e.run(t, "", "instances", "--status", "online"); !strings.Contains(r.stdout, "MiB") || !strings.Contains(r.stdout, "DISK") {
		t.Fatalf("instances table:\n%s", r.stdout)
	}
}
