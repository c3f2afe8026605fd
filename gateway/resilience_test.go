package gateway

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/gateway/breaker"
	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

type testClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *testClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *testClock) Add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func (e *env) circuit(key string) string {
	e.t.Helper()
	for _, in := range e.gw.balance().Instances {
		if in.Instance == key {
			return in.Circuit.State
		}
	}
	e.t.Fatalf("instance %s not in /admin/balance", key)
	return ""
}

// TestRetriesAndBreaker: requests skip an instance that refuses connections (even a POST, which
// provably never reached it) and one that drops them (GET only); the dropping instance's circuit
// opens after 3 failures, half-opens after 5s, and closes on a successful probe.
func TestRetriesAndBreaker(t *testing.T) {
	clock := &testClock{t: time.Unix(1_000_000, 0)}
	var good, flaky, dead *backend
	deadURL := ""
	e := newEnv(t, Config{Breaker: breaker.Config{Now: clock.Now}}, nil, func(e *env) {
		good = newBackend(t, "aggregate", "aggregate-1", "good")
		flaky = newBackend(t, "aggregate", "aggregate-1", "flaky")
		dead = newBackend(t, "aggregate", "aggregate-1", "dead")
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		deadURL = "http://" + ln.Addr().String()
		ln.Close() // nothing listens: connection refused
		e.register(good, "", 10, aggRoute)
		e.register(flaky, "", 10, aggRoute)
		e.register(dead, deadURL, 10, aggRoute)
		e.place("aggregate", "t1", "aggregate-1")
	})
	dropping := func(w http.ResponseWriter, r *http.Request) {
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			conn.Close()
		}
	}
	flaky.setHandler(dropping)
	for i := range 20 {
		method, body := "GET", ""
		if i%2 == 1 {
			method, body = "POST", fmt.Sprintf(`{"i":%d}`, i)
		}
		resp, got := e.do(method, "/agg/x", "t1", body, nil)
		if method == "POST" && resp.StatusCode == 502 {
			continue // a POST dropped by flaky may have reached it: not replayed
		}
		if resp.StatusCode != 200 || got != good.id.Key() {
			t.Fatalf("%s %d: status %d from %q", method, i, resp.StatusCode, got)
		}
	}
	if st := e.circuit(dead.id.Key()); st != "open" {
		t.Fatalf("dead instance circuit %s, want open", st)
	}
	if st := e.circuit(flaky.id.Key()); st != "open" {
		t.Fatalf("flaky instance circuit %s, want open", st)
	}
	// Open circuits are skipped: nothing more reaches flaky.
	before, _ := flaky.requests()
	for range 10 {
		if resp, got := e.do("GET", "/agg/x", "t1", "", nil); resp.StatusCode != 200 || got != good.id.Key() {
			t.Fatalf("with open circuits: %d from %q", resp.StatusCode, got)
		}
	}
	if after, _ := flaky.requests(); len(after) != len(before) {
		t.Fatalf("open circuit let %d requests through", len(after)-len(before))
	}
	// 5s later the circuit is half-open; flaky recovered, so its probe succeeds and closes it.
	flaky.setHandler(nil)
	clock.Add(5 * time.Second)
	if st := e.circuit(flaky.id.Key()); st != "half-open" {
		t.Fatalf("after 5s circuit %s, want half-open", st)
	}
	for i := 0; e.circuit(flaky.id.Key()) != "closed"; i++ {
		if i == 200 {
			t.Fatal("probe never went to the half-open instance")
		}
		if resp, _ := e.do("GET", "/agg/x", "t1", "", nil); resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	// dead probed and failed again: its wait doubled.
	for _, in := range e.gw.balance().Instances {
		if in.Instance == dead.id.Key() && in.Circuit.State != "closed" && in.Circuit.Wait != 10*time.Second && in.Circuit.Wait != 5*time.Second {
			t.Fatalf("dead circuit %+v", in.Circuit)
		}
	}
	_, metrics := e.do("GET", "/metrics", "", "", nil)
	for _, m := range []string{`reason="unreachable"`, `reason="failed"`, `tm_gateway_circuit_state{instance="aggregate.aggregate-1.good"} 0`} {
		if !strings.Contains(metrics, m) {
			t.Errorf("metrics lack %s", m)
		}
	}
}

