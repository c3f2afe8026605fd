package server

import (
	"net/http"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/sweeper"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// GET /api/tenants lists the tenant sizes live shards report, the largest first, at most limit.
func TestAPITenantSizes(t *testing.T) {
	st, url := kittest.Store(t)
	sizes := func() []schema.TenantSize {
		return []schema.TenantSize{{Tenant: "small", ViewBytes: 10}, {Tenant: "big", ViewBytes: 1 << 20}, {Tenant: "mid", ViewBytes: 5000}}
	}
	kittest.Shard(t, shardkit.Config{Store: openStore(t, url), ID: schema.InstanceID{Kind: "projection", Shard: "p-1"},
		Heartbeat: 100 * time.Millisecond, Hooks: shardkit.Hooks{Sizes: sizes}})
	r := start(t, st, "r1", sweeper.Config{})
	var got []rebalancer.TenantSizeView
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("the sizes in /api/tenants", func() bool {
		code, _ := call(t, "GET", r.ts.URL+"/api/tenants?kind=projection&limit=2", nil, &got)
		return code == http.StatusOK && len(got) == 2
	}))
	if got[0].Tenant != "big" || got[0].MoveBytes != 1<<20 || got[1].Tenant != "mid" || got[0].Shard != "p-1" {
		t.Fatalf("/api/tenants: %+v", got)
	}
	if code, _ := call(t, "GET", r.ts.URL+"/api/tenants?limit=0", nil, nil); code != http.StatusBadRequest {
		t.Fatalf("limit=0: %d, want 400", code)
	}
}
