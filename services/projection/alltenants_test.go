package projection

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/services/aggregate"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// A multi-tenant shard (Config.AllTenants, the Cloudlysis PRD's "consumes all tenants") takes
// up every tenant it sees an event of, placed on it or not, with the tenant's history; and it
// refuses to warm a tenant for a move (a move needs tenant-filtered shards).
func TestMultiTenantShardConsumesEveryTenant(t *testing.T) {
	st := openStore(t)
	a := newAggregate(t, st)
	old := do(t, a, "early", command("acc0", aggregate.CmdOpen, 0)) // before the shard started
	if _, err := st.Placements(Kind).Create(context.Background(), schema.Placement{Tenant: "elsewhere", Shard: "projection-9"}); err != nil {
		t.Fatal(err)
	}
	s, _ := newService(t, st, Config{Shard: "projection-all", AllTenants: true})
	applied := func(tenant string, seq uint64) {
		t.Helper()
		tmtest.WaitFor(t, 20*time.Second, func() error {
			ts := s.lookup(tenant)
			if ts == nil || ts.appliedSeq() < seq {
				return fmt.Errorf("%s not applied up to %d (hosted: %v)", tenant, seq, s.Tenants())
			}
			return nil
		})
	}
	var last uint64
	for _, tenant := range []string{"early", "elsewhere", "new"} {
		last = do(t, a, tenant, command("acc1", aggregate.CmdOpen, 0)).Seq
		applied(tenant, last)
	}
	if got := s.Tenants(); !slices.Equal(got, []string{"early", "elsewhere", "new"}) {
		t.Fatalf("hosted %v", got)
	}
	accs := all[AccountRow](t, s, "early", "accounts", Query{})
	if len(accs) != 2 || accs[0].LastSeq != old.Seq {
		t.Fatalf("early's history did not come with it: %+v", accs)
	}
	if err := s.Warm(context.Background(), "new", last); !errors.Is(err, ErrAllTenants) {
		t.Fatalf("warming a tenant for a move on a multi-tenant shard: %v", err)
	}
}
