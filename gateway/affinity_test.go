package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// The prerender manager's tests ("Tests": manager unit and integration tests) run here against a real
// gateway, a real embedded nats-server and fake prerender servers (real HTTP servers) that
// register through the gateway's HTTP registration API.

// fakeServer is a prerender server: GET / answers {ready:true}, /render answers its name.
type fakeServer struct {
	*httptest.Server
	name    string
	id      string // X-Prerender-Server-Id
	fail    atomic.Bool
	hang    atomic.Bool // /render answers only when the client gives up
	down    atomic.Bool // health check and everything else answer 503
	mu      sync.Mutex
	realms  []string
	healthy chan struct{} // receives (non-blocking) on each health check
}

func newFakeServer(t testing.TB, name string) *fakeServer {
	t.Helper()
	f := &fakeServer{name: name, healthy: make(chan struct{}, 64)}
	f.Server = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.Close)
	return f
}

func (f *fakeServer) serve(w http.ResponseWriter, r *http.Request) {
	if f.down.Load() {
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	if r.URL.Path == "/" {
		select {
		case f.healthy <- struct{}{}:
		default:
		}
		_, _ = io.WriteString(w, `{"ready":true}`)
		return
	}
	if f.fail.Load() {
		http.Error(w, "boom", http.StatusInternalServerError)
		return
	}
	if f.hang.Load() {
		// Read the body first: the server notices the client going away only after that.
		_, _ = io.Copy(io.Discard, r.Body)
		<-r.Context().Done()
		return
	}
	f.mu.Lock()
	f.realms = append(f.realms, r.Header.Get("X-Tenant-Id"))
	f.mu.Unlock()
	_, _ = io.WriteString(w, f.name)
}

func (f *fakeServer) port() int {
	u, _ := url.Parse(f.URL)
	p, _ := strconv.Atoi(u.Port())
	return p
}

func renderKind(m, defaultPort int, health time.Duration) schema.KindConfig {
	return schema.KindConfig{Kind: "render", Policy: schema.PolicyAffinity, Affinity: &schema.AffinityConfig{
		Multiplex: m, HealthInterval: schema.Duration(health), DefaultPort: defaultPort}}
}

// registerServer registers f with capacity through POST /prerender-servers and waits until the
// gateway routes to it.
func (e *env) registerServer(f *fakeServer, capacity int) {
	e.t.Helper()
	body := `{"data":{"type":"prerender-server","attributes":{"url":"` + f.URL + `","capacity":` + strconv.Itoa(capacity) + `,"meta":{"name":"` + f.name + `"}}}}`
	resp, b := e.do("POST", "/prerender-servers", "", body, map[string]string{"Content-Type": "application/vnd.api+json"})
	if resp.StatusCode != http.StatusNoContent {
		e.t.Fatalf("register %s: %d %s", f.name, resp.StatusCode, b)
	}
	f.id = resp.Header.Get(HeaderServerID)
	if f.id == "" {
		e.t.Fatal("no X-Prerender-Server-Id")
	}
	e.servers.Store(f.id, f)
	e.waitServer(f.id, true)
}

// waitServer waits until the gateway's route for /render does (or does not) include id.
func (e *env) waitServer(id string, present bool) {
	e.t.Helper()
	eventually(e.t, 10*time.Second, "server "+id+" routed="+strconv.FormatBool(present), func() bool {
		rt := e.gw.reg.snap.Load().match("POST", "/render")
		found := false
		if rt != nil {
			for _, l := range rt.byShard {
				for _, in := range l {
					found = found || in.key == id
				}
			}
		}
		return found == present
	})
}

// render proxies one request for realm and returns the status and the target header. A 200
// must name, in both the gateway's headers and the prerender manager's, the realm and the
// server that answered: the registered server whose answer (its name) the body is.
func (e *env) render(realm string) (int, string) {
	e.t.Helper()
	resp, body := e.do("POST", "/render", realm, `{"path":"/"}`, nil)
	tgt := resp.Header.Get(HeaderTarget)
	if resp.StatusCode == 200 {
		if resp.Header.Get(HeaderTargetTenant) != realm || resp.Header.Get(HeaderSeedRealm) != realm || resp.Header.Get(HeaderSeedTarget) != tgt {
			e.t.Fatalf("target headers %v", resp.Header)
		}
		f, ok := e.servers.Load(tgt)
		if !ok || body != f.(*fakeServer).name {
			e.t.Fatalf("%s names server %q, but the answer %q is not that server's", HeaderTarget, tgt, body)
		}
	}
	return resp.StatusCode, tgt
}

func (e *env) owners(realm string) []string {
	e.t.Helper()
	p, err := e.st.Placements("render").Get(context.Background(), realm)
	if errors.Is(err, schema.ErrNotFound) {
		return nil
	}
	if err != nil {
		e.t.Fatal(err)
	}
	return p.Owners
}

// releaseRealm is the server's DELETE /prerender-servers/realms/:realm (identity by header).
func (e *env) releaseRealm(f *fakeServer, realm string) {
	e.t.Helper()
	resp, b := e.do("DELETE", "/prerender-servers/realms/"+url.PathEscape(realm), "", "", map[string]string{HeaderServerURL: f.URL})
	if resp.StatusCode != http.StatusNoContent {
		e.t.Fatalf("release %s: %d %s", realm, resp.StatusCode, b)
	}
}

func affEnv(t *testing.T, kind schema.KindConfig) *env {
	return newEnv(t, Config{}, []schema.KindConfig{kind}, nil)
}

// Manager health endpoints: HEAD / 200, GET / {ready:true}.
func TestAffinityManagerHealth(t *testing.T) {
	e := affEnv(t, renderKind(1, 4223, time.Hour))
	resp, _ := e.do("HEAD", "/", "", "", nil)
	if resp.StatusCode != 200 {
		t.Fatalf("HEAD / = %d", resp.StatusCode)
	}
	resp, body := e.do("GET", "/", "", "", nil)
	var v struct{ Ready bool }
	if resp.StatusCode != 200 || json.Unmarshal([]byte(body), &v) != nil || !v.Ready {
		t.Fatalf("GET / = %d %s", resp.StatusCode, body)
	}
}

// Registration: 204, idempotent, X-Prerender-Server-Id; URL inference from the peer address
// and the default port, validated by GET /; inference failure 400; header override; deletes
// without an id.
func TestAffinityRegistration(t *testing.T) {
	a := newFakeServer(t, "a")
	e := affEnv(t, renderKind(1, a.port(), time.Hour))

	t.Run("204 and idempotent with an id header", func(t *testing.T) {
		e.registerServer(a, 2)
		first := a.id
		e.registerServer(a, 2)
		if a.id != first {
			t.Fatalf("second registration gave id %s, first %s", a.id, first)
		}
		insts, err := e.st.Directory().Instances(context.Background(), "render")
		if err != nil || len(insts) != 1 || insts[0].Capacity != 2 || insts[0].URL != a.URL {
			t.Fatalf("directory %+v %v", insts, err)
		}
	})
	t.Run("url inferred from the peer address and the default port", func(t *testing.T) {
		resp, b := e.do("POST", "/prerender-servers", "", `{"data":{"type":"prerender-server","attributes":{}}}`, nil)
		if resp.StatusCode != 204 || resp.Header.Get(HeaderServerID) != a.id {
			t.Fatalf("inferred registration: %d %s id %q want %q", resp.StatusCode, b, resp.Header.Get(HeaderServerID), a.id)
		}
		insts, _ := e.st.Directory().Instances(context.Background(), "render")
		if len(insts) != 1 || insts[0].Capacity != 4 {
			t.Fatalf("directory after inferred registration (default capacity 4): %+v", insts)
		}
	})
	t.Run("inference failure 400, header override succeeds", func(t *testing.T) {
		b := newFakeServer(t, "b")
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		deadPort := ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		e2 := affEnv(t, renderKind(1, deadPort, time.Hour))
		resp, body := e2.do("POST", "/prerender-servers", "", "", nil)
		if resp.StatusCode != 400 {
			t.Fatalf("inferred URL with nothing listening: %d %s", resp.StatusCode, body)
		}
		problem(t, resp, body)
		resp, body = e2.do("POST", "/prerender-servers", "", "", map[string]string{HeaderServerURL: b.URL})
		if resp.StatusCode != 204 || resp.Header.Get(HeaderServerID) == "" {
			t.Fatalf("override: %d %s", resp.StatusCode, body)
		}
		resp, body = e2.do("POST", "/prerender-servers", "", `{"data":`, nil)
		if resp.StatusCode != 400 {
			t.Fatalf("invalid payload: %d %s", resp.StatusCode, body)
		}
	})
	t.Run("deletes need no id", func(t *testing.T) {
		resp, _ := e.do("DELETE", "/prerender-servers/realms/nope", "", "", map[string]string{HeaderServerURL: a.URL})
		if resp.StatusCode != 204 {
			t.Fatalf("realm delete of an unknown realm: %d", resp.StatusCode)
		}
		resp, _ = e.do("DELETE", "/prerender-servers", "", "", nil) // identity: peer address + default port = a
		if resp.StatusCode != 204 {
			t.Fatalf("unregister: %d", resp.StatusCode)
		}
		e.waitServer(a.id, false)
	})
}

// Sticky routing by realm; new realms round-robin.
func TestAffinitySticky(t *testing.T) {
	e := affEnv(t, renderKind(1, 4223, time.Hour))
	a, b := newFakeServer(t, "a"), newFakeServer(t, "b")
	e.registerServer(a, 4)
	e.registerServer(b, 4)
	_, first := e.render("r1")
	for range 5 {
		if code, got := e.render("r1"); code != 200 || got != first {
			t.Fatalf("r1: %d from %s, first from %s", code, got, first)
		}
	}
	if _, second := e.render("r2"); second == first {
		t.Fatalf("r2 also on %s", second)
	}
	if o := e.owners("r1"); !slices.Equal(o, []string{first}) {
		t.Fatalf("r1 owners in KV %v", o)
	}
}

// Multiplex 2, capacity 1: the realm alternates across both servers, neither over capacity.
func TestAffinityMultiplex2Capacity1(t *testing.T) {
	e := affEnv(t, renderKind(2, 4223, time.Hour))
	a, b := newFakeServer(t, "a"), newFakeServer(t, "b")
	e.registerServer(a, 1)
	e.registerServer(b, 1)
	var got []string
	for range 6 {
		code, tgt := e.render("r1")
		if code != 200 {
			t.Fatal(code)
		}
		got = append(got, tgt)
	}
	for i := 1; i < len(got); i++ {
		if got[i] == got[i-1] {
			t.Fatalf("not alternating: %v", got)
		}
	}
	if o := e.owners("r1"); len(o) != 2 {
		t.Fatalf("owners %v", o)
	}
	ke := e.gw.reg.snap.Load().kinds["render"]
	if ke.aff.Count(a.id) != 1 || ke.aff.Count(b.id) != 1 {
		t.Fatalf("over capacity: a=%d b=%d", ke.aff.Count(a.id), ke.aff.Count(b.id))
	}
}

// Evicting the realm from one server routes the next requests to the remaining one.
func TestAffinityEviction(t *testing.T) {
	e := affEnv(t, renderKind(2, 4223, time.Hour))
	a, b := newFakeServer(t, "a"), newFakeServer(t, "b")
	e.registerServer(a, 1)
	e.registerServer(b, 1)
	e.render("r1")
	e.render("r1")
	if o := e.owners("r1"); len(o) != 2 {
		t.Fatalf("owners %v", o)
	}
	e.releaseRealm(a, "r1")
	if o := e.owners("r1"); !slices.Equal(o, []string{b.id}) {
		t.Fatalf("owners after eviction from a: %v", o)
	}
	if code, got := e.render("r1"); code != 200 || got != b.id {
		t.Fatalf("after eviction: %d from %s, want %s", code, got, b.id)
	}
	ke := e.gw.reg.snap.Load().kinds["render"]
	if ke.aff.Count(a.id) != 0 {
		t.Fatal("eviction did not free a's capacity")
	}
}

// Capacity honoured: no third realm on a server with capacity 2 while another has room.
func TestAffinityCapacity(t *testing.T) {
	e := affEnv(t, renderKind(1, 4223, time.Hour))
	a, b := newFakeServer(t, "a"), newFakeServer(t, "b")
	e.registerServer(a, 2)
	e.registerServer(b, 4)
	perServer := map[string]int{}
	for i := range 6 {
		code, tgt := e.render("r" + strconv.Itoa(i))
		if code != 200 {
			t.Fatal(code)
		}
		perServer[tgt]++
	}
	if perServer[a.id] != 2 || perServer[b.id] != 4 {
		t.Fatalf("realms per server %v (a cap 2, b cap 4)", perServer)
	}
}

// No servers -> 503.
func TestAffinityNoServers(t *testing.T) {
	e := affEnv(t, renderKind(1, 4223, time.Hour))
	resp, body := e.do("POST", "/render", "r1", "{}", nil)
	if resp.StatusCode != 503 {
		t.Fatalf("no servers: %d %s", resp.StatusCode, body)
	}
	problem(t, resp, body)
	a := newFakeServer(t, "a")
	e.registerServer(a, 1)
	e.do("DELETE", "/prerender-servers", "", "", map[string]string{HeaderServerURL: a.URL})
	e.waitServer(a.id, false)
	if resp, body := e.do("POST", "/render", "r1", "{}", nil); resp.StatusCode != 503 {
		t.Fatalf("after the last server left: %d %s", resp.StatusCode, body)
	}
}

// Pressure mode: all servers full -> the owner of the globally least-recently-used realm; the
// assignment is recorded only after success; a later DELETE from the server frees capacity.
func TestAffinityPressure(t *testing.T) {
	e := affEnv(t, renderKind(1, 4223, time.Hour))
	a, b := newFakeServer(t, "a"), newFakeServer(t, "b")
	e.registerServer(a, 1)
	e.registerServer(b, 1)
	_, oldOwner := e.render("old")
	_, recent := e.render("recent")
	e.render("recent")
	if oldOwner == recent {
		t.Fatal("round-robin put both realms on one server")
	}
	srv := map[string]*fakeServer{a.id: a, b.id: b}

	// The LRU owner fails: nothing is recorded for it; the fallback serves and is recorded.
	srv[oldOwner].fail.Store(true)
	code, got := e.render("third")
	if code != 200 || got != recent {
		t.Fatalf("pressure with the LRU owner failing: %d from %s, want fallback %s", code, got, recent)
	}
	if o := e.owners("third"); !slices.Equal(o, []string{recent}) {
		t.Fatalf("third owners %v, want only the server that succeeded", o)
	}
	srv[oldOwner].fail.Store(false)

	// "old" is still the least recently used realm: pressure sends "fourth" to its owner.
	code, got = e.render("fourth")
	if code != 200 || got != oldOwner {
		t.Fatalf("pressure: %d from %s, want the owner of the LRU realm %s", code, got, oldOwner)
	}
	if o := e.owners("fourth"); !slices.Equal(o, []string{oldOwner}) {
		t.Fatalf("fourth owners %v", o)
	}
	ke := e.gw.reg.snap.Load().kinds["render"]
	if n := ke.aff.Count(oldOwner); n != 2 {
		t.Fatalf("%s holds %d realms, want 2 (over capacity until it evicts)", oldOwner, n)
	}
	e.releaseRealm(srv[oldOwner], "old")
	if n := ke.aff.Count(oldOwner); n != 1 {
		t.Fatalf("DELETE did not free capacity: %d", n)
	}
	if o := e.owners("old"); o != nil {
		t.Fatalf("old still mapped to %v", o)
	}
}

// Failover inside a request: the other owners first, then one global round-robin attempt.
func TestAffinityFailover(t *testing.T) {
	e := affEnv(t, renderKind(2, 4223, time.Hour))
	a, b, c := newFakeServer(t, "a"), newFakeServer(t, "b"), newFakeServer(t, "c")
	e.registerServer(a, 1)
	e.registerServer(b, 1)
	srv := map[string]*fakeServer{a.id: a, b.id: b}
	_, o1 := e.render("r1")
	_, o2 := e.render("r1")
	if o1 == o2 {
		t.Fatal("no growth")
	}
	srv[o1].fail.Store(true)
	for range 3 {
		if code, got := e.render("r1"); code != 200 || got != o2 {
			t.Fatalf("failover to the other owner: %d from %s want %s", code, got, o2)
		}
	}
	e.registerServer(c, 1)
	srv[o2].fail.Store(true)
	code, got := e.render("r1")
	if code != 200 || got != c.id {
		t.Fatalf("global round-robin attempt: %d from %s want %s", code, got, c.id)
	}
	a.fail.Store(true)
	b.fail.Store(true)
	c.fail.Store(true)
	if code, _ := e.render("r1"); code != 500 {
		t.Fatalf("every server failing: %d, want the last answer (500)", code)
	}
}

// Health polling drops a dead server from the directory, the routes and every mapping.
func TestAffinityHealthDownRemovesMappings(t *testing.T) {
	e := affEnv(t, renderKind(2, 4223, 50*time.Millisecond))
	a, b := newFakeServer(t, "a"), newFakeServer(t, "b")
	e.registerServer(a, 2)
	e.registerServer(b, 2)
	for _, r := range []string{"r1", "r1", "r2", "r2"} {
		if code, _ := e.render(r); code != 200 {
			t.Fatal(code)
		}
	}
	if len(e.owners("r1")) != 2 || len(e.owners("r2")) != 2 {
		t.Fatalf("owners r1 %v r2 %v", e.owners("r1"), e.owners("r2"))
	}
	a.down.Store(true)
	e.waitServer(a.id, false)
	eventually(t, 10*time.Second, "a dropped from every mapping", func() bool {
		return slices.Equal(e.owners("r1"), []string{b.id}) && slices.Equal(e.owners("r2"), []string{b.id})
	})
	if _, err := e.st.Directory().Instance(context.Background(), schema.InstanceID{Kind: "render", Shard: strings.Split(a.id, ".")[1], Instance: strings.Split(a.id, ".")[2]}); !errors.Is(err, schema.ErrNotFound) {
		t.Fatalf("a still in the directory: %v", err)
	}
	if code, got := e.render("r1"); code != 200 || got != b.id {
		t.Fatalf("after a died: %d from %s", code, got)
	}
}

// Two gateways agree: assignments live in KV, written by CAS.
func TestAffinityGatewaysAgree(t *testing.T) {
	e := affEnv(t, renderKind(1, 4223, time.Hour))
	a, b := newFakeServer(t, "a"), newFakeServer(t, "b")
	e.registerServer(a, 8)
	e.registerServer(b, 8)
	e2 := &env{t: t, nats: e.nats, st: e.st}
	e.servers.Range(func(k, v any) bool { e2.servers.Store(k, v); return true })
	e2.startGateway(Config{})
	e2.waitServer(b.id, true)
	e2.waitServer(a.id, true)
	var wg sync.WaitGroup
	targets := make([][2]string, 8)
	for i := range targets {
		wg.Go(func() {
			realm := "t" + strconv.Itoa(i)
			_, targets[i][0] = e.render(realm)
			_, targets[i][1] = e2.render(realm)
		})
	}
	wg.Wait()
	for i, tg := range targets {
		if tg[0] == "" || tg[0] != tg[1] {
			t.Fatalf("realm t%d: gateway 1 used %s, gateway 2 %s", i, tg[0], tg[1])
		}
	}
}

// A server that does not answer within ServerTimeout fails over to the next owner; the last
// attempt's timeout is a 504.
func TestAffinityTimeoutFailover(t *testing.T) {
	k := renderKind(2, 4223, time.Hour)
	k.Affinity.ServerTimeout = schema.Duration(200 * time.Millisecond)
	e := affEnv(t, k)
	a, b := newFakeServer(t, "a"), newFakeServer(t, "b")
	e.registerServer(a, 1)
	e.registerServer(b, 1)
	_, o1 := e.render("r1")
	_, o2 := e.render("r1")
	srv := map[string]*fakeServer{a.id: a, b.id: b}
	srv[o1].hang.Store(true)
	if code, got := e.render("r1"); code != 200 || got != o2 {
		t.Fatalf("timeout failover: %d from %s, want %s", code, got, o2)
	}
	srv[o2].hang.Store(true)
	start := time.Now()
	if code, _ := e.render("r1"); code != http.StatusGatewayTimeout {
		t.Fatalf("every owner hanging: %d, want 504", code)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("took %v", d)
	}
}

// lockedBuffer is a log sink the gateway writes from several goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// A server's realm release answers 204 for any realm, as the prerender manager does ("realm
// delete: 204 even if mapping missing"), a URL realm included: no tenant can be named so, so
// there is nothing to drop, and the realm's server must not be told it did something wrong.
func TestAffinityReleaseAnyRealm(t *testing.T) {
	e := affEnv(t, renderKind(1, 4223, time.Hour))
	a := newFakeServer(t, "a")
	e.registerServer(a, 2)
	e.render("r1")
	for _, realm := range []string{"https://realms.example.com/acme/", "r1", "never-seen", "a realm with spaces"} {
		e.releaseRealm(a, realm)
	}
	if o := e.owners("r1"); len(o) != 0 {
		t.Fatalf("r1 still owned by %v after its release", o)
	}
}

// The seed's response headers, x-boxel-prerender-target and x-boxel-prerender-realm, name the
// answering server and the realm like x-tm-target and x-tm-tenant; a server setting any of them
// itself has them replaced (render checks the values on every answer).
func TestAffinitySeedHeaderNames(t *testing.T) {
	e := affEnv(t, renderKind(1, 4223, time.Hour))
	spoof := newFakeServer(t, "spoof")
	spoof.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(HeaderSeedTarget, "someone-else")
		w.Header().Set(HeaderSeedRealm, "other-realm")
		w.Header().Set(HeaderTarget, "someone-else")
		spoof.serve(w, r)
	})
	e.registerServer(spoof, 2)
	resp, _ := e.do("POST", "/render", "r1", `{}`, nil)
	for _, h := range []string{HeaderSeedTarget, HeaderSeedRealm, HeaderTarget} {
		if n := len(resp.Header.Values(h)); n != 1 {
			t.Fatalf("%s sent %d times: %v", h, n, resp.Header)
		}
	}
	if code, tgt := e.render("r1"); code != 200 || tgt != spoof.id {
		t.Fatalf("render: %d from %s", code, tgt)
	}
}