// TestHoldDuringHandoff: requests for a tenant in handoff are held and reach the new owner after
// commit, in order, with no error; past the per-tenant bound they get 503 at once; past the
// kind's hold budget 503 with Retry-After.
func TestHoldDuringHandoff(t *testing.T) {
	briefRoute := schema.Route{Method: "*", Prefix: "/brief/", Kind: "brief"}
	readerRoute := schema.Route{Method: "*", Prefix: "/reader/", Kind: "reader"}
	var a, b, br, rd *backend
	e := newEnv(t, Config{Hold: HoldLimits{PerTenant: 5}}, []schema.KindConfig{
		{Kind: "aggregate", HoldBudget: schema.Duration(20 * time.Second)},
		{Kind: "brief", HoldBudget: schema.Duration(300 * time.Millisecond)},
		{Kind: "reader", Overlap: true, HoldBudget: schema.Duration(100 * time.Millisecond)},
	}, func(e *env) {
		rd = newBackend(t, "reader", "reader-1", "i1")
		e.register(rd, "", 10, readerRoute)
		e.place("reader", "t1", "reader-1")
		a = newBackend(t, "aggregate", "aggregate-1", "i1")
		b = newBackend(t, "aggregate", "aggregate-2", "i1")
		br = newBackend(t, "brief", "brief-1", "i1")
		e.register(a, "", 10, aggRoute)
		e.register(b, "", 10, aggRoute)
		e.register(br, "", 10, briefRoute)
		e.place("aggregate", "t1", "aggregate-1")
		e.place("brief", "t1", "brief-1")
	})
	e.move("aggregate", "t1", func(p *schema.Placement) { p.Phase, p.Target = schema.PhaseWarming, "aggregate-2" })
	e.move("aggregate", "t1", func(p *schema.Placement) { p.Phase = schema.PhaseHandoff })
	e.waitPhase("aggregate", "t1", schema.PhaseHandoff)

	type result struct {
		i      int
		status int
		by     string
	}
	results := make(chan result, 5)
	for i := range 5 {
		go func() {
			resp, _ := e.do("POST", "/agg/cmd", "t1", fmt.Sprintf("cmd-%d", i), nil)
			results <- result{i, resp.StatusCode, resp.Header.Get(tmhttp.HeaderServedBy)}
		}()
		// Send the next only once this one is held, so arrival order is known.
		eventually(t, 10*time.Second, fmt.Sprintf("request %d held", i), func() bool {
			n, _, _ := e.gw.holds.stats()
			return n == i+1
		})
	}
	// The sixth is over the per-tenant bound: 503 at once.
	resp, body := e.do("POST", "/agg/cmd", "t1", "overflow", nil)
	if p := problem(t, resp, body); p.Status != 503 || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("overflow: %+v", p)
	}
	// Commit: aggregate-2 owns t1 at epoch 2.
	e.move("aggregate", "t1", func(p *schema.Placement) {
		p.Phase, p.Shard, p.Source, p.Target, p.Epoch = schema.PhaseDraining, "aggregate-2", "aggregate-1", "", p.Epoch+1
	})
	for range 5 {
		select {
		case r := <-results:
			if r.status != 200 || r.by != b.id.Key() {
				t.Fatalf("held request %d: status %d by %q", r.i, r.status, r.by)
			}
		case <-time.After(15 * time.Second):
			t.Fatal("held requests not released within 15s of commit")
		}
	}
	reqs, bodies := b.requests()
	for i := range 5 {
		if bodies[i] != fmt.Sprintf("cmd-%d", i) || reqs[i].Header.Get(tmhttp.HeaderEpoch) != "2" {
			t.Fatalf("new owner saw, in order, %q (epoch %s)", bodies, reqs[i].Header.Get(tmhttp.HeaderEpoch))
		}
	}
	if got, _ := a.requests(); len(got) != 0 {
		t.Fatalf("old owner got %d requests during the handoff", len(got))
	}

	// Budget expiry: brief holds for 300ms only.
	e.move("brief", "t1", func(p *schema.Placement) { p.Phase, p.Target = schema.PhaseWarming, "brief-2" })
	e.move("brief", "t1", func(p *schema.Placement) { p.Phase = schema.PhaseHandoff })
	e.waitPhase("brief", "t1", schema.PhaseHandoff)
	resp, body = e.do("GET", "/brief/x", "t1", "", nil)
	if p := problem(t, resp, body); p.Status != 503 || resp.Header.Get("Retry-After") != "1" || p.Type != tmhttp.TypeBase+"tenant-moving" {
		t.Fatalf("expiry: %+v retry-after %q", p, resp.Header.Get("Retry-After"))
	}
	// Abort: the move is called off; held requests go to the old owner.
	done := make(chan int, 1)
	go func() {
		resp, _ := e.do("GET", "/brief/x", "t1", "", nil)
		done <- resp.StatusCode
	}()
	eventually(t, 10*time.Second, "request held", func() bool { n, _, _ := e.gw.holds.stats(); return n == 1 })
	e.move("brief", "t1", func(p *schema.Placement) { p.Phase, p.Target = schema.PhaseActive, "" })
	if code := <-done; code != 200 {
		t.Fatalf("after abort: %d", code)
	}

	// A kind that only reads (overlap) is not held: it is served by the owner during handoff.
	e.move("reader", "t1", func(p *schema.Placement) { p.Phase, p.Target = schema.PhaseWarming, "reader-2" })
	e.move("reader", "t1", func(p *schema.Placement) { p.Phase = schema.PhaseHandoff })
	e.waitPhase("reader", "t1", schema.PhaseHandoff)
	if resp, body := e.do("GET", "/reader/x", "t1", "", nil); resp.StatusCode != 200 || body != rd.id.Key() {
		t.Fatalf("overlap kind in handoff: %d %q", resp.StatusCode, body)
	}

	_, metrics := e.do("GET", "/metrics", "", "", nil)
	for _, m := range []string{
		`tm_gateway_hold_total{kind="aggregate",outcome="released"} 5`,
		`tm_gateway_hold_total{kind="aggregate",outcome="overflow"} 1`,
		`tm_gateway_hold_total{kind="brief",outcome="expired"} 1`,
		`tm_gateway_hold_total{kind="brief",outcome="aborted"} 1`,
		`tm_gateway_hold_queued 0`,
	} {
		if !strings.Contains(metrics, m) {
			t.Errorf("metrics lack %s", m)
		}
	}
}

