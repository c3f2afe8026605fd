package gateway

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

var aggRoute = schema.Route{Method: "*", Prefix: "/agg/", Kind: "aggregate"}

// TestRequestPath covers the request path end to end: tenant validation, longest-prefix and
// method routing, headers added and spoofed ones stripped, the unplaced rules, and routing that
// follows a placement change.
func TestRequestPath(t *testing.T) {
	t.Run("front end", func(t *testing.T) { testRequestPath(t, Config{}) })
	t.Run("net/http front end", func(t *testing.T) { testRequestPath(t, Config{stdFrontEnd: true}) })
}

func testRequestPath(t *testing.T, cfg Config) {
	strictRoute := schema.Route{Method: "POST", Prefix: "/agg/cmd/", Kind: "strict"}
	var a1, b1, s1 *backend
	e := newEnv(t, cfg, []schema.KindConfig{{Kind: "strict", Unplaced: schema.UnplacedReject}}, func(e *env) {
		a1 = newBackend(t, "aggregate", "aggregate-1", "i1")
		b1 = newBackend(t, "aggregate", "aggregate-2", "i1")
		s1 = newBackend(t, "strict", "strict-1", "i1")
		e.register(a1, "", 10, aggRoute)
		e.register(b1, "", 10, aggRoute)
		e.register(s1, "", 10, strictRoute)
		e.place("aggregate", "t1", "aggregate-1")
	})

	t.Run("routes and sets headers", func(t *testing.T) {
		resp, body := e.do("GET", "/agg/items?x=1", "t1", "", map[string]string{
			"Traceparent":  "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
			"X-Request-Id": "req-42",
			// Spoofed tenantmesh headers: none may reach a shard.
			"X-Tm-Epoch": "999", "x-tm-shard": "aggregate-2", "X-TM-Forged": "1", "X-Tm-Kind": "runner",
		})
		if resp.StatusCode != 200 || body != a1.id.Key() {
			t.Fatalf("status %d body %q, want 200 from %s", resp.StatusCode, body, a1.id.Key())
		}
		if got := resp.Header.Get(tmhttp.HeaderServedBy); got != a1.id.Key() {
			t.Fatalf("x-served-by = %q", got)
		}
		reqs, _ := a1.requests()
		r := reqs[len(reqs)-1]
		want := map[string]string{
			tmhttp.HeaderEpoch: "1", tmhttp.HeaderShard: "aggregate-1", tmhttp.HeaderKind: "aggregate",
			tmhttp.HeaderTenant: "t1", tmhttp.HeaderRequestID: "req-42",
			tmhttp.HeaderTraceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		}
		for k, v := range want {
			if got := r.Header.Values(k); len(got) != 1 || got[0] != v {
				t.Errorf("shard saw %s = %q, want [%q]", k, got, v)
			}
		}
		if r.Header.Get("X-Tm-Forged") != "" {
			t.Error("spoofed X-Tm-Forged reached the shard")
		}
		if r.URL.RawQuery != "x=1" || r.URL.Path != "/agg/items" {
			t.Errorf("shard saw %s", r.URL)
		}
	})

	t.Run("generates a request id", func(t *testing.T) {
		resp, _ := e.do("GET", "/agg/x", "t1", "", nil)
		id := resp.Header.Get(tmhttp.HeaderRequestID)
		reqs, _ := a1.requests()
		if id == "" || reqs[len(reqs)-1].Header.Get(tmhttp.HeaderRequestID) != id {
			t.Fatalf("request id %q not generated and passed on", id)
		}
	})

	t.Run("400 bad tenant", func(t *testing.T) {
		for _, tenant := range []string{"", "bad tenant!", "a.b", strings.Repeat("a", 129)} {
			hdr := map[string]string{}
			resp, body := e.do("GET", "/agg/x", "", "", hdr)
			if tenant != "" {
				req, _ := http.NewRequest("GET", e.url+"/agg/x", nil)
				req.Header[tmhttp.HeaderTenant] = []string{tenant}
				var err error
				if resp, err = e.client.Do(req); err != nil {
					t.Fatal(err)
				}
				var p tmhttp.Problem
				_ = json.NewDecoder(resp.Body).Decode(&p)
				resp.Body.Close()
				if resp.StatusCode != 400 || p.Status != 400 {
					t.Fatalf("tenant %q: status %d %+v", tenant, resp.StatusCode, p)
				}
				continue
			}
			if p := problem(t, resp, body); p.Status != 400 || p.Type != tmhttp.TypeBase+"invalid-tenant" {
				t.Fatalf("missing tenant: %+v", p)
			}
		}
	})

	t.Run("404 no route", func(t *testing.T) {
		resp, body := e.do("GET", "/nowhere", "t1", "", nil)
		if p := problem(t, resp, body); p.Status != 404 || p.Type != tmhttp.TypeBase+"no-route" {
			t.Fatalf("%+v", p)
		}
	})

	t.Run("longest prefix and method", func(t *testing.T) {
		// POST /agg/cmd/ is the strict kind, which rejects unplaced tenants.
		resp, body := e.do("POST", "/agg/cmd/1", "t1", "{}", nil)
		if p := problem(t, resp, body); p.Status != 404 || p.Type != tmhttp.TypeBase+"tenant-not-placed" || p.Kind != "strict" || p.Tenant != "t1" {
			t.Fatalf("%+v", p)
		}
		e.place("strict", "t1", "strict-1")
		e.waitServedBy("/agg/cmd/1", "t1", a1.id.Key()) // GET falls through to /agg/
		eventually(t, 10*time.Second, "strict placement", func() bool {
			resp, body := e.do("POST", "/agg/cmd/1", "t1", "{}", nil)
			return resp.StatusCode == 200 && body == s1.id.Key()
		})
	})

	t.Run("assigns an unplaced tenant to the least-loaded shard", func(t *testing.T) {
		resp, body := e.do("GET", "/agg/x", "fresh", "", nil)
		// aggregate-1 holds t1; aggregate-2 is empty, so it gets the new tenant.
		if resp.StatusCode != 200 || body != b1.id.Key() {
			t.Fatalf("status %d body %q, want 200 from %s", resp.StatusCode, body, b1.id.Key())
		}
		p, err := e.st.Placements("aggregate").Get(context.Background(), "fresh")
		if err != nil || p.Shard != "aggregate-2" || p.Epoch != 1 || p.UpdatedBy == "" {
			t.Fatalf("stored placement %+v, %v", p, err)
		}
		ev, err := e.st.Audit().Read(context.Background(), schema.AuditQuery{Kind: "aggregate", Tenant: "fresh"})
		if err != nil || len(ev) != 1 || ev[0].Action != "placement.assign" {
			t.Fatalf("audit %+v, %v", ev, err)
		}
	})

	t.Run("follows a placement change", func(t *testing.T) {
		e.move("aggregate", "t1", func(p *schema.Placement) { p.Shard, p.Epoch = "aggregate-2", p.Epoch+1 })
		e.waitServedBy("/agg/x", "t1", b1.id.Key())
		reqs, _ := b1.requests()
		if got := reqs[len(reqs)-1].Header.Get(tmhttp.HeaderEpoch); got != "2" {
			t.Fatalf("epoch after move = %q, want 2", got)
		}
	})

	t.Run("hop-by-hop headers, forwarding headers, trailers", func(t *testing.T) {
		b1.setHandler(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Trailer", "X-Checksum")
			w.Header().Set("Connection", "X-Private")
			w.Header().Set("X-Private", "backend-only")
			w.WriteHeader(200)
			_, _ = io.WriteString(w, "part1")
			http.NewResponseController(w).Flush() // chunked, streamed
			_, _ = io.WriteString(w, "part2")
			w.Header().Set("X-Checksum", "abc")
		})
		defer b1.setHandler(nil)
		req, _ := http.NewRequest("GET", e.url+"/agg/x", nil)
		req.Header.Set(tmhttp.HeaderTenant, "t1")
		req.Header.Set("Connection", "X-Hop")
		req.Header.Set("X-Hop", "client-only")
		req.Header.Set("X-Forwarded-For", "6.6.6.6")
		resp, err := e.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(body) != "part1part2" || resp.Trailer.Get("X-Checksum") != "abc" || resp.Header.Get("X-Private") != "" {
			t.Fatalf("body %q trailer %v private %q", body, resp.Trailer, resp.Header.Get("X-Private"))
		}
		reqs, _ := b1.requests()
		got := reqs[len(reqs)-1].Header
		if got.Get("X-Hop") != "" || got.Get("X-Forwarded-For") != "127.0.0.1" || got.Get("X-Forwarded-Proto") != "http" || got.Get("User-Agent") != "Go-http-client/1.1" {
			t.Fatalf("shard saw %v", got)
		}
	})

	t.Run("skips draining instances", func(t *testing.T) {
		// A second instance of aggregate-2 reports draining: it gets no new requests.
		d := newBackend(t, "aggregate", "aggregate-2", "i2")
		if _, err := e.st.Directory().Register(context.Background(), schema.Instance{InstanceID: d.id, URL: d.URL, Capacity: 10, Reported: schema.StatusDraining}); err != nil {
			t.Fatal(err)
		}
		if _, err := e.st.Routes().AddInstance(context.Background(), aggRoute, d.id); err != nil {
			t.Fatal(err)
		}
		eventually(t, 10*time.Second, "draining instance in the directory", func() bool { return e.gw.reg.snap.Load().total == 4 })
		for range 20 {
			if resp, body := e.do("GET", "/agg/x", "t1", "", nil); resp.StatusCode != 200 || body != b1.id.Key() {
				t.Fatalf("%d from %q", resp.StatusCode, body)
			}
		}
		if reqs, _ := d.requests(); len(reqs) != 0 {
			t.Fatalf("draining instance got %d requests", len(reqs))
		}
		if err := e.st.Directory().Unregister(context.Background(), d.id); err != nil {
			t.Fatal(err)
		}
		eventually(t, 10*time.Second, "instance gone", func() bool { return e.gw.reg.snap.Load().total == 3 })
	})

	t.Run("admin endpoints", func(t *testing.T) {
		resp, body := e.do("GET", "/admin/placement/aggregate/t1", "", "", nil)
		var pl map[string]any
		if err := json.Unmarshal([]byte(body), &pl); err != nil || resp.StatusCode != 200 || pl["shard"] != "aggregate-2" {
			t.Fatalf("placement: %d %s", resp.StatusCode, body)
		}
		resp, body = e.do("GET", "/admin/balance", "", "", nil)
		var bal Balance
		if err := json.Unmarshal([]byte(body), &bal); err != nil || resp.StatusCode != 200 {
			t.Fatalf("balance: %d %s", resp.StatusCode, body)
		}
		if len(bal.Instances) != 3 || len(bal.Kinds["aggregate"].Shards) != 2 || bal.Instances[0].Circuit.State != "closed" {
			t.Fatalf("balance: %s", body)
		}
		for _, p := range []string{"/healthz", "/readyz", "/metrics"} {
			if resp, body := e.do("GET", p, "", "", nil); resp.StatusCode != 200 {
				t.Fatalf("%s: %d %s", p, resp.StatusCode, body)
			}
		}
		_, metrics := e.do("GET", "/metrics", "", "", nil)
		for _, m := range []string{`tm_gateway_requests_total{code="200",kind="aggregate"}`, "tm_gateway_circuit_state", "tm_gateway_snapshot_staleness_seconds 0"} {
			if !strings.Contains(metrics, m) {
				t.Errorf("metrics lack %s", m)
			}
		}
	})
}