// The prerender manager's metrics and logs: the realm hit ratio (tm_gateway_affinity_requests_total
// by result), each server's utilisation (realms over capacity), and every selection decision
// logged at debug.
func TestAffinityMetricsAndDecisionLogs(t *testing.T) {
	logs := &lockedBuffer{}
	log := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	e := newEnv(t, Config{Logger: log}, []schema.KindConfig{renderKind(1, 4223, time.Hour)}, nil)
	a, b := newFakeServer(t, "a"), newFakeServer(t, "b")
	e.registerServer(a, 2)
	e.registerServer(b, 4)
	for _, realm := range []string{"r1", "r1", "r1", "r2", "r2", "r3"} {
		if code, _ := e.render(realm); code != 200 {
			t.Fatalf("%s: %d", realm, code)
		}
	}
	_, metrics := e.do("GET", "/metrics", "", "", nil)
	for _, want := range []string{
		`tm_gateway_affinity_requests_total{kind="render",result="assigned"} 3`,
		`tm_gateway_affinity_requests_total{kind="render",result="hit"} 3`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("metrics lack %s:\n%s", want, grepLines(metrics, "tm_gateway_affinity"))
		}
	}
	ke := e.gw.reg.snap.Load().kinds["render"]
	for f, capacity := range map[*fakeServer]int{a: 2, b: 4} {
		want := fmt.Sprintf(`tm_gateway_affinity_server_utilisation{kind="render",server=%q} %g`, f.id, float64(ke.aff.Count(f.id))/float64(capacity))
		if !strings.Contains(metrics, want) {
			t.Errorf("metrics lack %s:\n%s", want, grepLines(metrics, "tm_gateway_affinity"))
		}
	}
	out := logs.String()
	for _, want := range []string{"affinity: selection", "tenant=r1", a.id + ":assigned", "affinity: served", "result=hit"} {
		if !strings.Contains(out, want) && !strings.Contains(out, strings.Replace(want, a.id, b.id, 1)) {
			t.Errorf("debug log lacks %q:\n%s", want, grepLines(out, "affinity:"))
		}
	}
}