// TestStaticStability: with NATS stopped the gateway keeps routing from its snapshot, stays
// ready, reports the snapshot's age, and resyncs when NATS returns.
func TestStaticStability(t *testing.T) {
	var a, b *backend
	e := newEnv(t, Config{}, nil, func(e *env) {
		a = newBackend(t, "aggregate", "aggregate-1", "i1")
		b = newBackend(t, "aggregate", "aggregate-2", "i1")
		e.register(a, "", 10, aggRoute)
		e.register(b, "", 10, aggRoute)
		e.place("aggregate", "t1", "aggregate-1")
	})
	e.waitServedBy("/agg/x", "t1", a.id.Key())
	cfg := e.nats.Config()
	e.nats.Stop()

	readyz := func() (int, Readiness) {
		resp, body := e.do("GET", "/readyz", "", "", nil)
		var rd Readiness
		if err := jsonUnmarshal(body, &rd); err != nil {
			t.Fatalf("readyz body %q: %v", body, err)
		}
		return resp.StatusCode, rd
	}
	eventually(t, 15*time.Second, "readyz to report staleness", func() bool {
		code, rd := readyz()
		if code != 200 || !rd.Ready {
			t.Fatalf("readyz %d %+v while NATS is down", code, rd)
		}
		return rd.Stale && rd.SnapshotAgeSeconds > 0 && !rd.NATSConnected
	})
	for range 20 {
		if resp, got := e.do("GET", "/agg/x", "t1", "", nil); resp.StatusCode != 200 || got != a.id.Key() {
			t.Fatalf("with NATS down: %d from %q", resp.StatusCode, got)
		}
	}
	_, metrics := e.do("GET", "/metrics", "", "", nil)
	if strings.Contains(metrics, "tm_gateway_snapshot_staleness_seconds 0\n") || !strings.Contains(metrics, "tm_gateway_snapshot_staleness_seconds") {
		t.Fatal("staleness metric does not show the outage")
	}

	e.nats = natstest.Restart(t, cfg)
	eventually(t, 20*time.Second, "readyz fresh again", func() bool {
		_, rd := readyz()
		return !rd.Stale && rd.NATSConnected
	})
	// Resynced: a change made after NATS came back is followed.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var err error
	for ctx.Err() == nil { // the store's connection may still be reconnecting
		var p schema.Placement
		if p, err = e.st.Placements("aggregate").Get(ctx, "t1"); err == nil {
			next := p
			next.Shard, next.Epoch = "aggregate-2", p.Epoch+1
			if _, err = e.st.Placements(next.Kind).Update(ctx, p, next); err == nil {
				break
			}
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	e.waitServedBy("/agg/x", "t1", b.id.Key())
}

// TestGracefulShutdown: stopping the gateway lets an in-flight request finish.
func TestGracefulShutdown(t *testing.T) {
	var a *backend
	e := newEnv(t, Config{}, nil, func(e *env) {
		a = newBackend(t, "aggregate", "aggregate-1", "i1")
		e.register(a, "", 10, aggRoute)
		e.place("aggregate", "t1", "aggregate-1")
	})
	entered, release := make(chan struct{}), make(chan struct{})
	a.setHandler(func(w http.ResponseWriter, r *http.Request) {
		close(entered)
		<-release
		_, _ = w.Write([]byte("finished"))
	})
	type res struct {
		code int
		body string
	}
	got := make(chan res, 1)
	go func() {
		resp, body := e.do("GET", "/agg/x", "t1", "", nil)
		got <- res{resp.StatusCode, body}
	}()
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("request never reached the shard")
	}
	stopped := make(chan error, 1)
	go func() { stopped <- e.stop() }()
	// The gateway is shutting down but waits for the request.
	select {
	case err := <-stopped:
		t.Fatalf("gateway stopped with a request in flight: %v", err)
	case <-time.After(100 * time.Millisecond): // bounded look for a premature stop
	}
	close(release)
	if r := <-got; r.code != 200 || r.body != "finished" {
		t.Fatalf("in-flight request: %d %q", r.code, r.body)
	}
	if err := <-stopped; err != nil {
		t.Fatal(err)
	}
}

// TestMoveUnderLoad: concurrent clients keep sending while a tenant moves A -> B through every
// phase; no request fails, and once the commit is applied nothing more reaches A.
func TestMoveUnderLoad(t *testing.T) {
	var a, b *backend
	e := newEnv(t, Config{}, []schema.KindConfig{{Kind: "aggregate", HoldBudget: schema.Duration(10 * time.Second)}}, func(e *env) {
		a = newBackend(t, "aggregate", "aggregate-1", "i1")
		b = newBackend(t, "aggregate", "aggregate-2", "i1")
		e.register(a, "", 10, aggRoute)
		e.register(b, "", 10, aggRoute)
		e.place("aggregate", "t1", "aggregate-1")
	})
	stop := make(chan struct{})
	var wg sync.WaitGroup
	failures := make(chan string, 64)
	for c := range 6 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				resp, body := e.do("POST", "/agg/cmd", "t1", fmt.Sprintf("c%d-%d", c, i), nil)
				if resp.StatusCode != 200 {
					failures <- fmt.Sprintf("client %d request %d: %d %s", c, i, resp.StatusCode, body)
					return
				}
			}
		})
	}
	e.move("aggregate", "t1", func(p *schema.Placement) { p.Phase, p.Target = schema.PhaseWarming, "aggregate-2" })
	e.move("aggregate", "t1", func(p *schema.Placement) { p.Phase = schema.PhaseHandoff })
	e.waitPhase("aggregate", "t1", schema.PhaseHandoff)
	eventually(t, 10*time.Second, "requests held", func() bool { n, _, _ := e.gw.holds.stats(); return n > 0 })
	e.move("aggregate", "t1", func(p *schema.Placement) {
		p.Phase, p.Shard, p.Source, p.Target, p.Epoch = schema.PhaseDraining, "aggregate-2", "aggregate-1", "", p.Epoch+1
	})
	e.waitPhase("aggregate", "t1", schema.PhaseDraining)
	eventually(t, 10*time.Second, "backlog sent", func() bool { n, _, _ := e.gw.holds.stats(); return n == 0 })
	reqsA, _ := a.requests()
	e.move("aggregate", "t1", func(p *schema.Placement) { p.Phase, p.Source = schema.PhaseActive, "" })
	e.waitPhase("aggregate", "t1", schema.PhaseActive)
	// Some more traffic after the move.
	before, _ := b.requests()
	eventually(t, 10*time.Second, "traffic on the new owner", func() bool { r, _ := b.requests(); return len(r) > len(before)+20 })
	close(stop)
	wg.Wait()
	close(failures)
	for f := range failures {
		t.Error(f)
	}
	if after, _ := a.requests(); len(after) != len(reqsA) {
		t.Fatalf("old owner got %d requests after the commit was applied", len(after)-len(reqsA))
	}
	reqsB, _ := b.requests()
	for _, r := range reqsB {
		if r.Header.Get(tmhttp.HeaderEpoch) != "2" {
			t.Fatalf("new owner saw epoch %s", r.Header.Get(tmhttp.HeaderEpoch))
		}
	}
}