// TestMisdirected: a shard answering 421 makes the gateway retry on the owner it names (or the
// watcher learns); the client never sees 421.
func TestMisdirected(t *testing.T) {
	var a, b *backend
	e := newEnv(t, Config{}, nil, func(e *env) {
		a = newBackend(t, "aggregate", "aggregate-1", "i1")
		b = newBackend(t, "aggregate", "aggregate-2", "i1")
		e.register(a, "", 10, aggRoute)
		e.register(b, "", 10, aggRoute)
		e.place("aggregate", "t1", "aggregate-1")
		e.place("aggregate", "t2", "aggregate-1")
	})
	// aggregate-1 lost t1 at epoch 2 (the gateway's watcher is "behind": placement still says 1).
	a.setHandler(func(w http.ResponseWriter, r *http.Request) {
		p := tmhttp.Problem{Type: tmhttp.TypeBase + "not-owner", Title: "Not the owner", Status: http.StatusMisdirectedRequest}
		if r.Header.Get(tmhttp.HeaderTenant) == "t1" {
			p.Owner, p.Epoch = "aggregate-2", 2
		}
		tmhttp.WriteProblem(w, r, p)
	})
	resp, body := e.do("POST", "/agg/cmd", "t1", `{"n":1}`, nil)
	if resp.StatusCode != 200 || body != b.id.Key() {
		t.Fatalf("status %d body %q, want 200 from %s", resp.StatusCode, body, b.id.Key())
	}
	reqs, bodies := b.requests()
	if got := reqs[0].Header.Get(tmhttp.HeaderEpoch); got != "2" || bodies[0] != `{"n":1}` {
		t.Fatalf("owner saw epoch %q body %q", got, bodies[0])
	}
	// t2: the shard names no owner and the watcher learns none: 503, never 421.
	resp, body = e.do("GET", "/agg/x", "t2", "", nil)
	if p := problem(t, resp, body); p.Status != 503 || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("%+v", p)
	}
	// Now the placement moves while the shard keeps answering 421: the watcher's news is used.
	e.move("aggregate", "t2", func(p *schema.Placement) { p.Shard, p.Epoch = "aggregate-2", p.Epoch+1 })
	eventually(t, 10*time.Second, "t2 on aggregate-2", func() bool {
		resp, _ := e.do("GET", "/agg/x", "t2", "", nil)
		if resp.StatusCode == 421 {
			t.Fatal("client saw 421")
		}
		return resp.StatusCode == 200 && resp.Header.Get(tmhttp.HeaderServedBy) == b.id.Key()
	})
}