// grepLines keeps the lines of s that contain sub.
func grepLines(s, sub string) string {
	var out []string
	for l := range strings.Lines(s) {
		if strings.Contains(l, sub) {
			out = append(out, strings.TrimSpace(l))
		}
	}
	return strings.Join(out, "\n")
}

// A gateway that starts from a compacted placement snapshot (the rebalancer writes one per
// kind) counts the realms its servers own from it: those placements never pass the watcher's
// change hook, so without the seeding a full server looked empty after a restart and took new
// realms over its capacity.
func TestAffinityCountsSeededFromSnapshot(t *testing.T) {
	e := affEnv(t, renderKind(1, 4223, time.Hour))
	a, b := newFakeServer(t, "a"), newFakeServer(t, "b")
	e.registerServer(a, 1)
	e.registerServer(b, 1)
	ids := []string{a.id, b.id}
	slices.Sort(ids)
	full, free := ids[0], ids[1] // the round-robin cursor starts at the first key
	ctx := context.Background()
	if _, err := e.st.Placements("render").Create(ctx, schema.Placement{Tenant: "r1", Shard: shardOfKey(full), Owners: []string{full}}); err != nil {
		t.Fatal(err)
	}
	w, err := placement.New(placement.Config{Store: e.st, Kinds: []string{"render"}, Compact: true})
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(wctx) }()
	<-w.Ready()
	if err := w.WriteSnapshot(ctx, "render"); err != nil {
		t.Fatal(err)
	}
	cancel()
	<-done

	e2 := &env{t: t, nats: e.nats, st: e.st}
	e.servers.Range(func(k, v any) bool { e2.servers.Store(k, v); return true })
	e2.startGateway(Config{})
	e2.waitServer(a.id, true)
	e2.waitServer(b.id, true)
	eventually(t, 10*time.Second, "the snapshot's placements loaded", func() bool {
		ke := e2.gw.reg.snap.Load().kinds["render"]
		if ke == nil || ke.w.Load() == nil {
			return false
		}
		st, _ := ke.w.Load().Stats("render")
		return st.SnapshotRevision > 0
	})
	ke := e2.gw.reg.snap.Load().kinds["render"]
	eventually(t, 10*time.Second, "r1 counted against "+full, func() bool { return ke.aff.Count(full) == 1 })
	if code, got := e2.render("r2"); code != 200 || got != free {
		t.Fatalf("a new realm went to %s (%d); %s is full (r1, from the snapshot), %s has room", got, code, full, free)
	}
}
