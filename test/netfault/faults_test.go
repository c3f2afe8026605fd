package netfault_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/gatesig"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/test/netfault"
)

// faultRuns is how many times each scenario injects its fault (TM_FAULT_RUNS; make faults
// runs 20, make test 1).
func faultRuns() int {
	if n, err := strconv.Atoi(os.Getenv("TM_FAULT_RUNS")); err == nil && n > 0 {
		return n
	}
	return 1
}

// lease is the kinds' lease (schema.DefaultLease: the fleet leaves it as it is).
const lease = schema.DefaultLease

// leaseSlack is what the bound on a cut-off instance's last answer allows beyond its lease:
// the answer's way back to the test over the bridge, and the scheduler of a loaded 2-core
// machine. The lease is measured from when the instance asked the leader, which is before
// the cut for any confirmation it received.
const leaseSlack = 500 * time.Millisecond

// fault is the state a scenario shares.
type fault struct {
	f  *netfault.Fleet
	st *schema.Store
}

// TestFaults starts one fleet (3 NATS nodes, 2 gateways, 2 shards of every kind, the
// rebalancer with its autopilot on), each process in its own network namespace, and runs
// every fault scenario on it in turn, TM_FAULT_RUNS times each, under the ledger workload:
// no request fails that the contract does not allow, the ledger history is linearizable,
// every job's effect arrives exactly once, views converge, placements end with one owner.
// Each scenario logs its figures ("FIGURE ..."): the longest time any tenant went unserved
// per run (p50, p99, max over runs).
func TestFaults(t *testing.T) {
	if testing.Short() {
		t.Skip("a fleet of processes in network namespaces, under faults")
	}
	if err := netfault.Requirements(); err != nil && os.Getenv("TM_REQUIRE_TOOLS") == "" {
		t.Skipf("fault harness: %v (set TM_REQUIRE_TOOLS=1 to make this a failure, as make test does)", err)
	}
	f := netfault.Start(t, netfault.Options{Bin: netfault.Binaries(t), Gateways: 2, NATSStoreSize: 512 << 20})
	fa := &fault{f: f, st: f.Store()}
	fa.awaitAutopilot(t)
	only := os.Getenv("TM_FAULT_ONLY") // a regexp of scenario names, for a closer look at one
	for _, sc := range []struct {
		name string
		run  func(t *testing.T)
	}{
		{"ShardCutFromNATS", func(t *testing.T) { fa.shardCut(t, "cut") }},
		{"ShardDeafToNATS", func(t *testing.T) { fa.shardCut(t, "deaf") }},
		{"ShardFrozen", func(t *testing.T) { fa.shardCut(t, "freeze") }},
		{"GatewayCutFromNATS", fa.gatewayCut},
		{"GatewayRestart", fa.gatewayRestart},
		{"NATSMinority", fa.natsMinority},
		{"NATSSplit", fa.natsSplit},
		{"NATSDiskFull", fa.natsDiskFull},
	} {
		if only != "" && !strings.Contains(only, sc.name) {
			continue
		}
		if !t.Run(sc.name, sc.run) {
			return // the fleet may be left in the fault's state
		}
	}
}

// awaitAutopilot waits until the rebalancer's autopilot decides (past its startup wait).
func (fa *fault) awaitAutopilot(t *testing.T) {
	t.Helper()
	for deadline := time.Now().Add(time.Minute); ; {
		var ap struct{ Deciding bool }
		if code, b, err := fa.f.Admin("GET", "/api/autopilot", nil); err == nil && code == http.StatusOK {
			_ = json.Unmarshal(b, &ap)
		}
		if ap.Deciding {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the autopilot is not deciding a minute after the fleet started")
		}
		time.Sleep(100 * time.Millisecond) // polling the rebalancer's state
	}
}

// victims picks, for every kind, the shard owning most of tenants, and its tenants with
// their epochs.
func (fa *fault) victims(t *testing.T, tenants []string) (shard map[string]string, owned map[string]map[string]uint64) {
	t.Helper()
	ctx := context.Background()
	shard, owned = map[string]string{}, map[string]map[string]uint64{}
	for _, kind := range netfault.Kinds {
		by := map[string]map[string]uint64{}
		for _, tenant := range tenants {
			p, err := fa.st.Placements(kind).Latest(ctx, tenant)
			if err != nil {
				t.Fatalf("placement of %s/%s: %v", kind, tenant, err)
			}
			if by[p.Shard] == nil {
				by[p.Shard] = map[string]uint64{}
			}
			by[p.Shard][tenant] = p.Epoch
		}
		for sh, ts := range by {
			if shard[kind] == "" || len(ts) > len(by[shard[kind]]) || len(ts) == len(by[shard[kind]]) && sh < shard[kind] {
				shard[kind] = sh
			}
		}
		owned[kind] = by[shard[kind]]
	}
	return shard, owned
}

