package cli

import (
	"strings"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// `rebalance tenants` lists the tenants' sizes a live shard reports in its telemetry, the
// largest first.
func TestTenantsShowsSizes(t *testing.T) {
	e := newEnv(t)
	sizes := func() []schema.TenantSize {
		return []schema.TenantSize{{Tenant: "globex", Queued: 3, Due: 1}, {Tenant: "acme", Events: 10, EventBytes: 2048, SnapshotBytes: 4096}}
	}
	kittest.Shard(t, shardkit.Config{Store: e.st, ID: schema.InstanceID{Kind: "aggregate", Shard: "s-1"},
		Heartbeat: 100 * time.Millisecond, Hooks: shardkit.Hooks{Sizes: sizes}})
	views := decode[[]rebalancer.TenantSizeView](t, e.run(t, "", "tenants", "--listen", "1s", "--output", "json").stdout)
	if len(views) != 2 || views[0].Tenant != "acme" || views[0].MoveBytes != 2048 || views[1].Tenant != "globex" || views[1].Queued != 3 {
		t.Fatalf("tenants: %+v", views)
	}
	r := e.run(t, "", "tenants", "--listen", "1s")
	if r.code != 0 || !strings.Contains(r.stdout, "2.0 KiB") || !strings.Contains(r.stdout, "DUE") {
		t.Fatalf("tenants table: %d\n%s%s", r.code, r.stdout, r.stderr)
	}
}
