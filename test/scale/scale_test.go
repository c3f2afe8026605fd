package scale

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	_ "net/http/pprof" // TM_SCALE_PPROF=1
	"os"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// fleetResult is what one fleet size measured.
type fleetResult struct {
	Instances     int
	Start         time.Duration // to start the instances added for this size
	Steady        map[string]rates
	SteadyCPU     float64            // cores, the whole process (NATS servers included)
	SteadyRoleCPU map[string]float64 // cores by role
	Moves         map[string]rates
	MovesCPU      float64
	MovesRoleCPU  map[string]float64
	Applied       int
	Skipped       int
	Aborted       int
	Failures      int // moves that ended failed
	Apply         time.Duration
	Pauses        []time.Duration
	Warm          []time.Duration   // started -> handoff
	Finish        []time.Duration   // commit -> finished
	Steps         [][]time.Duration // each step of the pause (schema.HandoffStepNames), moves with a full timeline
	Limits        []int             // the rebalancer's moves-at-once limit, sampled while the plan ran
	Requests      int64
	Failed        int64
	RSS           int64
}

// TestScale is the scale harness (see the package comment). Correctness is asserted (every
// move done, no failed request); the figures are printed, never asserted.
func TestScale(t *testing.T) {
	p, isFull, err := paramsFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	if testing.Short() && !isFull {
		t.Skip("the smoke run starts a 3-node cluster")
	}
	ctx, cancel := context.WithTimeout(context.Background(), p.Deadline)
	defer cancel()
	h := newHarness(t, p, ctx)
	if os.Getenv("TM_SCALE_PPROF") == "1" { // a look inside a long run: go tool pprof http://<addr>/debug/pprof/profile
		ln := listen(t)
		srv := &http.Server{Handler: http.DefaultServeMux, ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = srv.Serve(ln) }()
		t.Cleanup(func() { _ = srv.Close() })
		t.Logf("pprof on http://%s/debug/pprof/", ln.Addr())
	}
	t0 := time.Now()
	h.start()
	loaded := h.load()
	t.Logf("placed %d tenants x %d kinds in %s", p.Tenants, len(kinds), loaded.Round(time.Millisecond))
	h.writeSnapshots()
	// The gateways start first, on a quiet process, so the heap each adds is its own.
	var colds []coldStart
	before := heapInUse()
	for i := range p.Gateways {
		colds = append(colds, h.startGateway(i))
	}
	gwHeap := (heapInUse() - before) / int64(p.Gateways)
	t.Logf("gateways ready: %+v", colds)
	h.startWatchers()
	h.startRebalancer()

	var results []fleetResult
	live := h.liveTenants()
	for _, n := range p.Fleets {
		if ctx.Err() != nil {
			t.Fatalf("the run's deadline (%s) passed before the fleet of %d", p.Deadline, n)
		}
		results = append(results, h.runFleet(n, live))
		if len(results) < len(p.Fleets) { // the figures so far, in case a larger fleet does not fit the deadline
			report(os.Stdout, p, loaded, colds, gwHeap, results, time.Since(t0))
		}
	}
	report(os.Stdout, p, loaded, colds, gwHeap, results, time.Since(t0))
	for _, r := range results {
		if r.Failed != 0 {
			t.Errorf("fleet %d: %d of %d requests failed", r.Instances, r.Failed, r.Requests)
		}
		// A move may abort (its handoff over the time limit on a starved machine) and leave the
		// tenant where it was: that is the protocol working, and the table says how many. A
		// move that failed, or a plan with nothing done, is not.
		if r.Applied == 0 || r.Failures != 0 {
			t.Errorf("fleet %d: %d of %d moves done, %d failed", r.Instances, r.Applied, p.Moves, r.Failures)
		}
	}
}

// liveTenant is a tenant that gets traffic.
type liveTenant struct{ kind, tenant string }

// liveTenants picks p.Live tenants, spread over the kinds, placed on shards the smallest fleet runs.
func (h *harness) liveTenants() []liveTenant {
	small := h.p.shardsPerKind(slices.Min(h.p.Fleets))
	var out []liveTenant
	for i := 0; len(out) < h.p.Live && i < h.p.Tenants; i++ {
		if i%h.p.maxShards() < small {
			out = append(out, liveTenant{kinds[len(out)%len(kinds)], tenantName(i)})
		}
	}
	return out
}

