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

// A source's drained noted before its write (revision 0) stands until its stored copy, or a
// later epoch's signal, replaces it; a stored signal read late of its epoch does not.
func TestSignalViewEarlyDrainedNote(t *testing.T) {
	v := newSignalView(nil)
	sig := func(phase schema.SignalPhase, epoch, rev uint64) schema.TenantSignal {
		return schema.TenantSignal{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1", Instance: "a", Phase: phase, Epoch: epoch, Revision: rev}
	}
	steps := []struct {
		sig  schema.TenantSignal
		want schema.TenantSignal
	}{
		{sig(schema.SignalDraining, 4, 7), sig(schema.SignalDraining, 4, 7)},
		{sig(schema.SignalDrained, 4, 0), sig(schema.SignalDrained, 4, 0)},  // the early note
		{sig(schema.SignalDraining, 4, 7), sig(schema.SignalDrained, 4, 0)}, // a late read of the bucket
		{sig(schema.SignalDrained, 3, 2), sig(schema.SignalDrained, 4, 0)},  // an older epoch
		{sig(schema.SignalDrained, 4, 8), sig(schema.SignalDrained, 4, 8)},  // its stored copy
		{sig(schema.SignalDrained, 4, 0), sig(schema.SignalDrained, 4, 8)},  // the note again, late
		{sig(schema.SignalDrained, 5, 9), sig(schema.SignalDrained, 5, 9)},  // the commit's
	}
	for i, s := range steps {
		v.apply(s.sig)
		if got, _ := v.shard("t1", "aggregate-1"); got["a"] != s.want {
			t.Fatalf("step %d: after %+v the view holds %+v, want %+v", i, s.sig, got["a"], s.want)
		}
	}
}