// A POST whose attempt broke after it was sent (the instance may have applied it) is sent again
// on another instance only when it carries an Idempotency-Key and its kind declares that its
// services honour the key (KindConfig.Idempotent): the client gets one answer. Otherwise the
// gateway answers 502 and the client decides. Any request to a kind that only reads
// (KindConfig.Overlap, the projection's queries) is sent again, key or not.
func TestIdempotentRequestsReplayed(t *testing.T) {
	kinds := []string{"keyed", "plain", "reads"}
	var drop, good map[string]*backend
	e := newEnv(t, Config{}, []schema.KindConfig{{Kind: "keyed", Idempotent: true}, {Kind: "plain"}, {Kind: "reads", Overlap: true}}, func(e *env) {
		drop, good = map[string]*backend{}, map[string]*backend{}
		for _, kind := range kinds {
			route := schema.Route{Method: "*", Prefix: "/" + kind + "/", Kind: kind}
			drop[kind] = newBackend(t, kind, kind+"-1", "drop")
			good[kind] = newBackend(t, kind, kind+"-1", "good")
			e.register(drop[kind], "", 10, route)
			e.register(good[kind], "", 10, route)
			e.place(kind, "t1", kind+"-1")
		}
	})
	for _, b := range drop {
		b.setHandler(func(w http.ResponseWriter, r *http.Request) { // applied, then the answer is lost
			if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
				conn.Close()
			}
		})
	}
	for _, kind := range kinds {
		failed := 0
		for i := 0; ; i++ {
			if seen, _ := drop[kind].requests(); len(seen) > 0 || i == 50 {
				break // the dropping instance had a request: the case this test is about
			}
			hdr := map[string]string{"Idempotency-Key": fmt.Sprintf("k%d", i)}
			if kind == "reads" {
				hdr = nil
			}
			resp, _ := e.do("POST", "/"+kind+"/cmd", "t1", fmt.Sprintf(`{"i":%d}`, i), hdr)
			if resp.StatusCode == http.StatusBadGateway {
				failed++
			} else if resp.StatusCode != 200 {
				t.Fatalf("%s: status %d", kind, resp.StatusCode)
			}
		}
		seen, _ := drop[kind].requests()
		if len(seen) == 0 {
			t.Fatalf("%s: no request reached the dropping instance in 50", kind)
		}
		switch {
		case kind == "keyed" && failed != 0:
			t.Errorf("keyed: %d answers were 502; a keyed request to an idempotent kind is replayed", failed)
		case kind == "reads" && failed != 0:
			t.Errorf("reads: %d answers were 502; any request to a kind that only reads is replayed", failed)
		case kind == "plain" && failed != len(seen):
			t.Errorf("plain: %d answers were 502 for %d requests that broke; a POST to a kind that does not declare Idempotent is not replayed", failed, len(seen))
		}
	}
	_, metrics := e.do("GET", "/metrics", "", "", nil)
	for _, reason := range []string{"idempotent", "read"} {
		if !strings.Contains(metrics, `reason="`+reason+`"`) {
			t.Errorf(`metrics lack reason=%q`, reason)
		}
	}
}