// awaitMoved waits until none of owned's tenants is placed on shard any more (active
// elsewhere) and returns when that was seen.
func (fa *fault) awaitMoved(t *testing.T, kind, shard string, owned map[string]uint64, within time.Duration) time.Time {
	t.Helper()
	at, err := fa.moved(kind, shard, owned, within)
	if err != nil {
		t.Fatal(err)
	}
	return at
}

func (fa *fault) moved(kind, shard string, owned map[string]uint64, within time.Duration) (time.Time, error) {
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	for tenant := range owned {
		if _, err := kittest.WaitPlacement(ctx, fa.st, kind, tenant, func(p schema.Placement) bool {
			return p.Shard != shard && p.Phase == schema.PhaseActive
		}); err != nil {
			return time.Time{}, fmt.Errorf("%s/%s still on %s (or moving) %s after the fault: %v", kind, tenant, shard, within, err)
		}
	}
	return time.Now(), nil
}

// figures logs a scenario's outages over its runs.
func figures(t *testing.T, name string, outages []time.Duration, extra string) {
	slices.Sort(outages)
	pct := func(p float64) time.Duration { return outages[int(float64(len(outages)-1)*p)].Round(time.Millisecond) }
	t.Logf("FIGURE %s: %d runs, longest time a tenant went unserved per run: p50 %s p99 %s max %s%s",
		name, len(outages), pct(0.5), pct(0.99), pct(1), extra)
}

