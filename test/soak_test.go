package test

import (
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/test/history"
)

// soakMinutes is how long TestAutopilotSoak runs (TM_SOAK_MINUTES; make e2e: 4, an hour at
// the test's time scale of 1:15).
func soakMinutes() float64 {
	if f, err := strconv.ParseFloat(os.Getenv("TM_SOAK_MINUTES"), 64); err == nil && f > 0 {
		return f
	}
	return 0
}

// Soak time scale: one real second stands for 15 simulated seconds. The autopilot's guardrails
// are a production rebalancer's scaled down the same way: a budget of 30 moves per "half hour",
// a "15 minute" cool-down, imbalance held "2.5 minutes" before a balance plan.
const (
	soakWindow   = 2 * time.Minute
	soakCooldown = time.Minute
	soakSustain  = 10 * time.Second
	soakMaxMoves = 30
	// soakTolerance is the autopilot's default tolerance: balance plans aim at max/mean 1.1.
	soakTolerance = 0.1
)

func maxOf(m map[string]float64) float64 {
	var mx float64
	for _, v := range m {
		mx = max(mx, v)
	}
	return mx
}

// TestAutopilotSoak runs the platform with the autopilot on under skewed load whose hot
// tenants shift, while shards leave (killed: their tenants fail over) and join (started again,
// empty: the autopilot fills them), for TM_SOAK_MINUTES (make e2e). Afterwards, with the load
// steady: every kind's max/mean utilisation is within the autopilot's tolerance, no tenant was
// moved by the autopilot twice within its cool-down (failover excepted), no window held more
// autopilot moves than its budget, and no request failed.
func TestAutopilotSoak(t *testing.T) {
	minutes := soakMinutes()
	if testing.Short() || minutes == 0 {
		t.Skip("the autopilot soak runs in make e2e (TM_SOAK_MINUTES)")
	}
	stateFile := filepath.Join(t.TempDir(), "state.json")
	flags := fmt.Sprintf("--autopilot-sustain %s --autopilot-cooldown %s --autopilot-window %s --autopilot-max-moves %d --dead-after 4s",
		soakSustain, soakCooldown, soakWindow, soakMaxMoves)
	s := startStack(t, "--shards", "3", "--on-exit", "keep", "--autopilot", "on", "--rebalancer-flags", flags,
		"--state-file", stateFile, "--control-addr", "127.0.0.1:0")
	var st0 devState
	if b, err := os.ReadFile(stateFile); err != nil || json.Unmarshal(b, &st0) != nil || st0.Control == "" {
		t.Fatalf("state file %s: %v %s", stateFile, err, b)
	}
	control := st0.Control

	c := &history.Client{Gateways: []string{s.gateway}, HTTP: &http.Client{Timeout: 20 * time.Second}, Rec: history.NewRecorder()}
	var tenants []string
	for i := range 20 {
		tenants = append(tenants, fmt.Sprintf("soak-%02d", i))
	}
	for i, tenant := range tenants {
		if !c.Open(i, tenant, "main") {
			t.Fatalf("opening %s: %v", tenant, c.Failures())
		}
	}
	// Skew: a hot set of 5 tenants sends ten times as often as the rest; it shifts every
	// quarter of the run.
	var shift atomic.Int64
	hot := func(i int) bool { return (i-int(shift.Load())*5+len(tenants))%len(tenants) < 5 }
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var requests atomic.Int64
	for i, tenant := range tenants {
		wg.Go(func() {
			rnd := rand.New(rand.NewPCG(uint64(i), 11))
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				if rnd.IntN(3) == 0 {
					c.Do(i, history.Input{Kind: history.Read, Tenant: tenant, Account: "main"})
				} else {
					c.Do(i, history.Input{Kind: history.Deposit, Tenant: tenant, Account: "main", Amount: 1})
				}
				if n%5 == 0 {
					c.Call(i, tenant, "projection", "POST", "/query/accounts", map[string]any{"limit": 1})
				}
				requests.Add(1)
				pause := 100 * time.Millisecond
				if hot(i) {
					pause = 10 * time.Millisecond
				}
				time.Sleep(pause) // the tenant's rate: the load's skew
			}
		})
	}
	stopLoad := sync.OnceFunc(func() { close(stop); wg.Wait() })
	defer stopLoad()

	// Shards leave and join through the run, one kind at a time: kill a shard (its tenants
	// fail over), start it again a while later (it is filled).
	run := time.Duration(minutes * float64(time.Minute))
	start := time.Now()
	events := []struct {
		at   float64 // fraction of the run
		what string
		name string
	}{
		{0.05, "leave", "aggregate-3"}, {0.10, "shift", ""}, {0.15, "join", "aggregate-3"}, {0.20, "leave", "projection-2"},
		{0.25, "shift", ""}, {0.30, "join", "projection-2"}, {0.35, "leave", "runner-1"}, {0.40, "shift", ""}, {0.45, "join", "runner-1"},
		// The last 55%: steady load, longer than a cool-down and a few sustains, to settle.
	}
	for _, ev := range events {
		if d := time.Until(start.Add(time.Duration(ev.at * float64(run)))); d > 0 {
			time.Sleep(d) // the run's schedule
		}
		switch ev.what {
		case "shift":
			shift.Add(1)
			t.Logf("%s: the hot tenants shift", time.Since(start).Round(time.Second))
		case "leave":
			kill9(t, control, ev.name)
		case "join":
			postOK(t, control+"/children/"+ev.name+"/start", nil)
			t.Logf("%s: %s joins again, empty", time.Since(start).Round(time.Second), ev.name)
		}
	}
	if d := time.Until(start.Add(run)); d > 0 {
		time.Sleep(d) // steady load to the end: the autopilot settles
	}
	// Within the tolerance: at once, or once a settle (above the tolerance for 4 x the
	// sustain) and its plan had the time to bring it back.
	imbalance := soakMetrics(t, s.rebalancer)
	for deadline := time.Now().Add(4*soakSustain + time.Minute); time.Now().Before(deadline); imbalance = soakMetrics(t, s.rebalancer) {
		if maxOf(imbalance) <= 1+soakTolerance {
			break
		}
		time.Sleep(time.Second) // the autopilot measures every 5s: polling its figure
	}
	stopLoad()

	if f := c.Failures(); len(f) > 0 {
		t.Errorf("%d of %d requests failed:\n%s", len(f), requests.Load(), strings.Join(first(f, 20), "\n"))
	}
	for kind, r := range imbalance {
		if r > 1+soakTolerance {
			t.Errorf("%s: max/mean utilisation %.2f at the end, above the autopilot's tolerance %.2f", kind, r, 1+soakTolerance)
		}
	}
	moves := autopilotMoves(t, s.rebalancer)
	// Failover's takeovers count towards the budget but are never stopped by it, nor by the
	// cool-down: the guardrails hold the autopilot's other moves.
	byTenant := map[string][]time.Time{}
	var all []time.Time
	failovers := 0
	for _, m := range moves {
		if m.Takeover {
			failovers++
			continue
		}
		all = append(all, m.Finished)
		byTenant[m.Kind+"/"+m.Tenant] = append(byTenant[m.Kind+"/"+m.Tenant], m.Finished)
	}
	for k, times := range byTenant {
		slices.SortFunc(times, func(a, b time.Time) int { return a.Compare(b) })
		for i := 1; i < len(times); i++ {
			if gap := times[i].Sub(times[i-1]); gap < soakCooldown {
				t.Errorf("%s moved twice by the autopilot %s apart, within its cool-down of %s", k, gap.Round(time.Second), soakCooldown)
			}
		}
	}
	slices.SortFunc(all, func(a, b time.Time) int { return a.Compare(b) })
	most := 0
	for i := range all {
		j := i
		for j < len(all) && all[j].Sub(all[i]) <= soakWindow {
			j++
		}
		most = max(most, j-i)
	}
	if most > soakMaxMoves {
		t.Errorf("%d autopilot moves within one window of %s, the budget is %d", most, soakWindow, soakMaxMoves)
	}
	t.Logf("autopilot soak: %.1f minutes (x15: %.0f simulated), %d requests, %d failed; %d autopilot moves (%d of them failover takeovers; most of the others in one %s window: %d of %d); end max/mean %v",
		minutes, minutes*15, requests.Load(), len(c.Failures()), len(moves), failovers, soakWindow, most, soakMaxMoves, imbalance)
	s.stop(t)
}