// runFleet grows the fleet to n, measures the steady state, then applies a plan of p.Moves
// moves under traffic.
func (h *harness) runFleet(n int, live []liveTenant) fleetResult {
	t := h.t
	r := fleetResult{}
	t0 := time.Now()
	r.Instances = h.growFleet(n)
	r.Start = time.Since(t0)
	t.Logf("fleet of %d instances running after %s", r.Instances, r.Start.Round(time.Millisecond))
	// Let registrations, route publications and first heartbeats settle before measuring.
	time.Sleep(3 * h.p.Heartbeat) // a settling period, not a wait for an event

	prof := h.profile(fmt.Sprintf("steady-%d", n))
	a, c0, w0 := h.natsStats(), cpuTime(), time.Now()
	time.Sleep(h.p.Steady) // the measuring window
	d := time.Since(w0)
	r.Steady, r.SteadyCPU = diffStats(a, h.natsStats(), d), (cpuTime()-c0).Seconds()/d.Seconds()
	r.SteadyRoleCPU = prof(d)

	plan := h.plan(n, live)
	var stop func()
	var load *load
	withRole("client", func() { stop, load = h.traffic(live) })
	prof = h.profile(fmt.Sprintf("moves-%d", n))
	a, c0, w0 = h.natsStats(), cpuTime(), time.Now()
	recs := h.apply(plan, &r.Limits)
	d = time.Since(w0)
	r.Moves, r.MovesCPU = diffStats(a, h.natsStats(), d), (cpuTime()-c0).Seconds()/d.Seconds()
	r.MovesRoleCPU = prof(d)
	r.Apply = d
	stop()
	r.Requests, r.Failed = load.requests.Load(), load.failed.Load()
	for _, f := range load.failures() {
		t.Logf("failed request: %s", f)
	}
	for _, m := range recs {
		switch m.State {
		case rebalancer.MoveDone:
			r.Applied++
			r.Pauses = append(r.Pauses, m.Pause())
			r.Warm = append(r.Warm, m.Handoff.Sub(m.Started))
			r.Finish = append(r.Finish, m.Finished.Sub(m.Commit))
			if gaps, ok := m.Steps.Gaps(m.Handoff, m.Commit); ok {
				if r.Steps == nil {
					r.Steps = make([][]time.Duration, len(gaps))
				}
				for i, g := range gaps {
					r.Steps[i] = append(r.Steps[i], g)
				}
			}
		case rebalancer.MoveSkipped:
			r.Skipped++
			t.Logf("move skipped: %s %s: %s", m.Kind, m.Tenant, m.Reason)
		case rebalancer.MoveAborted:
			r.Aborted++
			t.Logf("move aborted: %s %s: %s", m.Kind, m.Tenant, m.Reason)
		default:
			r.Failures++
			t.Logf("move %s %s ended %s: %s", m.Kind, m.Tenant, m.State, m.Reason)
		}
	}
	h.logTopSubs(roleRebalancer)
	logSlowest(t, "pause (handoff -> commit)", recs, (*rebalancer.MoveRecord).Pause)
	logSlowest(t, "drain (commit -> finished)", recs, func(m *rebalancer.MoveRecord) time.Duration {
		if m.Commit.IsZero() || m.Finished.IsZero() {
			return 0
		}
		return m.Finished.Sub(m.Commit)
	})
	r.RSS = rss()
	if dir := os.Getenv("TM_SCALE_PROFILES"); dir != "" { // what holds the heap: go tool pprof -sample_index=inuse_space
		f, err := os.Create(filepath.Join(dir, fmt.Sprintf("heap-%d.pprof", n)))
		if err == nil {
			err = errors.Join(pprof.Lookup("heap").WriteTo(f, 0), f.Close())
		}
		if err != nil {
			t.Errorf("heap profile: %v", err)
		}
	}
	return r
}

// logSlowest logs the 5 moves with the longest d, with their timeline, for a look at the tail.
func logSlowest(t *testing.T, what string, recs []rebalancer.MoveRecord, d func(*rebalancer.MoveRecord) time.Duration) {
	idx := make([]int, len(recs))
	for i := range idx {
		idx[i] = i
	}
	slices.SortFunc(idx, func(a, b int) int { return cmp.Compare(d(&recs[b]), d(&recs[a])) })
	for _, i := range idx[:min(5, len(idx))] {
		m := &recs[i]
		t.Logf("slowest %s: %s: %s %s %s -> %s, started %s, handoff +%s, commit +%s, finished +%s; %s", what, d(m).Round(time.Millisecond),
			m.Key(), m.Kind, m.From, m.To, m.Started.Format("15:04:05.000"), m.Handoff.Sub(m.Started).Round(time.Millisecond),
			m.Commit.Sub(m.Started).Round(time.Millisecond), m.Finished.Sub(m.Started).Round(time.Millisecond), m.Reason)
	}
}

