package test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/internal/gatesig"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
	"github.com/tenantmesh/tenantmesh/test/history"
)

// failoverRuns is how many times TestFailoverUnderLoad kills a shard of every kind
// (TM_FAILOVER_RUNS; make e2e runs 20), and freezeFor how long it freezes one (TM_FREEZE;
// make e2e: 30s).
func failoverRuns() int {
	if n, err := strconv.Atoi(os.Getenv("TM_FAILOVER_RUNS")); err == nil && n > 0 {
		return n
	}
	return 2
}

func freezeFor() time.Duration {
	if d, err := time.ParseDuration(os.Getenv("TM_FREEZE")); err == nil && d > 0 {
		return d
	}
	return 15 * time.Second
}

var failoverKinds = []string{"aggregate", "projection", "runner"}

// answers records, per tenant and kind, the successful answers to requests sent after a
// moment: when a tenant of a killed shard answered again.
type answers struct {
	mu    sync.Mutex
	since time.Time
	first map[string]time.Time // "<kind>/<tenant>" -> first success sent after since
}

func (a *answers) observe(tenant, kind string, ok bool, sent, answered time.Time) {
	if !ok {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	k := kind + "/" + tenant
	if a.first != nil && !sent.Before(a.since) {
		if _, seen := a.first[k]; !seen {
			a.first[k] = answered
		}
	}
}

// reset starts watching again from since.
func (a *answers) reset(since time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.since, a.first = since, map[string]time.Time{}
}

func (a *answers) at(kind, tenant string) (time.Time, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	t, ok := a.first[kind+"/"+tenant]
	return t, ok
}

// TestFailoverUnderLoad kills -9 every instance of one shard of each kind at once, while a
// ledger workload (deposits, withdrawals, reads), queries and jobs with webhook effects go
// through the gateway, and lets the autopilot fail the shards' tenants over: it measures, for
// every tenant of a killed shard, how long after the kill its requests of that kind answer
// again (detection included). It does so TM_FAILOVER_RUNS times, alternating the shards (a
// killed shard is started again, empty, before the next run), then freezes a shard of each
// kind (SIGSTOP) for TM_FREEZE, longer than every lease and timeout, and measures the same;
// after SIGCONT the woken aggregate instance refuses the tenants that moved away. Every run:
// no request fails that the contract does not allow (503 with Retry-After is retried), the
// ledger history is linearizable (porcupine), every job's effect arrived exactly once, the
// views converge to the ledger, and every placement ends with one owner.
func TestFailoverUnderLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("the whole platform under load, with shards dying")
	}
	stateFile := filepath.Join(t.TempDir(), "state.json")
	s := startStack(t, "--instances", "1", "--on-exit", "keep", "--autopilot", "on", "--state-file", stateFile, "--control-addr", "127.0.0.1:0")
	var st0 devState
	if b, err := os.ReadFile(stateFile); err != nil || json.Unmarshal(b, &st0) != nil || st0.Control == "" {
		t.Fatalf("state file %s: %v %s", stateFile, err, b)
	}
	control := st0.Control
	nc, err := nats.Connect(s.natsURL, nats.UserCredentials(s.natsCreds))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	ctx := context.Background()
	store, err := schema.Open(ctx, nc, schema.Options{})
	if err != nil {
		t.Fatal(err)
	}
	rcv := history.NewReceiver()
	hook := httptest.NewServer(rcv)
	defer hook.Close()

	ans := &answers{}
	c := &history.Client{Gateways: []string{s.gateway}, HTTP: &http.Client{Timeout: 20 * time.Second}, Rec: history.NewRecorder(),
		OnAnswer: ans.observe, Slow: 3 * time.Second, Logf: t.Logf}
	tenants := []string{"fo-a", "fo-b", "fo-c", "fo-d", "fo-e", "fo-f", "fo-g", "fo-h"}
	accounts := []string{"x", "y"}
	for i, tenant := range tenants {
		for _, acct := range accounts {
			if !c.Open(i, tenant, acct) {
				t.Fatalf("opening %s/%s: %v", tenant, acct, c.Failures())
			}
		}
	}
	var jobsMu sync.Mutex
	jobs := map[string]string{} // job id -> tenant
	stop := make(chan struct{})
	var wg sync.WaitGroup
	// Each tenant has a worker per kind, so one kind's outage does not stall the others' load
	// (and their time to answer again is each kind's own).
	loop := func(pause time.Duration, step func(n int)) {
		for n := 0; n < 1_000_000; n++ {
			select {
			case <-stop:
				return
			default:
			}
			step(n)
			time.Sleep(pause) // pace the load so the 2-core machine keeps up
		}
	}
	for i, tenant := range tenants {
		rnd := rand.New(rand.NewPCG(uint64(i), 7))
		wg.Go(func() {
			loop(5*time.Millisecond, func(int) {
				acct := accounts[rnd.IntN(len(accounts))]
				switch r := rnd.IntN(10); {
				case r < 5:
					c.Do(i, history.Input{Kind: history.Deposit, Tenant: tenant, Account: acct, Amount: int64(1 + rnd.IntN(9))})
				case r < 7:
					c.Do(i, history.Input{Kind: history.Withdraw, Tenant: tenant, Account: acct, Amount: int64(1 + rnd.IntN(9))})
				default:
					c.Do(i, history.Input{Kind: history.Read, Tenant: tenant, Account: acct})
				}
			})
		})
		wg.Go(func() {
			loop(50*time.Millisecond, func(int) {
				c.Call(i, tenant, "projection", "POST", "/query/accounts", map[string]any{"limit": 5})
			})
		})
		wg.Go(func() {
			loop(80*time.Millisecond, func(n int) {
				status, b := c.Call(i, tenant, "runner", "POST", "/jobs", map[string]any{"type": "webhook", "idempotency_key": fmt.Sprintf("fo-job-%d", n),
					"payload": map[string]any{"url": hook.URL, "body": map[string]any{"tenant": tenant, "n": n}}})
				var run struct{ ID string }
				if status < 300 && json.Unmarshal(b, &run) == nil && run.ID != "" {
					jobsMu.Lock()
					jobs[run.ID] = tenant
					jobsMu.Unlock()
				}
			})
		})
	}
	stopLoad := sync.OnceFunc(func() { close(stop); wg.Wait() })
	defer stopLoad()

	// victims picks, for every kind, the shard owning most of the test's tenants, and the
	// tenants it owns.
	victims := func() (shard map[string]string, affected map[string][]string) {
		shard, affected = map[string]string{}, map[string][]string{}
		for _, kind := range failoverKinds {
			by := map[string][]string{}
			for _, tenant := range tenants {
				p, err := store.Placements(kind).Latest(ctx, tenant)
				if err != nil {
					t.Fatalf("placement of %s/%s: %v", kind, tenant, err)
				}
				by[p.Shard] = append(by[p.Shard], tenant)
			}
			for sh, ts := range by {
				if shard[kind] == "" || len(ts) > len(by[shard[kind]]) || len(ts) == len(by[shard[kind]]) && sh < shard[kind] {
					shard[kind] = sh
				}
			}
			affected[kind] = by[shard[kind]]
		}
		return shard, affected
	}
	// answered waits until every affected tenant answered again in its kind, and returns the
	// times from since.
	answered := func(what string, since time.Time, affected map[string][]string, within time.Duration) []time.Duration {
		var out []time.Duration
		deadline := time.Now().Add(within)
		for _, kind := range failoverKinds {
			for _, tenant := range affected[kind] {
				for {
					if at, ok := ans.at(kind, tenant); ok {
						out = append(out, at.Sub(since))
						break
					}
					if time.Now().After(deadline) {
						t.Fatalf("%s: %s/%s did not answer again within %s", what, kind, tenant, within)
					}
					time.Sleep(20 * time.Millisecond) // polling the load's answers: they have no event to await
				}
			}
		}
		return out
	}
	// signal sends sig to the processes of shard of every kind, and returns when.
	signal := func(shards map[string]string, sig syscall.Signal) time.Time {
		state := readState(t, control)
		var at time.Time
		for _, kind := range failoverKinds {
			child := state.Children[shards[kind]]
			if child.PID <= 0 || !child.Running {
				t.Fatalf("%s is not running: %+v", shards[kind], child)
			}
			if err := syscall.Kill(child.PID, sig); err != nil {
				t.Fatalf("kill -%d %s: %v", sig, shards[kind], err)
			}
			at = time.Now()
		}
		t.Logf("%s: signal %v to %v", at.Format("15:04:05.000"), sig, shards)
		return at
	}
	// The autopilot decides once its leader is past its startup wait.
	for deadline := time.Now().Add(time.Minute); ; {
		var ap struct{ Deciding bool }
		resp, err := adminClient.Get(s.rebalancer + "/api/autopilot")
		if err == nil {
			_ = json.NewDecoder(resp.Body).Decode(&ap)
			resp.Body.Close()
		}
		if ap.Deciding {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the autopilot is not deciding a minute after the stack started")
		}
		time.Sleep(100 * time.Millisecond) // polling the rebalancer's state
	}
	time.Sleep(time.Second) // steady load before the first failure

	var kills, freezes []time.Duration
	for run := 1; run <= failoverRuns(); run++ {
		shards, affected := victims()
		killed := signal(shards, syscall.SIGKILL)
		ans.reset(killed)
		ttr := answered(fmt.Sprintf("kill run %d", run), killed, affected, time.Minute)
		kills = append(kills, ttr...)
		slices.Sort(ttr)
		t.Logf("run %d: %d tenant-kinds of %v answered again after p50 %s max %s", run, len(ttr), shards, pct(ttr, 0.5).Round(time.Millisecond), pct(ttr, 1).Round(time.Millisecond))
		for _, kind := range failoverKinds { // start the killed shards again: empty, they are the next run's targets
			postOK(t, control+"/children/"+shards[kind]+"/start", nil)
		}
		for _, kind := range failoverKinds {
			awaitOK(t, readState(t, control).Children[shards[kind]].URL, time.Now(), time.Minute)
		}
	}

	// A freeze: longer than every lease and timeout; the shard's tenants fail over while it
	// is stopped, and once it runs again it serves none of them.
	shards, affected := victims()
	epochs := map[string]uint64{} // what a gateway routing by its snapshot of before the freeze would send
	for _, tenant := range affected["aggregate"] {
		p, err := store.Placements("aggregate").Get(ctx, tenant)
		if err != nil {
			t.Fatal(err)
		}
		epochs[tenant] = p.Epoch
	}
	gateKey, err := gatesig.ReadKeyFile(filepath.Join(s.dir, "data", "auth", "gate", "aggregate.key"))
	if err != nil {
		t.Fatalf("the stack's gateway key for aggregate: %v", err)
	}
	proof := gatesig.NewSigner(gateKey)
	frozen := signal(shards, syscall.SIGSTOP)
	ans.reset(frozen)
	freezes = answered("freeze", frozen, affected, time.Minute)
	if rest := freezeFor() - time.Since(frozen); rest > 0 {
		time.Sleep(rest) // the freeze lasts TM_FREEZE whatever the failover took
	}
	woke := signal(shards, syscall.SIGCONT)
	aggURL := strings.TrimSuffix(readState(t, control).Children[shards["aggregate"]].URL, "/readyz")
	for _, tenant := range affected["aggregate"] {
		// Straight to the woken instance (with a gateway's proof), as a gateway still routing by
		// its snapshot of before the freeze would:
		// never an answer; a refusal naming the new owner once it confirmed its view.
		var last int
		for deadline := time.Now().Add(15 * time.Second); ; {
			req, _ := http.NewRequest("GET", aggURL+"/aggregates/account/x", nil)
			f := gatesig.Fields{Method: "GET", Target: "/aggregates/account/x", Kind: "aggregate", Shard: shards["aggregate"],
				Tenant: tenant, Epoch: strconv.FormatUint(epochs[tenant], 10)}
			req.Header.Set(tmhttp.HeaderTenant, tenant)
			req.Header.Set(tmhttp.HeaderKind, f.Kind)
			req.Header.Set(tmhttp.HeaderShard, f.Shard)
			req.Header.Set(tmhttp.HeaderEpoch, f.Epoch)
			req.Header.Set(tmhttp.HeaderProof, string(proof.Append(nil, time.Now().Unix(), &f)))
			resp, err := adminClient.Do(req)
			if err != nil {
				t.Fatalf("the woken instance: %v", err)
			}
			resp.Body.Close()
			last = resp.StatusCode
			if last < 300 {
				t.Fatalf("the woken former owner answered %d for %s, %s after it woke", last, tenant, time.Since(woke))
			}
			if last == http.StatusMisdirectedRequest || time.Now().After(deadline) {
				break
			}
			time.Sleep(50 * time.Millisecond) // until it confirmed its view (its lease ran out while it was stopped)
		}
		if last != http.StatusMisdirectedRequest {
			t.Fatalf("the woken former owner answers %d for %s: it should name the new owner (421)", last, tenant)
		}
	}
	time.Sleep(time.Second) // steady load after the last failure
	stopLoad()

	if f := c.Failures(); len(f) > 0 {
		t.Errorf("%d requests failed:\n%s", len(f), strings.Join(first(f, 20), "\n"))
	}
	c.Rec.RequireLinearizable(t, "TM_STACK_LOGS", "failover")
	// Views converge to the ledger; every job ran and its effect arrived once; one owner each.
	l := &load{gw: s.gateway, hc: &http.Client{Timeout: 15 * time.Second}, jobs: jobs}
	for _, tenant := range tenants {
		var tot struct{ Balances int64 }
		code, b := l.do(tenant, "GET", "/ledger/totals", nil)
		if code != http.StatusOK || json.Unmarshal(b, &tot) != nil {
			t.Fatalf("totals of %s: %d %s", tenant, code, b)
		}
		history.AwaitView(t, l.call, tenant, tot.Balances)
		for _, kind := range failoverKinds {
			p, err := store.Placements(kind).Latest(ctx, tenant)
			if err != nil || p.Phase != schema.PhaseActive || p.Target != "" || p.Source != "" {
				t.Errorf("placement %s/%s not settled with one owner: %+v %v", kind, tenant, p, err)
			}
		}
	}
	history.AwaitJobs(t, l.call, jobs)
	repeats := rcv.CheckApplied(t, len(jobs))
	slices.Sort(kills)
	slices.Sort(freezes)
	t.Logf("failover under load: %d kill runs (%d tenant-kinds), time to answer again after the kill p50 %s p99 %s max %s; "+
		"a %s freeze (%d tenant-kinds) p50 %s p99 %s max %s; %d ledger operations linearizable, %d jobs (%d effects delivered again to the idempotent receiver), %d failed requests",
		failoverRuns(), len(kills), pct(kills, 0.5).Round(time.Millisecond), pct(kills, 0.99).Round(time.Millisecond), pct(kills, 1).Round(time.Millisecond),
		freezeFor(), len(freezes), pct(freezes, 0.5).Round(time.Millisecond), pct(freezes, 0.99).Round(time.Millisecond), pct(freezes, 1).Round(time.Millisecond),
		c.Rec.Len(), len(jobs), repeats, len(c.Failures()))
	s.stop(t)
}