// shardCut cuts the busiest shard of every kind off NATS ("cut": both ways; "deaf": only
// what NATS sends it is dropped, its own packets still arrive) or freezes it ("freeze":
// SIGSTOP longer than every lease and timeout), while clients still reach it over HTTP.
// Each instance must stop answering within its lease of the fault (asked directly, with a
// gateway's proof, as a gateway routing by an old view would), its tenants fail over to the
// other shard, and once healed (or resumed) it answers none of them: 421 naming the owner.
func (fa *fault) shardCut(t *testing.T, mode string) {
	defer fa.f.Net.HealAll()
	tenants := netfault.Tenants(t.Name()[strings.LastIndex(t.Name(), "/")+1:], 6)
	w := fa.f.StartWorkload(t, tenants)
	w.AwaitServed(t, time.Now(), time.Minute) // placed in every kind
	var outages, lastAnswers []time.Duration
	for run := 1; run <= faultRuns(); run++ {
		shards, owned := fa.victims(t, tenants)
		agg := shards["aggregate"]
		// Two probes ask the victims directly, as a gateway routing by its old view would: the
		// aggregate's read (it reads JetStream, so cut off it fails anyway) and the
		// projection's GET /views, which needs nothing but the gate: only the lease stops it.
		probes := []*probe{fa.probe(t, "aggregate", shards, owned, "/aggregates/account/x"), fa.probe(t, "projection", shards, owned, "/views")}
		for _, pr := range probes {
			if code, body := pr.ask(); code != http.StatusOK {
				t.Fatalf("run %d: the probe of %s before the fault: %d %s", run, pr.shard, code, body)
			}
		}
		probeTenant, epoch, proof := probes[0].tenant, probes[0].epoch, probes[0].proof
		var victims []*netfault.Proc
		for _, kind := range netfault.Kinds {
			victims = append(victims, fa.f.Shards[shards[kind]])
		}
		at := time.Now()
		for _, v := range victims {
			switch mode {
			case "cut":
				v.Node.Cut(natsNodes(fa.f)...)
			case "deaf":
				v.Node.DropFrom(natsNodes(fa.f)...)
			case "freeze":
				if err := v.Signal(syscall.SIGSTOP); err != nil {
					t.Fatal(err)
				}
			}
		}
		t.Logf("run %d: %s %v at %s", run, mode, shards, at.Format("15:04:05.000"))
		// The bound: no answer from a victim after its lease, asked until the aggregate's
		// tenants moved and the lease is well over.
		type result struct {
			at  time.Time
			err error
		}
		moved := make(chan result, 1)
		go func() { // owned by this run: the loop below waits for it
			at, err := fa.moved("aggregate", agg, owned["aggregate"], 90*time.Second)
			moved <- result{at, err}
		}()
		var movedAt time.Time
		for n, done := 0, false; n < 10_000 && (!done || time.Since(at) < lease+2*time.Second); n++ {
			for _, pr := range probes {
				pr.observe(t)
			}
			select {
			case r := <-moved:
				if r.err != nil {
					t.Fatal(r.err)
				}
				movedAt, done = r.at, true
			case <-time.After(50 * time.Millisecond): // the probe's pace
			}
		}
		if movedAt.IsZero() {
			t.Fatal("the probe loop ended before the tenants moved")
		}
		var lasts []string
		for _, pr := range probes {
			if pr.lastOK.IsZero() {
				lasts = append(lasts, fmt.Sprintf("%s none %v", pr.kind, pr.codes))
				continue
			}
			last := pr.lastOK.Sub(at)
			lastAnswers = append(lastAnswers, last)
			lasts = append(lasts, fmt.Sprintf("%s %s %v", pr.kind, last.Round(time.Millisecond), pr.codes))
			if last > lease+leaseSlack {
				t.Errorf("run %d: %s answered %s %s after the %s: past its lease (%s)", run, pr.shard, pr.tenant, last.Round(time.Millisecond), mode, lease)
			}
		}
		for _, kind := range netfault.Kinds[1:] {
			fa.awaitMoved(t, kind, shards[kind], owned[kind], 90*time.Second)
		}
		served := w.AwaitServed(t, time.Now(), 60*time.Second)
		out, who := w.Outage(at, served)
		outages = append(outages, out)
		t.Logf("run %d: tenants moved after %s; longest unserved %s (%s); last 2xx of the cut-off instances after the fault (and their answers by status): %s",
			run, movedAt.Sub(at).Round(time.Millisecond), out.Round(time.Millisecond), who, strings.Join(lasts, "; "))
		if mode == "freeze" {
			time.Sleep(time.Until(at.Add(freezeFor()))) // the freeze outlasts every lease and timeout, whatever the failover took
		}
		// Heal (resume): the former owner answers none of its former tenants, never a 2xx.
		healed := time.Now()
		w.EffectsInDoubt(at, healed) // the cut-off runner's deliveries it could not record
		for _, v := range victims {
			if mode == "freeze" {
				_ = v.Signal(syscall.SIGCONT)
			} else {
				v.Node.Heal()
			}
		}
		var last int
		for deadline := time.Now().Add(30 * time.Second); ; {
			last, _ = fa.f.Direct("aggregate", agg, probeTenant, epoch, "/aggregates/account/x", proof)
			if last >= 200 && last < 300 {
				t.Fatalf("run %d: the former owner %s answered %d for %s %s after the heal", run, agg, last, probeTenant, time.Since(healed))
			}
			if last == http.StatusMisdirectedRequest || time.Now().After(deadline) {
				break
			}
			time.Sleep(50 * time.Millisecond) // until it confirmed its view again
		}
		if last != http.StatusMisdirectedRequest {
			t.Fatalf("run %d: the former owner %s answers %d for %s 30 s after the heal: it should name the new owner (421)", run, agg, last, probeTenant)
		}
		for _, v := range victims {
			if err := v.AwaitReady(60 * time.Second); err != nil {
				t.Fatal(err)
			}
		}
		w.AwaitServed(t, time.Now(), 60*time.Second)
	}
	w.Check(t, fa.st)
	slices.Sort(lastAnswers)
	extra := ""
	if len(lastAnswers) > 0 {
		extra = fmt.Sprintf("; last 2xx of a cut-off instance after the fault: p50 %s max %s (lease %s)",
			lastAnswers[len(lastAnswers)/2].Round(time.Millisecond), lastAnswers[len(lastAnswers)-1].Round(time.Millisecond), lease)
	}
	figures(t, t.Name(), outages, extra)
}

// probe asks one victim instance directly for one of its tenants, with a gateway's proof at
// the epoch it served, and keeps the time of its last 2xx.
type probe struct {
	fa                *fault
	kind, shard, path string
	tenant            string
	epoch             uint64
	proof             *gatesig.Signer
	lastOK            time.Time
	codes             map[int]int
}