// A takeover abandons its tenant's requests under way at the former owner (frozen here: it
// never answers), and only its tenant's: a GET goes to the new owner once the takeover
// commits, a POST (its outcome unknown) fails at once; another tenant's request to the same
// shard stays until its own takeover, however soon after that comes.
func TestTakeoverAbandonsItsTenantsRequests(t *testing.T) {
	var frozen, b *backend
	unfreeze := make(chan struct{})
	e := newEnv(t, Config{}, []schema.KindConfig{{Kind: "aggregate", HoldBudget: schema.Duration(20 * time.Second),
		UpstreamTimeout: schema.Duration(time.Minute)}}, func(e *env) {
		frozen = newBackend(t, "aggregate", "aggregate-1", "i1")
		b = newBackend(t, "aggregate", "aggregate-2", "i1")
		e.register(frozen, "", 10, aggRoute)
		e.register(b, "", 10, aggRoute)
		e.place("aggregate", "t1", "aggregate-1")
		e.place("aggregate", "t2", "aggregate-1")
	})
	defer close(unfreeze)
	frozen.setHandler(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-unfreeze:
		case <-r.Context().Done():
		}
	})
	type answer struct {
		status int
		by     string
		err    error
	}
	send := func(method, tenant string) <-chan answer {
		ch := make(chan answer, 1)
		req, _ := http.NewRequest(method, e.url+"/agg/x", nil)
		req.Header.Set(tmhttp.HeaderTenant, tenant)
		go func() {
			resp, err := e.client.Do(req)
			if err != nil {
				ch <- answer{err: err}
				return
			}
			resp.Body.Close()
			ch <- answer{status: resp.StatusCode, by: resp.Header.Get(tmhttp.HeaderServedBy)}
		}()
		return ch
	}
	get1, post2 := send("GET", "t1"), send("POST", "t2")
	eventually(t, 10*time.Second, "both requests at the frozen instance", func() bool {
		seen, _ := frozen.requests()
		return len(seen) == 2
	})
	takeover := func(tenant string) {
		e.move("aggregate", tenant, func(p *schema.Placement) { p.Phase, p.Target = schema.PhaseTakeover, "aggregate-2" })
	}
	takeover("t1")
	e.waitPhase("aggregate", "t1", schema.PhaseTakeover)
	select {
	case a := <-post2:
		t.Fatalf("t2's request ended at t1's takeover: %+v", a)
	case a := <-get1:
		t.Fatalf("t1's GET answered before its takeover committed: %+v", a)
	case <-time.After(200 * time.Millisecond): // t1's GET is held, t2's POST still at the frozen instance
	}
	takeover("t2") // at once: no throttle may leave it hanging
	select {
	case a := <-post2:
		if a.status != http.StatusBadGateway {
			t.Fatalf("t2's abandoned POST: %+v, want 502 (its outcome is unknown)", a)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("t2's POST to the frozen instance was not abandoned at its takeover")
	}
	e.move("aggregate", "t1", func(p *schema.Placement) {
		p.Phase, p.Shard, p.Target, p.Epoch = schema.PhaseActive, "aggregate-2", "", p.Epoch+1
	})
	select {
	case a := <-get1:
		if a.status != http.StatusOK || a.by != b.id.Key() {
			t.Fatalf("t1's abandoned GET: %+v, want 200 from the new owner", a)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("t1's GET was not answered by the new owner after the commit")
	}
}

// An instance whose process is replaced (it registers again under its key, restarted at a new
// address) gets a closed circuit: the failures that opened it were the old process's. With the
// breaker's clock stopped, only the new registration can close it.
func TestReplacedInstanceClosesItsCircuit(t *testing.T) {
	clock := &testClock{t: time.Unix(1_000_000, 0)}
	id := schema.InstanceID{Kind: "aggregate", Shard: "aggregate-1", Instance: "a"}
	e := newEnv(t, Config{Breaker: breaker.Config{Now: clock.Now}}, nil, func(e *env) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		deadURL := "http://" + ln.Addr().String()
		ln.Close() // the killed process: nothing listens
		if _, err := e.st.Directory().Register(context.Background(), schema.Instance{InstanceID: id, URL: deadURL, Capacity: 10}); err != nil {
			t.Fatal(err)
		}
		if _, err := e.st.Routes().AddInstance(context.Background(), aggRoute, id); err != nil {
			t.Fatal(err)
		}
		e.place("aggregate", "t1", "aggregate-1")
	})
	for i := 0; e.circuit(id.Key()) != "open"; i++ {
		if i == 20 {
			t.Fatal("the dead instance's circuit did not open in 20 requests")
		}
		if resp, _ := e.do("GET", "/agg/x", "t1", "", nil); resp.StatusCode < 500 {
			t.Fatalf("a request to the dead instance: %d", resp.StatusCode)
		}
	}
	restarted := newBackend(t, "aggregate", "aggregate-1", "a")
	e.register(restarted, "", 10)
	eventually(t, 10*time.Second, "the replaced instance's circuit closed", func() bool { return e.circuit(id.Key()) == "closed" })
	if resp, got := e.do("GET", "/agg/x", "t1", "", nil); resp.StatusCode != 200 || got != id.Key() {
		t.Fatalf("the restarted instance: %d from %q", resp.StatusCode, got)
	}
}