// profile starts a CPU profile; the function it returns stops it and gives the cores each role
// used over d. With TM_SCALE_PROFILES=dir the profile is kept as dir/<name>.pprof (each role's
// samples: go tool pprof -tagfocus role=gateway).
func (h *harness) profile(name string) func(d time.Duration) map[string]float64 {
	keep := ""
	if dir := os.Getenv("TM_SCALE_PROFILES"); dir != "" {
		keep = filepath.Join(dir, name+".pprof")
	}
	stop, err := cpuProfile(keep)
	if err != nil {
		h.t.Fatal(err)
	}
	return func(d time.Duration) map[string]float64 {
		secs, err := stop()
		if err != nil {
			h.t.Fatal(err)
		}
		for k, v := range secs {
			secs[k] = v / d.Seconds()
		}
		return secs
	}
}

// plan makes p.Moves moves among the fleet's shards: every live tenant once, then random
// tenants, each from where it is to another shard the fleet runs, spread over the kinds.
func (h *harness) plan(n int, live []liveTenant) *planner.Plan {
	shards := h.p.shardsPerKind(n)
	rnd := rand.New(rand.NewPCG(uint64(n), 16))
	seen := map[string]bool{}
	p := &planner.Plan{Strategy: planner.StrategyManual, Concurrency: h.p.Concurrency, Waves: 1}
	add := func(kind, tenant string) {
		if seen[kind+"/"+tenant] {
			return
		}
		e, ok := h.watchers[kind].Lookup(kind, tenant)
		if !ok {
			return
		}
		var from int
		if _, err := fmt.Sscanf(strings.TrimPrefix(e.Shard, kind+"-"), "%d", &from); err != nil || from >= shards {
			return
		}
		to := (from + 1 + rnd.IntN(shards-1)) % shards
		seen[kind+"/"+tenant] = true
		p.Moves = append(p.Moves, planner.Move{Kind: kind, Tenant: tenant, From: e.Shard, To: shardName(kind, to),
			Revision: e.Revision, Wave: 1})
	}
	for _, l := range live {
		if len(p.Moves) < h.p.Moves {
			add(l.kind, l.tenant)
		}
	}
	for tries := 0; len(p.Moves) < h.p.Moves && tries < 20*h.p.Moves; tries++ {
		kind := kinds[len(p.Moves)%len(kinds)]
		i := rnd.IntN(h.p.Tenants)
		add(kind, tenantName(i))
	}
	if len(p.Moves) < h.p.Moves {
		h.t.Fatalf("found only %d movable tenants for %d moves: raise TM_SCALE_TENANTS", len(p.Moves), h.p.Moves)
	}
	return p
}

