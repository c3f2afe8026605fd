// Package scale is the scale harness (`make scale`): a 3-node NATS cluster, placements per
// kind, a fleet of shard instances at several sizes, 3 gateways and the rebalancer, with
// traffic through the gateways while a plan of many moves runs. Every part is a process of its
// own, so that no one garbage collector is the wall: each NATS node (test/netfault/natsnode),
// the shard instances in groups of TM_SCALE_GROUP per process (test/scale/shardgroup: shardkit's
// own code, each instance on its own NATS connection and listener), each gateway and the
// rebalancer (their binaries); the test process keeps only its own work (loading placements,
// making plans, the traffic's clients). It prints what each role's NATS connections carry,
// what each process used (CPU from /proc/PID/stat, resident memory from /proc/PID/status, and
// summed by role) and how each figure grows with the fleet. Without TM_SCALE=1 it runs a smoke
// version with tiny numbers, so `make test` keeps it working.
package scale

import (
	"cmp"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// params are the harness's sizes; the TM_SCALE_* variables set them.
type params struct {
	Tenants     int           // placements per kind (TM_SCALE_TENANTS)
	Fleets      []int         // fleet sizes, instances over the three kinds (TM_SCALE_FLEETS, "100,1000")
	PerShard    int           // instances per shard (TM_SCALE_PER_SHARD)
	Group       int           // instances per shard group process (TM_SCALE_GROUP)
	Moves       int           // moves in each fleet's plan (TM_SCALE_MOVES)
	Concurrency int           // the plan's concurrency (TM_SCALE_CONCURRENCY)
	Live        int           // tenants with traffic through the gateways (TM_SCALE_LIVE)
	Clients     int           // client goroutines sending that traffic (TM_SCALE_CLIENTS)
	Rate        int           // requests per second the clients send together; 0 sends as fast as they can (TM_SCALE_RATE)
	Steady      time.Duration // the steady-state measuring window (TM_SCALE_STEADY)
	Replicas    int           // replicas of every bucket (TM_SCALE_REPLICAS)
	Gateways    int           // gateways (TM_SCALE_GATEWAYS)
	Heartbeat   time.Duration // the instances' heartbeat (TM_SCALE_HEARTBEAT)
	PauseBudget time.Duration // the rebalancer's pause budget; "0" runs the plan's concurrency throughout (TM_SCALE_PAUSE_BUDGET)
	Deadline    time.Duration // the whole run's bound (TM_SCALE_DEADLINE)
}

// smoke is what `make test` runs: every part, tiny.
var smoke = params{Tenants: 300, Fleets: []int{12, 18}, PerShard: 2, Group: 8, Moves: 20, Concurrency: 5, Live: 6, Clients: 2, Rate: 100,
	Steady: 2 * time.Second, Replicas: 3, Gateways: 3, Heartbeat: time.Second, Deadline: 4 * time.Minute}

// full is `make scale`'s default; TM_SCALE_* override each field. 3,000 moves a fleet, not the
// 10,000 of the one-process harness: as processes on 2 cores the pacer holds a plan to about
// 5 moves a second (docs/benchmarks.md, "First runs as processes"), and 10,000 would not end.
var full = params{Tenants: 1_000_000, Fleets: []int{100, 1000}, PerShard: 2, Group: 100, Moves: 3_000, Concurrency: 50, Live: 60,
	Clients: 8, Rate: 600, Steady: 10 * time.Second, Replicas: 3, Gateways: 3, Heartbeat: time.Second, Deadline: 45 * time.Minute}

func paramsFromEnv() (params, bool, error) {
	if os.Getenv("TM_SCALE") != "1" {
		return smoke, false, nil
	}
	p := full
	ints := map[string]*int{"TENANTS": &p.Tenants, "PER_SHARD": &p.PerShard, "GROUP": &p.Group, "MOVES": &p.Moves,
		"CONCURRENCY": &p.Concurrency, "LIVE": &p.Live, "CLIENTS": &p.Clients, "REPLICAS": &p.Replicas, "GATEWAYS": &p.Gateways}
	for name, dst := range ints {
		if v := os.Getenv("TM_SCALE_" + name); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 {
				return p, true, fmt.Errorf("TM_SCALE_%s=%q: want a positive integer", name, v)
			}
			*dst = n
		}
	}
	if v := os.Getenv("TM_SCALE_PAUSE_BUDGET"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 0 {
			return p, true, fmt.Errorf("TM_SCALE_PAUSE_BUDGET=%q: want a duration, or 0 to run the plan's concurrency throughout", v)
		}
		p.PauseBudget = cmp.Or(d, -1)
	}
	if v := os.Getenv("TM_SCALE_RATE"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return p, true, fmt.Errorf("TM_SCALE_RATE=%q: want requests per second, or 0 for as fast as the clients can", v)
		}
		p.Rate = n
	}
	durs := map[string]*time.Duration{"STEADY": &p.Steady, "HEARTBEAT": &p.Heartbeat, "DEADLINE": &p.Deadline}
	for name, dst := range durs {
		if v := os.Getenv("TM_SCALE_" + name); v != "" {
			d, err := time.ParseDuration(v)
			if err != nil || d <= 0 {
				return p, true, fmt.Errorf("TM_SCALE_%s=%q: want a positive duration", name, v)
			}
			*dst = d
		}
	}
	if v := os.Getenv("TM_SCALE_FLEETS"); v != "" {
		p.Fleets = nil
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n < 3*p.PerShard*2 {
				return p, true, fmt.Errorf("TM_SCALE_FLEETS=%q: want sizes of at least %d (2 shards per kind)", v, 3*p.PerShard*2)
			}
			p.Fleets = append(p.Fleets, n)
		}
	}
	return p, true, nil
}

// kinds are the three service kinds the fleet serves.
var kinds = []string{"aggregate", "projection", "runner"}

// shardsPerKind is how many shards of each kind a fleet of n instances has.
func (p params) shardsPerKind(n int) int { return max(n/len(kinds)/p.PerShard, 2) }

// maxShards is the shards per kind of the largest fleet: tenants are placed over all of them,
// and a smaller fleet runs the first shardsPerKind of them.
func (p params) maxShards() int {
	m := 0
	for _, n := range p.Fleets {
		m = max(m, p.shardsPerKind(n))
	}
	return m
}

func shardName(kind string, i int) string { return fmt.Sprintf("%s-%d", kind, i) }

func tenantName(i int) string { return fmt.Sprintf("t%07d", i) }