// TestConnectTimeoutIsUnreachable: a connect that times out (SYNs dropped across a partition)
// reached nothing, so it is sent again to another instance even for a POST, and with none left
// answered 503 upstream-unreachable with Retry-After, never 504 (the fault harness's 2|1 split
// found those answered as upstream timeouts).
func TestConnectTimeoutIsUnreachable(t *testing.T) {
	var good, cut, cut3 *backend
	hole := tmtest.Unaccepted(t)
	e := newEnv(t, Config{ConnectTimeout: 200 * time.Millisecond}, nil, func(e *env) {
		good = newBackend(t, "aggregate", "aggregate-1", "good")
		cut = newBackend(t, "aggregate", "aggregate-2", "cut")
		cut3 = newBackend(t, "aggregate", "aggregate-1", "cut-3")
		e.register(good, "", 10, aggRoute)
		e.register(cut3, "http://"+hole, 10, aggRoute)
		e.register(cut, "http://"+hole, 10, aggRoute)
		e.register(newBackend(t, "aggregate", "aggregate-2", "cut-too"), "http://"+hole, 10, aggRoute)
		for i := range 20 {
			e.place("aggregate", fmt.Sprintf("t1-%d", i), "aggregate-1")
		}
		e.place("aggregate", "t2", "aggregate-2")
	})
	// aggregate-2's only instances cannot be reached: answered 503 with Retry-After.
	resp, body := e.do("POST", "/agg/x", "t2", `{"n":1}`, nil)
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" ||
		!strings.Contains(body, "upstream-unreachable") && !strings.Contains(body, "no-live-instance") {
		t.Fatalf("a POST to a shard whose instances cannot be reached: %d %s", resp.StatusCode, body)
	}
	// A shard with a reachable instance beside an unreachable one serves, whichever it tries
	// first (an instance is picked by tenant: 20 tenants).
	// Until the unreachable one's circuit opens: three POSTs went to it first, and on.
	for i := 0; e.circuit(cut3.id.Key()) != "open"; i++ {
		if i == 100 {
			t.Fatalf("100 POSTs and the unreachable instance's circuit is not open: never tried? %+v", e.gw.balance().Instances)
		}
		if resp, got := e.do("POST", "/agg/x", fmt.Sprintf("t1-%d", i%20), fmt.Sprintf(`{"i":%d}`, i), nil); resp.StatusCode != 200 || got != good.id.Key() {
			t.Fatalf("POST %d beside an unreachable instance: %d %q", i, resp.StatusCode, got)
		}
	}
}

