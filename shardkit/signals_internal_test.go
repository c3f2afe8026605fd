package shardkit

import (
	"fmt"
	"testing"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// The signal view stays bounded however many tenants move into the shard, and keeps the
// newest.
func TestSignalViewBounded(t *testing.T) {
	v := newSignalView(nil)
	n := maxSignalTenants + 1000
	for i := range n {
		v.apply(schema.TenantSignal{Kind: "aggregate", Tenant: fmt.Sprintf("t%05d", i), Shard: "aggregate-1", Instance: "a",
			Phase: schema.SignalDrained, Revision: uint64(i + 1)})
	}
	if len(v.byTenant) > maxSignalTenants || len(v.seen) != len(v.byTenant) {
		t.Fatalf("the view holds %d tenants (%d times) after %d; want at most %d", len(v.byTenant), len(v.seen), n, maxSignalTenants)
	}
	if sigs, _ := v.shard(fmt.Sprintf("t%05d", n-1), "aggregate-1"); sigs["a"].Revision != uint64(n) {
		t.Fatalf("the newest tenant's signal is gone: %v", sigs)
	}
}