// TestUpstreamErrors covers 429, 502, 503 and 504.
func TestUpstreamErrors(t *testing.T) {
	slowRoute := schema.Route{Method: "*", Prefix: "/slow/", Kind: "slow"}
	limRoute := schema.Route{Method: "*", Prefix: "/lim/", Kind: "limited"}
	var a, s, l *backend
	e := newEnv(t, Config{MaxBodyBytes: 4096, MaxReplayBody: 1024, MaxHeaderBytes: 8192}, []schema.KindConfig{
		{Kind: "slow", UpstreamTimeout: schema.Duration(200 * time.Millisecond)},
		{Kind: "limited", RateLimit: &schema.RateLimit{PerSecond: 0.01, Burst: 2}},
	}, func(e *env) {
		a = newBackend(t, "aggregate", "aggregate-1", "i1")
		s = newBackend(t, "slow", "slow-1", "i1")
		l = newBackend(t, "limited", "limited-1", "i1")
		e.register(a, "", 10, aggRoute)
		e.register(s, "", 10, slowRoute)
		e.register(l, "", 10, limRoute)
		e.place("aggregate", "t1", "aggregate-1")
		e.place("aggregate", "nowhere", "aggregate-9")
		e.place("slow", "t1", "slow-1")
		e.place("limited", "t1", "limited-1")
		e.place("limited", "t2", "limited-1")
	})

	t.Run("429", func(t *testing.T) {
		for i := range 2 {
			if resp, _ := e.do("GET", "/lim/x", "t1", "", nil); resp.StatusCode != 200 {
				t.Fatalf("request %d: %d", i, resp.StatusCode)
			}
		}
		resp, body := e.do("GET", "/lim/x", "t1", "", nil)
		if p := problem(t, resp, body); p.Status != 429 || resp.Header.Get("Retry-After") == "" || p.Tenant != "t1" {
			t.Fatalf("%+v", p)
		}
		// Per tenant: t2 has its own bucket.
		if resp, _ := e.do("GET", "/lim/x", "t2", "", nil); resp.StatusCode != 200 {
			t.Fatalf("t2: %d", resp.StatusCode)
		}
	})

	t.Run("limits", func(t *testing.T) {
		resp, body := e.do("POST", "/agg/cmd", "t1", strings.Repeat("x", 5000), nil)
		if p := problem(t, resp, body); p.Status != http.StatusRequestEntityTooLarge {
			t.Fatalf("body over the limit: %+v", p)
		}
		// Between the replay limit and the body limit: streamed, delivered whole.
		resp, body = e.do("POST", "/agg/cmd", "t1", strings.Repeat("y", 3000), nil)
		if _, bodies := a.requests(); resp.StatusCode != 200 || bodies[len(bodies)-1] != strings.Repeat("y", 3000) {
			t.Fatalf("streamed body: %d %q", resp.StatusCode, body)
		}
		if resp, _ := e.do("GET", "/agg/x", "t1", "", map[string]string{"X-Big": strings.Repeat("z", 16<<10)}); resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
			t.Fatalf("headers over the limit: %d", resp.StatusCode)
		}
	})

	t.Run("502", func(t *testing.T) {
		a.setHandler(func(w http.ResponseWriter, r *http.Request) {
			conn, _, err := http.NewResponseController(w).Hijack()
			if err == nil {
				conn.Close() // no answer at all
			}
		})
		defer a.setHandler(nil)
		_, before := a.requests()
		resp, body := e.do("POST", "/agg/cmd", "t1", "x", nil)
		if p := problem(t, resp, body); p.Status != 502 {
			t.Fatalf("%+v", p)
		}
		// A POST whose attempt may have reached the app is not replayed.
		if _, bodies := a.requests(); len(bodies)-len(before) != 1 {
			t.Fatalf("POST sent %d times", len(bodies)-len(before))
		}
	})

	t.Run("503 no live instance", func(t *testing.T) {
		resp, body := e.do("GET", "/agg/x", "nowhere", "", nil)
		if p := problem(t, resp, body); p.Status != 503 || resp.Header.Get("Retry-After") == "" || p.Kind != "aggregate" {
			t.Fatalf("%+v", p)
		}
	})

	t.Run("504", func(t *testing.T) {
		s.setHandler(func(w http.ResponseWriter, r *http.Request) {
			select {
			case <-r.Context().Done():
			case <-time.After(10 * time.Second):
			}
		})
		start := time.Now()
		resp, body := e.do("GET", "/slow/x", "t1", "", nil)
		if p := problem(t, resp, body); p.Status != 504 {
			t.Fatalf("%+v", p)
		}
		if el := time.Since(start); el > 5*time.Second {
			t.Fatalf("504 after %v; the kind's timeout is 200ms", el)
		}
	})

	_, metrics := e.do("GET", "/metrics", "", "", nil)
	for _, code := range []int{429, 502, 503, 504} {
		if !strings.Contains(metrics, `code="`+strconv.Itoa(code)+`"`) {
			t.Errorf("no request counted with code %d", code)
		}
	}
}
