package gateway

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"

	"github.com/tenantmesh/tenantmesh/gateway/edgeauth"
	"github.com/tenantmesh/tenantmesh/internal/embednats"
	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// env is one test's world: an embedded NATS, a schema store and a running gateway.
type env struct {
	t      testing.TB
	nats   *embednats.Server
	st     *schema.Store
	gw     *Gateway
	url    string
	client *http.Client
	// stop ends the gateway's Run and returns its error (also called at cleanup).
	stop func() error
	// servers are the fake prerender servers registered through the gateway, by instance key.
	servers sync.Map
}

// newEnv starts NATS, registers kinds, lets setup write state, then starts a gateway and waits
// until it is ready.
func newEnv(t testing.TB, cfg Config, kinds []schema.KindConfig, setup func(e *env)) *env {
	t.Helper()
	if testing.Short() {
		t.Skip("integration test: needs an embedded nats-server")
	}
	e := &env{t: t, nats: natstest.Server(t)}
	e.st = kittest.StoreAt(t, e.nats.URL())
	ctx := context.Background()
	for _, k := range kinds {
		if _, err := e.st.Kinds().Put(ctx, k); err != nil {
			t.Fatal(err)
		}
	}
	if setup != nil {
		setup(e)
	}
	e.startGateway(cfg)
	return e
}

// testAdminToken is the gateways' admin token in tests; do sends it to admin and registration
// paths unless the caller sets Authorization.
const testAdminToken = "test-admin-token"

func (e *env) startGateway(cfg Config) {
	t := e.t
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Store, cfg.Listener = e.st, ln
	if cfg.AdminToken == "" {
		cfg.AdminToken = testAdminToken
	}
	if cfg.Assign == (AssignLimits{}) {
		// Tests place tenants as fast as they like; harden_test.go sets its limits.
		cfg.Assign = AssignLimits{PerClient: -1, PerKind: -1}
	}
	if cfg.RefreshWait == 0 {
		cfg.RefreshWait = 200 * time.Millisecond
	}
	cfg.ShutdownTimeout = 5 * time.Second
	g, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()
	var once sync.Once
	var runErr error
	e.stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case runErr = <-done:
			case <-time.After(15 * time.Second):
				runErr = errors.New("gateway did not stop within 15s")
			}
		})
		return runErr
	}
	t.Cleanup(func() {
		if err := e.stop(); err != nil {
			t.Errorf("gateway Run: %v", err)
		}
	})
	select {
	case <-g.Ready():
	case err := <-done:
		t.Fatalf("gateway stopped before ready: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("gateway not ready within 30s")
	}
	e.gw = g
	e.url = "http://" + ln.Addr().String()
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	t.Cleanup(tr.CloseIdleConnections)
	e.client = &http.Client{Transport: tr, Timeout: 15 * time.Second}
}

// backend is a shard instance: a real HTTP server that records what it receives.
type backend struct {
	*httptest.Server
	id schema.InstanceID

	mu      sync.Mutex
	seen    []*http.Request
	bodies  []string
	handler http.HandlerFunc // optional; default answers 200 with the instance key
}

func newBackend(t testing.TB, kind, shard, inst string) *backend {
	t.Helper()
	b := &backend{id: schema.InstanceID{Kind: kind, Shard: shard, Instance: inst}}
	b.Server = httptest.NewServer(http.HandlerFunc(b.serve))
	t.Cleanup(b.Close)
	return b
}

func (b *backend) serve(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	b.mu.Lock()
	b.seen = append(b.seen, r.Clone(context.Background()))
	b.bodies = append(b.bodies, string(body))
	h := b.handler
	b.mu.Unlock()
	if h != nil {
		h(w, r)
		return
	}
	w.Header().Set("X-Backend", b.id.Key())
	_, _ = io.WriteString(w, b.id.Key())
}

func (b *backend) setHandler(h http.HandlerFunc) {
	b.mu.Lock()
	b.handler = h
	b.mu.Unlock()
}

func (b *backend) requests() ([]*http.Request, []string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]*http.Request(nil), b.seen...), append([]string(nil), b.bodies...)
}

// register puts the instance in the directory (capacity cap) and on the route.
func (e *env) register(b *backend, url string, capacity int, routes ...schema.Route) {
	e.t.Helper()
	ctx := context.Background()
	if url == "" {
		url = b.URL
	}
	if _, err := e.st.Directory().Register(ctx, schema.Instance{InstanceID: b.id, URL: url, Capacity: capacity}); err != nil {
		e.t.Fatal(err)
	}
	for _, r := range routes {
		if _, err := e.st.Routes().AddInstance(ctx, r, b.id); err != nil {
			e.t.Fatal(err)
		}
	}
}

