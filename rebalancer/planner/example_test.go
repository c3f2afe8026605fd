package planner_test

import (
	"errors"
	"fmt"

	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
)

func ExampleBalance() {
	w := planner.World{
		Kind: "aggregate",
		Shards: []planner.Shard{
			{Name: "aggregate-1", Capacity: 100},
			{Name: "aggregate-2", Capacity: 100},
		},
		Tenants: []planner.Tenant{
			{ID: "acme", Shard: "aggregate-1", Load: 40, Revision: 7},
			{ID: "globex", Shard: "aggregate-1", Load: 20, Revision: 9},
			{ID: "initech", Shard: "aggregate-1", Load: 20, Revision: 4, Pinned: true},
		},
	}
	p, err := planner.Balance(w, planner.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, m := range p.Moves {
		fmt.Printf("%s: %s -> %s (revision %d)\n", m.Tenant, m.From, m.To, m.Revision)
	}
	s := p.Summary("aggregate")
	fmt.Printf("max/mean %.2f -> %.2f\n", s.Before.MaxOverMean, s.After.MaxOverMean)
	// Output:
	// acme: aggregate-1 -> aggregate-2 (revision 7)
	// max/mean 2.00 -> 1.00
}

func ExampleEvacuate() {
	w := planner.World{
		Kind:   "runner",
		Shards: []planner.Shard{{Name: "runner-1", Capacity: 10}, {Name: "runner-2", Capacity: 10}},
		Tenants: []planner.Tenant{
			{ID: "acme", Shard: "runner-1", Load: 6},
			{ID: "globex", Shard: "runner-1", Load: 6},
		},
	}
	_, err := planner.Evacuate(w, "runner-1", planner.Options{})
	fmt.Println(errors.Is(err, planner.ErrNoCapacity))
	fmt.Println(err)
	// Output:
	// true
	// not enough capacity: evacuating runner/runner-1 needs room for 12.0 load, the other shards have 10.0: need 2.0 more, add a shard or raise capacity
}