// soakMetrics reads the autopilot's last measured max/mean utilisation of each kind.
func soakMetrics(t *testing.T, base string) map[string]float64 {
	t.Helper()
	resp, err := adminClient.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	out := map[string]float64{}
	for line := range strings.SplitSeq(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, `tm_autopilot_imbalance{kind="`); ok {
			kind, val, _ := strings.Cut(rest, `"} `)
			if f, err := strconv.ParseFloat(val, 64); err == nil {
				out[kind] = f
			}
		}
	}
	return out
}

// apMove is one move of an autopilot plan as the API reports it.
type apMove struct {
	Kind, Tenant, State string
	Takeover            bool
	Finished            time.Time
}

// autopilotMoves lists every move of the autopilot's plans that finished done.
func autopilotMoves(t *testing.T, base string) []apMove {
	t.Helper()
	resp, err := adminClient.Get(base + "/api/plans?limit=0")
	if err != nil {
		t.Fatal(err)
	}
	var sums []struct {
		ID     string
		Origin string
	}
	err = json.NewDecoder(resp.Body).Decode(&sums)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	var out []apMove
	for _, p := range sums {
		if p.Origin != "autopilot" {
			continue
		}
		r, err := adminClient.Get(base + "/api/plans/" + p.ID)
		if err != nil {
			t.Fatal(err)
		}
		var pr struct{ Moves []apMove }
		err = json.NewDecoder(r.Body).Decode(&pr)
		r.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range pr.Moves {
			if m.State == "done" {
				out = append(out, m)
			}
		}
	}
	return out
}