func (e *env) place(kind, tenant, shard string) schema.Placement {
	e.t.Helper()
	p, err := e.st.Placements(kind).Create(context.Background(), schema.Placement{Tenant: tenant, Shard: shard})
	if err != nil {
		e.t.Fatal(err)
	}
	return p
}

// move changes a placement by CAS and returns the stored value.
func (e *env) move(kind, tenant string, edit func(p *schema.Placement)) schema.Placement {
	e.t.Helper()
	ctx := context.Background()
	p, err := e.st.Placements(kind).Get(ctx, tenant)
	if err != nil {
		e.t.Fatal(err)
	}
	next := p
	edit(&next)
	np, err := e.st.Placements(next.Kind).Update(ctx, p, next)
	if err != nil {
		e.t.Fatal(err)
	}
	return np
}

// do sends a request with the tenant header (none if tenant is "") and returns the response with
// its body read.
func (e *env) do(method, path, tenant, body string, hdr map[string]string) (*http.Response, string) {
	e.t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, e.url+path, rd)
	if err != nil {
		e.t.Fatal(err)
	}
	if tenant != "" {
		req.Header.Set(tmhttp.HeaderTenant, tenant)
	}
	if _, set := hdr["Authorization"]; !set && (strings.HasPrefix(path, "/admin/") || strings.HasPrefix(path, "/prerender-servers")) {
		req.Header.Set("Authorization", "Bearer "+testAdminToken)
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := e.client.Do(req)
	if err != nil {
		e.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// problem decodes a problem+json body, failing if the response is not one.
func problem(t testing.TB, resp *http.Response, body string) tmhttp.Problem {
	t.Helper()
	if ct := resp.Header.Get("Content-Type"); ct != tmhttp.ContentTypeProblem {
		t.Fatalf("status %d content type %q, want problem+json; body %s", resp.StatusCode, ct, body)
	}
	var p tmhttp.Problem
	if err := json.Unmarshal([]byte(body), &p); err != nil {
		t.Fatalf("problem body %q: %v", body, err)
	}
	if p.Status != resp.StatusCode || p.Type == "" || p.Title == "" {
		t.Fatalf("problem %+v does not match status %d", p, resp.StatusCode)
	}
	return p
}

// eventually waits until cond holds (tmtest.WaitFor), for state no event announces.
func eventually(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	tmtest.WaitFor(t, within, tmtest.Until(what, cond))
}

// servedBy sends GETs until one is served by want (placement changes propagate asynchronously).
func (e *env) waitServedBy(path, tenant, want string) {
	e.t.Helper()
	eventually(e.t, 10*time.Second, tenant+" served by "+want, func() bool {
		resp, _ := e.do("GET", path, tenant, "", nil)
		return resp.StatusCode == 200 && resp.Header.Get(tmhttp.HeaderServedBy) == want
	})
}

// waitPhase waits until the gateway's snapshot shows tenant in phase.
func (e *env) waitPhase(kind, tenant string, phase schema.Phase) {
	e.t.Helper()
	ke := e.gw.reg.snap.Load().kinds[kind]
	eventually(e.t, 10*time.Second, tenant+" in "+string(phase), func() bool {
		p, ok := ke.lookup(tenant)
		return ok && p.Phase == phase
	})
}

func jsonUnmarshal(s string, v any) error { return json.Unmarshal([]byte(s), v) }

// testVerifier is an edge identity verifier with a local ES256 key, and a signer of tokens
// for it: claims beside iss, aud and exp, which it fills in unless given.
func testVerifier(t testing.TB) (*edgeauth.Verifier, func(claims jwt.MapClaims) string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, _ := x509.MarshalPKIXPublicKey(&key.PublicKey)
	path := filepath.Join(t.TempDir(), "idp.pem")
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	v, err := edgeauth.New(context.Background(), edgeauth.Config{KeyFile: path, Issuer: "https://idp.example", Audience: "tenantmesh"})
	if err != nil {
		t.Fatal(err)
	}
	return v, func(claims jwt.MapClaims) string {
		c := jwt.MapClaims{"iss": "https://idp.example", "aud": "tenantmesh", "exp": time.Now().Add(time.Hour).Unix()}
		for k, v := range claims {
			c[k] = v
		}
		s, err := jwt.NewWithClaims(jwt.SigningMethodES256, c).SignedString(key)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
}
