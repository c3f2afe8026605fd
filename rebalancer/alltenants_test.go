package rebalancer

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// A multi-tenant projection shard (instances labelled tm-tenants=all: they consume every
// tenant) takes part in no move: a plan naming it as a source or target is refused with the
// reason, and balance neither sends tenants to it nor takes its tenants away.
func TestMultiTenantShardTakesPartInNoMove(t *testing.T) {
	st, _ := kittest.Store(t)
	ctx := context.Background()
	all := map[string]string{schema.LabelTenants: schema.TenantsAll}
	for _, in := range []schema.Instance{
		{InstanceID: schema.InstanceID{Kind: "projection", Shard: "projection-all", Instance: "a"}, URL: "http://127.0.0.1:9", Capacity: 100, Labels: all},
		{InstanceID: schema.InstanceID{Kind: "projection", Shard: "projection-1", Instance: "a"}, URL: "http://127.0.0.1:9", Capacity: 100},
		{InstanceID: schema.InstanceID{Kind: "projection", Shard: "projection-2", Instance: "a"}, URL: "http://127.0.0.1:9", Capacity: 100},
	} {
		if _, err := st.Directory().Register(ctx, in); err != nil {
			t.Fatal(err)
		}
	}
	for tenant, shard := range map[string]string{"a1": "projection-all", "a2": "projection-all", "f1": "projection-1",
		"f2": "projection-1", "f3": "projection-1", "f4": "projection-1"} {
		if _, err := st.Placements("projection").Create(ctx, schema.Placement{Tenant: tenant, Shard: shard}); err != nil {
			t.Fatal(err)
		}
	}
	make := func(req planner.Request) (*planner.Plan, error) {
		req.Kind = "projection"
		return MakePlan(ctx, st, req, WorldOptions{})
	}
	for name, req := range map[string]planner.Request{
		"manual to it":      {Strategy: planner.StrategyManual, Moves: []planner.ManualMove{{Tenant: "f1", To: "projection-all"}}},
		"manual from it":    {Strategy: planner.StrategyManual, Moves: []planner.ManualMove{{Tenant: "a1", To: "projection-2"}}},
		"evacuate it":       {Strategy: planner.StrategyEvacuate, Shard: "projection-all"},
		"fill it":           {Strategy: planner.StrategyFill, Shard: "projection-all"},
		"move-tenant to it": {Strategy: planner.StrategyMoveTenant, Tenant: "f2", Targets: map[string]string{"projection": "projection-all"}},
	} {
		if name == "move-tenant to it" {
			req.Kind = ""
			if _, err := MakePlan(ctx, st, req, WorldOptions{}); !errors.Is(err, planner.ErrInvalid) || !strings.Contains(err.Error(), "multi-tenant") {
				t.Errorf("%s: %v", name, err)
			}
			continue
		}
		if _, err := make(req); !errors.Is(err, planner.ErrInvalid) || !strings.Contains(err.Error(), "consumes every tenant") {
			t.Errorf("%s: %v", name, err)
		}
	}
	p, err := make(planner.Request{Strategy: planner.StrategyBalance, Options: planner.Options{Tolerance: 0.01}})
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Moves) == 0 {
		t.Fatal("balance moved nothing: projection-1 holds four tenants and projection-2 none")
	}
	for _, m := range p.Moves {
		if m.From == "projection-all" || m.To == "projection-all" {
			t.Errorf("balance moves %s from %s to %s", m.Tenant, m.From, m.To)
		}
	}
}