// TestUnplacedWhileCutOff: a kind that refuses unplaced tenants answers a tenant missing from
// a view that cannot follow its placements (the gateway cut off from NATS) 503 with
// Retry-After, not the final 404: the tenant may have been placed where the view cannot see.
func TestUnplacedWhileCutOff(t *testing.T) {
	strictRoute := schema.Route{Method: "POST", Prefix: "/strict/", Kind: "strict"}
	e := newEnv(t, Config{}, []schema.KindConfig{{Kind: "strict", Unplaced: schema.UnplacedReject}}, func(e *env) {
		e.register(newBackend(t, "strict", "strict-1", "i1"), "", 10, strictRoute)
	})
	if resp, body := e.do("POST", "/strict/x", "newcomer", "{}", nil); resp.StatusCode != http.StatusNotFound {
		t.Fatalf("an unplaced tenant while following: %d %s", resp.StatusCode, body)
	}
	e.nats.Stop()
	eventually(t, 20*time.Second, "the gateway to notice it is cut off", func() bool {
		return e.gw.reg.snap.Load().kinds["strict"].cutOff()
	})
	resp, body := e.do("POST", "/strict/x", "newcomer", "{}", nil)
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" || !strings.Contains(body, "placements-unfollowed") {
		t.Fatalf("an unplaced tenant while cut off: %d %s", resp.StatusCode, body)
	}
}