func (fa *fault) probe(t *testing.T, kind string, shards map[string]string, owned map[string]map[string]uint64, path string) *probe {
	t.Helper()
	pr := &probe{fa: fa, kind: kind, shard: shards[kind], path: path, proof: fa.f.Signer(kind), codes: map[int]int{}}
	for tenant, e := range owned[kind] {
		pr.tenant, pr.epoch = tenant, e
		break
	}
	if pr.tenant == "" {
		t.Fatalf("%s owns none of the scenario's tenants", pr.shard)
	}
	return pr
}

func (pr *probe) ask() (int, string) {
	return pr.fa.f.Direct(pr.kind, pr.shard, pr.tenant, pr.epoch, pr.path, pr.proof)
}

// observe asks once and records the answer.
func (pr *probe) observe(t *testing.T) {
	code, body := pr.ask()
	if code >= 200 && code < 300 {
		pr.lastOK = time.Now()
	}
	if pr.codes[code]++; pr.codes[code] == 1 && (code < 200 || code >= 300) {
		t.Logf("the cut-off %s instance answers %d %s", pr.kind, code, body)
	}
}

func natsNodes(f *netfault.Fleet) []*netfault.Node {
	var out []*netfault.Node
	for _, p := range f.NATS {
		out = append(out, p.Node)
	}
	return out
}

// gatewayCut cuts the first gateway off NATS while the workload goes through it alone, and
// moves a tenant (all three kinds) meanwhile: the gateway keeps routing on its last view,
// and the requests it sends to the old owner are not lost (the old owner refuses them, and
// they are sent on, or answered 503 with Retry-After, which the client sends again).
func (fa *fault) gatewayCut(t *testing.T) {
	defer fa.f.Net.HealAll()
	tenants := netfault.Tenants("gwcut", 4)
	gw := fa.f.Gateways[0]
	w := fa.f.StartWorkload(t, tenants, gw)
	w.AwaitServed(t, time.Now(), time.Minute) // placed in every kind
	ctx := context.Background()
	var outages []time.Duration
	for run := 1; run <= faultRuns(); run++ {
		at := time.Now()
		gw.Node.Cut(natsNodes(fa.f)...)
		mover := tenants[run%len(tenants)]
		targets := map[string]string{}
		for _, kind := range netfault.Kinds {
			p, err := fa.st.Placements(kind).Latest(ctx, mover)
			if err != nil {
				t.Fatal(err)
			}
			targets[kind] = kind + "-1"
			if p.Shard == kind+"-1" {
				targets[kind] = kind + "-2"
			}
		}
		fa.move(t, mover, targets)
		moved := time.Now()
		time.Sleep(2 * time.Second) // the load runs on the stale view after the move, on purpose
		gw.Node.Heal()
		served := w.AwaitServed(t, time.Now(), 60*time.Second)
		out, who := w.Outage(at, served)
		outages = append(outages, out)
		t.Logf("run %d: moved %s to %v during the cut in %s; longest unserved %s (%s)", run, mover, targets, moved.Sub(at).Round(time.Millisecond), out.Round(time.Millisecond), who)
	}
	w.Check(t, fa.st)
	figures(t, t.Name(), outages, "")
}

// gatewayRestart restarts the gateway the workload goes through alone, while it keeps
// sending to it (no load balancer takes it out of rotation): nothing is answered that the
// contract does not allow while it starts. It found the gateway answering 404 no-route between
// listening and its first read of the route registry.
func (fa *fault) gatewayRestart(t *testing.T) {
	gw := fa.f.Gateways[0]
	w := fa.f.StartWorkload(t, netfault.Tenants("gwrestart", 4), gw)
	w.AwaitServed(t, time.Now(), time.Minute)
	var outages []time.Duration
	for run := 1; run <= faultRuns(); run++ {
		at := time.Now()
		if err := gw.Restart(60 * time.Second); err != nil {
			t.Fatal(err)
		}
		served := w.AwaitServed(t, time.Now(), 60*time.Second)
		out, who := w.Outage(at, served)
		outages = append(outages, out)
		t.Logf("run %d: restarted in %s; longest unserved %s (%s)", run, served.Sub(at).Round(time.Millisecond), out.Round(time.Millisecond), who)
	}
	w.Check(t, fa.st)
	figures(t, t.Name(), outages, "")
}

// move plans and applies a move of tenant and waits until it is done.
func (fa *fault) move(t *testing.T, tenant string, targets map[string]string) {
	t.Helper()
	if err := fa.f.Move(tenant, targets); err != nil {
		t.Fatal(err)
	}
}