// apply stores the plan, applies it through the rebalancer's API and waits for it to end. On
// a loaded machine the leader lease can lapse and a plan's store can fail in doubt: both are
// logged and tried again (a new plan; the apply until the leader takes it), within the run's
// deadline.
func (h *harness) apply(p *planner.Plan, limits *[]int) []rebalancer.MoveRecord {
	eng := h.reb.Engine()
	var rec rebalancer.PlanRecord
	for attempt := 1; ; attempt++ {
		var err error
		if rec, err = eng.CreatePlan(h.ctx, p, "scale"); err == nil {
			break
		}
		if attempt == 3 || h.ctx.Err() != nil {
			h.t.Fatal(err)
		}
		h.t.Logf("storing the plan failed (trying again): %v", err)
	}
	for {
		code, body := h.post(h.rebURL + "/api/plans/" + rec.ID + "/apply")
		if code == http.StatusAccepted {
			break
		}
		if code != http.StatusConflict || h.ctx.Err() != nil {
			h.t.Fatalf("apply: %d %s", code, body)
		}
		h.t.Logf("apply refused (trying again): %d %s", code, body)
		select {
		case <-h.ctx.Done():
		case <-time.After(time.Second): // until this rebalancer leads again
		}
	}
	lastLog := time.Now()
	for {
		if l := eng.MoveLimit(); l > 0 {
			*limits = append(*limits, l)
		}
		// The plan's own record says when it ends; its moves (10,000 records) are read only for
		// the progress line and at the end: listing them twice a second was about a seventh of
		// the rebalancer connection's messages and much of the process's garbage.
		var pr rebalancer.PlanRecord
		_, err := h.admin.Rebalance().Latest(h.ctx, schema.PlanKey(rec.ID), &pr)
		if err == nil && pr.Status != rebalancer.PlanApplying && pr.Status != rebalancer.PlanPlanned {
			_, moves, err := eng.Plan(h.ctx, rec.ID)
			if err != nil {
				h.t.Fatalf("reading plan %s's moves: %v", rec.ID, err)
			}
			return moves
		}
		if time.Since(lastLog) >= 15*time.Second {
			if _, moves, err := eng.Plan(h.ctx, rec.ID); err == nil {
				states := map[rebalancer.MoveState]int{}
				for _, m := range moves {
					states[m.State]++
				}
				h.t.Logf("plan %s: %v", rec.ID, states)
			}
			lastLog = time.Now()
		}
		select {
		case <-h.ctx.Done():
			h.t.Fatalf("plan %s not applied before the run's deadline", rec.ID)
		case <-time.After(500 * time.Millisecond): // polling the plan's record
		}
	}
}

// post POSTs to the rebalancer's API with the admin token.
func (h *harness) post(url string) (int, []byte) {
	req, _ := http.NewRequestWithContext(h.ctx, http.MethodPost, url, nil)
	req.Header.Set("Authorization", "Bearer "+adminToken)
	resp, err := tmtest.HTTP.Do(req)
	if err != nil {
		h.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	return resp.StatusCode, body
}

// load counts the traffic's requests and keeps the first failures.
type load struct {
	requests, failed atomic.Int64
	mu               sync.Mutex
	fails            []string
}

func (l *load) fail(s string) {
	l.failed.Add(1)
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.fails) < 10 {
		l.fails = append(l.fails, s)
	}
}

func (l *load) failures() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.fails)
}

// traffic sends requests for the live tenants through the gateways, round robin, from
// p.Clients goroutines, until stop: p.Rate requests a second together, each client on its own
// ticker (a request held past its tick skips the ticks it missed), or as fast as they can when
// p.Rate is 0. A paced load leaves the machine room for the moves, as a real fleet's clients
// would; an unpaced one takes every core the process has and measures the machine instead.
func (h *harness) traffic(live []liveTenant) (stop func(), l *load) {
	l = &load{}
	ctx, cancel := context.WithCancel(h.ctx)
	client := &http.Client{Timeout: 15 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	var wg sync.WaitGroup
	for c := range h.p.Clients {
		wg.Go(func() {
			var tick <-chan time.Time
			if h.p.Rate > 0 {
				t := time.NewTicker(time.Duration(h.p.Clients) * time.Second / time.Duration(h.p.Rate))
				defer t.Stop()
				tick = t.C
			}
			for i := c; ctx.Err() == nil; i += h.p.Clients {
				if tick != nil {
					select {
					case <-ctx.Done():
						return
					case <-tick:
					}
				}
				lt := live[i%len(live)]
				gw := h.gateways[i%len(h.gateways)]
				req, _ := http.NewRequestWithContext(ctx, http.MethodGet, gw+routeOf(lt.kind)+"x", nil)
				req.Header.Set("x-tenant-id", lt.tenant)
				resp, err := client.Do(req)
				if ctx.Err() != nil {
					return
				}
				l.requests.Add(1)
				if err != nil {
					l.fail(fmt.Sprintf("%s %s: %v", lt.kind, lt.tenant, err))
					continue
				}
				b, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK || !bytes.Equal(b, []byte("ok")) {
					l.fail(fmt.Sprintf("%s %s via %s: %d %s", lt.kind, lt.tenant, gw, resp.StatusCode, b))
				}
			}
		})
	}
	return func() { cancel(); wg.Wait(); client.CloseIdleConnections() }, l
}

// cpuTime is the process's user and system CPU time.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// rss is the process's resident memory in bytes (Linux), 0 where unknown.
func rss() int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			var kb int64
			if _, err := fmt.Sscanf(strings.TrimSpace(v), "%d kB", &kb); err == nil {
				return kb << 10
			}
		}
	}
	return 0
}
