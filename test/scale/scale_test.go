package scale

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/test/netfault"
)

// fleetResult is what one fleet size measured.
type fleetResult struct {
	Instances   int
	Start       time.Duration // to start the instances added for this size
	Groups      int           // shard group processes
	Steady      map[string]rates
	SteadyProcs []procUse // each process over the steady window
	Moves       map[string]rates
	MovesProcs  []procUse // each process over the plan's apply
	Applied     int
	Skipped     int
	Aborted     int
	Failures    int // moves that ended failed
	Apply       time.Duration
	Pauses      []time.Duration
	Warm        []time.Duration   // started -> handoff
	Finish      []time.Duration   // commit -> finished
	Steps       [][]time.Duration // each step of the pause (schema.HandoffStepNames), moves with a full timeline
	Limits      []int             // the rebalancer's moves-at-once limit (its /metrics), sampled while the plan ran
	Requests    int64
	Failed      int64
}

func TestMain(m *testing.M) {
	code := m.Run()
	netfault.RemoveBinaries()
	os.Exit(code)
}

// TestScale is the scale harness (see the package comment). Correctness is asserted (every
// move done, no failed request); the figures are printed, never asserted.
func TestScale(t *testing.T) {
	p, isFull, err := paramsFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	if testing.Short() && !isFull {
		t.Skip("the smoke run starts a 3-node cluster and the platform's processes")
	}
	ctx, cancel := context.WithTimeout(context.Background(), p.Deadline)
	defer cancel()
	t0 := time.Now()
	h := newHarness(t, p, ctx)
	t.Logf("binaries built in %s", time.Since(t0).Round(time.Millisecond))
	h.start()
	loaded := h.load()
	t.Logf("placed %d tenants x %d kinds in %s", p.Tenants, len(kinds), loaded.Round(time.Millisecond))
	h.startPlacements()
	var colds []coldStart
	for i := range p.Gateways {
		colds = append(colds, h.startGateway(i))
	}
	t.Logf("gateways ready: %+v", colds)
	h.startRebalancer()

	var results []fleetResult
	live := h.liveTenants()
	for _, n := range p.Fleets {
		if ctx.Err() != nil {
			t.Fatalf("the run's deadline (%s) passed before the fleet of %d", p.Deadline, n)
		}
		results = append(results, h.runFleet(n, live))
		if len(results) < len(p.Fleets) { // the figures so far, in case a larger fleet does not fit the deadline
			report(os.Stdout, p, loaded, colds, results, time.Since(t0))
		}
	}
	report(os.Stdout, p, loaded, colds, results, time.Since(t0))
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
	r.Groups = len(h.groupsRunning())
	t.Logf("fleet of %d instances in %d groups running after %s", r.Instances, r.Groups, r.Start.Round(time.Millisecond))
	// Let registrations, route publications and first heartbeats settle before measuring.
	time.Sleep(3 * h.p.Heartbeat) // a settling period, not a wait for an event

	a, u0, w0 := h.natsStats(), h.sample(), time.Now()
	time.Sleep(h.p.Steady) // the measuring window
	d := time.Since(w0)
	r.Steady, r.SteadyProcs = diffStats(a, h.natsStats(), d), h.usageOver(u0, h.sample(), d)

	plan := h.plan(n, live)
	stop, load := h.traffic(live)
	a, u0, w0 = h.natsStats(), h.sample(), time.Now()
	recs := h.apply(plan, &r.Limits)
	d = time.Since(w0)
	r.Moves, r.MovesProcs = diffStats(a, h.natsStats(), d), h.usageOver(u0, h.sample(), d)
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
		e, ok := h.placements.Lookup(kind, tenant)
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

// apply stores the plan (the harness's own engine writes its records to the shared KV, as
// the rebalancer's API would: the API makes plans from a planner.Request, not from a plan
// made elsewhere), applies it through the rebalancer's API and waits for it to end. On a
// loaded machine the leader lease can lapse and a plan's store can fail in doubt: both are
// logged and tried again (a new plan; the apply until the leader takes it), within the run's
// deadline.
func (h *harness) apply(p *planner.Plan, limits *[]int) []rebalancer.MoveRecord {
	var rec rebalancer.PlanRecord
	for attempt := 1; ; attempt++ {
		var err error
		if rec, err = h.eng.CreatePlan(h.ctx, p, "scale"); err == nil {
			break
		}
		if attempt == 5 || h.ctx.Err() != nil {
			h.t.Fatal(err)
		}
		h.t.Logf("storing the plan failed (trying again): %v", err)
		select {
		case <-h.ctx.Done():
		case <-time.After(2 * time.Second): // a starved cluster's writes time out in doubt: give it a moment
		}
	}
	for {
		code, body := h.call(http.MethodPost, h.rebURL+"/api/plans/"+rec.ID+"/apply")
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
	return h.follow(rec.ID, limits)
}

// follow watches the plan's record and its moves until the record says the plan ended, and
// returns the moves' last records. It is one watch, so it sees them in the stream's order: a
// move's last write lands before the record that ends the plan, and the moves are never
// listed. (Listing a 3,000-move plan every 15 s never finished on the 996-instance fleet's
// saturated cluster, and the same loop was the one that noticed the plan's end.)
func (h *harness) follow(id string, limits *[]int) []rebalancer.MoveRecord {
	moves := map[string]rebalancer.MoveRecord{}
	var status rebalancer.PlanStatus
	tick := time.NewTicker(500 * time.Millisecond) // the rebalancer's move limit, from its /metrics
	defer tick.Stop()
	lastLog := time.Now()
	for h.ctx.Err() == nil {
		w, err := h.admin.KV(schema.BucketRebalance).WatchFiltered(h.ctx, []string{schema.PlanKey(id), schema.MovesOf(id)})
		if err != nil {
			h.t.Logf("watching plan %s (trying again): %v", id, err)
			select {
			case <-h.ctx.Done():
			case <-time.After(time.Second): // a starved cluster's consumer create can time out
			}
			continue
		}
		for done := false; !done; {
			select {
			case <-h.ctx.Done():
				done = true
			case <-tick.C:
				if l := h.moveLimit(); l > 0 {
					*limits = append(*limits, l)
				}
				if time.Since(lastLog) >= 15*time.Second {
					states := map[rebalancer.MoveState]int{}
					for _, m := range moves {
						states[m.State]++
					}
					h.t.Logf("plan %s: %s, moves %v", id, status, states)
					lastLog = time.Now()
				}
			case u, ok := <-w.Updates():
				if !ok {
					done = true
					break
				}
				if u == nil || u.Operation() != jetstream.KeyValuePut {
					continue
				}
				if u.Key() == schema.PlanKey(id) {
					var pr struct {
						Status rebalancer.PlanStatus `json:"status"`
					}
					if err := jsx.Unmarshal(u.Value(), &pr); err != nil {
						h.t.Fatalf("plan %s's record: %v", id, err)
					}
					if status = pr.Status; status != rebalancer.PlanApplying && status != rebalancer.PlanPlanned {
						_ = w.Stop()
						return slices.SortedFunc(maps.Values(moves), func(a, b rebalancer.MoveRecord) int { return cmp.Compare(a.ID, b.ID) })
					}
					continue
				}
				var m rebalancer.MoveRecord
				if err := jsx.Unmarshal(u.Value(), &m); err != nil {
					h.t.Fatalf("move %s: %v", u.Key(), err)
				}
				m.RecordRev = u.Revision()
				moves[u.Key()] = m
			}
		}
		_ = w.Stop()
	}
	h.t.Fatalf("plan %s not applied before the run's deadline", id)
	return nil
}

// moveLimit is the rebalancer's tm_rebalancer_move_limit from its /metrics (0 if unread).
func (h *harness) moveLimit() int {
	code, body := h.call(http.MethodGet, h.rebURL+"/metrics")
	if code != http.StatusOK {
		return 0
	}
	for _, line := range strings.Split(string(body), "\n") {
		if v, ok := strings.CutPrefix(line, "tm_rebalancer_move_limit "); ok {
			f, _ := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return int(f)
		}
	}
	return 0
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

// routeOf is the path prefix each kind serves (as the shard groups' instances route it).
func routeOf(kind string) string { return "/" + kind + "/" }