// freezeFor is how long ShardFrozen keeps its victims stopped (TM_FAULT_FREEZE): longer
// than every lease and timeout of the platform (the kinds' lease 5 s, the rebalancer's
// leader lease 10 s, a NATS client's two missed pings 10 s).
func freezeFor() time.Duration {
	if d, err := time.ParseDuration(os.Getenv("TM_FAULT_FREEZE")); err == nil && d > 0 {
		return d
	}
	return 15 * time.Second
}

// faultHold is how long a NATS fault lasts: more than a lease and the rebalancer's detection
// of a silent instance (4 s), so whatever a minority holds fails over.
func faultHold() time.Duration {
	if d, err := time.ParseDuration(os.Getenv("TM_FAULT_HOLD")); err == nil && d > 0 {
		return d
	}
	return 12 * time.Second
}

// natsRun holds a NATS fault for faultHold under the workload, heals it, and waits until
// every tenant is served again and every NATS node is a current replica again.
func (fa *fault) natsRun(t *testing.T, name string, inject func(), heal func()) {
	defer fa.f.Net.HealAll()
	w := fa.f.StartWorkload(t, netfault.Tenants(name, 6))
	w.AwaitServed(t, time.Now(), time.Minute) // placed in every kind
	var outages []time.Duration
	for run := 1; run <= faultRuns(); run++ {
		at := time.Now()
		inject()
		t.Logf("run %d: fault at %s", run, at.Format("15:04:05.000"))
		time.Sleep(faultHold()) // the fault lasts this long whatever happens meanwhile
		heal()
		healed := time.Now()
		// A runner whose NATS node lost the stream leaders may deliver an effect and then fail
		// to record it; the instance that takes the delivery over after its lease delivers it
		// again (NATSMinority, once: an effect delivered 55 ms after the cut, twice).
		w.EffectsInDoubt(at, healed)
		served := w.AwaitServed(t, healed, 90*time.Second)
		fa.f.AwaitReplicas(t, 90*time.Second)
		out, who := w.Outage(at, served)
		outages = append(outages, out)
		t.Logf("run %d: healed after %s, every tenant served %s after the heal; longest unserved %s (%s)", run,
			healed.Sub(at).Round(time.Millisecond), served.Sub(healed).Round(time.Millisecond), out.Round(time.Millisecond), who)
	}
	w.Check(t, fa.st)
	figures(t, t.Name(), outages, fmt.Sprintf(" (fault held %s)", faultHold()))
}

// natsMinority cuts one NATS node off its two peers; its clients stay connected to it.
func (fa *fault) natsMinority(t *testing.T) {
	n := fa.f.NATS
	fa.natsRun(t, "minority", func() { n[2].Node.Cut(n[0].Node, n[1].Node) }, fa.f.Net.HealAll)
}

// natsSplit splits the fleet 2|1: NATS nodes 1 and 2 with the first gateway, the rebalancer
// and the first shard of each kind, against NATS node 3 with the second gateway and the
// second shard of each kind. Clients (the test) reach both gateways.
func (fa *fault) natsSplit(t *testing.T) {
	f := fa.f
	minority := []*netfault.Node{f.NATS[2].Node, f.Gateways[1].Node}
	majority := []*netfault.Node{f.NATS[0].Node, f.NATS[1].Node, f.Gateways[0].Node, f.Rebalancer.Node}
	for _, kind := range netfault.Kinds {
		majority = append(majority, f.Shards[kind+"-1"].Node)
		minority = append(minority, f.Shards[kind+"-2"].Node)
	}
	fa.natsRun(t, "split", func() {
		for _, n := range minority {
			n.Cut(majority...)
		}
	}, f.Net.HealAll)
}

// natsDiskFull fills the store of NATS node 3 (a tmpfs) for the fault's hold, then frees it.
func (fa *fault) natsDiskFull(t *testing.T) {
	p := fa.f.NATS[2]
	fill := func() {
		if err := p.FillDisk(); err != nil {
			t.Fatal(err)
		}
	}
	fa.natsRun(t, "diskfull", fill, func() {
		if err := p.FreeDisk(); err != nil {
			t.Fatal(err)
		}
		// nats-server stops a Raft group that met a write error ("Critical write error") and
		// no freed byte starts it again: the node needs a restart, which is the runbook's
		// step (docs/decisions.md, "The fault harness").
		if err := p.Restart(60 * time.Second); err != nil {
			t.Fatal(err)
		}
	})
}
