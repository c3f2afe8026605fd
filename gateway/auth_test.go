package gateway

import (
	"crypto/tls"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/certfile"
	"github.com/tenantmesh/tenantmesh/internal/natsauth"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// Tenant identity at the edge: the gateway answers 401 without a valid token and 403 when the
// header names another tenant, fills x-tenant-id from the token, and passes the verified subject
// on in a header clients cannot forge.
func TestEdgeAuth(t *testing.T) {
	v, signClaims := testVerifier(t)
	sign := func(tenant string, exp time.Duration) string {
		return signClaims(jwt.MapClaims{"sub": "user-7", "tenant_id": tenant, "exp": time.Now().Add(exp).Unix()})
	}
	b := newBackend(t, "aggregate", "aggregate-1", "a")
	e := newEnv(t, Config{Auth: v}, nil, func(e *env) {
		e.register(b, "", 10, aggRoute)
		e.place("aggregate", "t1", "aggregate-1")
	})

	resp, body := e.do("GET", "/agg/x", "t1", "", nil)
	if p := problem(t, resp, body); p.Status != http.StatusUnauthorized || p.Type != tmhttp.TypeBase+"unauthenticated" {
		t.Errorf("no token: %+v", p)
	}
	if h := resp.Header.Get("WWW-Authenticate"); !strings.HasPrefix(h, "Bearer ") {
		t.Errorf("no token: WWW-Authenticate %q", h)
	}
	resp, body = e.do("GET", "/agg/x", "t1", "", map[string]string{"Authorization": "Bearer " + sign("t1", -time.Hour)})
	if p := problem(t, resp, body); p.Status != http.StatusUnauthorized || !strings.Contains(p.Detail, "expired") {
		t.Errorf("expired token: %+v", p)
	}
	if h := resp.Header.Get("WWW-Authenticate"); !strings.Contains(h, `error="invalid_token"`) {
		t.Errorf("expired token: WWW-Authenticate %q", h)
	}
	resp, body = e.do("GET", "/agg/x", "t1", "", map[string]string{"Authorization": "Bearer " + sign("t2", time.Hour)})
	if p := problem(t, resp, body); p.Status != http.StatusForbidden || p.Type != tmhttp.TypeBase+"tenant-mismatch" {
		t.Errorf("token for t2, header t1: %+v", p)
	}
	if reqs, _ := b.requests(); len(reqs) != 0 {
		t.Fatalf("the shard saw %d refused requests", len(reqs))
	}

	// The token's tenant fills the header; a forged x-tm-subject is replaced by the verified one.
	resp, body = e.do("GET", "/agg/x", "", "", map[string]string{"Authorization": "Bearer " + sign("t1", time.Hour),
		tmhttp.HeaderSubject: "admin"})
	if resp.StatusCode != 200 {
		t.Fatalf("valid token: %d %s", resp.StatusCode, body)
	}
	reqs, _ := b.requests()
	if len(reqs) != 1 || reqs[0].Header.Get(tmhttp.HeaderTenant) != "t1" || reqs[0].Header.Get(tmhttp.HeaderSubject) != "user-7" {
		t.Fatalf("shard saw %d requests, tenant %q, subject %q", len(reqs), reqs[0].Header.Get(tmhttp.HeaderTenant), reqs[0].Header.Get(tmhttp.HeaderSubject))
	}
	if resp, _ := e.do("GET", "/healthz", "", "", nil); resp.StatusCode != 200 {
		t.Errorf("/healthz needs no token: %d", resp.StatusCode)
	}
}

// The listener faces tenants too: admin and registration calls without the right token are
// refused, and a gateway without tokens refuses them all.
func TestAdminAndRegistrationNeedTokens(t *testing.T) {
	e := newEnv(t, Config{RegistrationToken: "reg-token"}, nil, nil)
	reg := `{"data":{"type":"prerender-server","attributes":{"url":"http://127.0.0.1:9"}}}`
	for _, c := range []struct {
		method, path, body, auth string
		want                     int
	}{
		{"GET", "/admin/balance", "", "", http.StatusUnauthorized},
		{"GET", "/admin/balance", "", "Bearer reg-token", http.StatusUnauthorized},
		{"GET", "/admin/placement/aggregate/t1", "", "Bearer nope", http.StatusUnauthorized},
		{"POST", "/prerender-servers", reg, "", http.StatusUnauthorized},
		{"POST", "/prerender-servers", reg, "Bearer nope", http.StatusUnauthorized},
		{"DELETE", "/prerender-servers", "", "", http.StatusUnauthorized},
		{"GET", "/admin/balance", "", "Bearer " + testAdminToken, http.StatusOK},
	} {
		resp, body := e.do(c.method, c.path, "", c.body, map[string]string{"Authorization": c.auth})
		if resp.StatusCode != c.want {
			t.Errorf("%s %s with %q: %d %s, want %d", c.method, c.path, c.auth, resp.StatusCode, body, c.want)
			continue
		}
		if c.want != http.StatusOK {
			problem(t, resp, body)
			if resp.Header.Get("WWW-Authenticate") == "" {
				t.Errorf("%s %s: 401 without WWW-Authenticate", c.method, c.path)
			}
		}
	}
	// The registration token registers (the request then fails on its body's URL, not on auth).
	resp, body := e.do("POST", "/prerender-servers", "", `{"data":`, map[string]string{"Authorization": "Bearer reg-token"})
	if resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden {
		t.Errorf("registration token refused: %d %s", resp.StatusCode, body)
	}

	// A gateway with no tokens refuses both with 403, saying how to enable them.
	off := (&Gateway{cfg: Config{Registry: prometheus.NewRegistry()}}).adminMux()
	for _, path := range []string{"/admin/balance", "/prerender-servers"} {
		method := "GET"
		if path == "/prerender-servers" {
			method = "POST"
		}
		rec := httptest.NewRecorder()
		off.ServeHTTP(rec, httptest.NewRequest(method, path, strings.NewReader(reg)))
		if rec.Code != http.StatusForbidden || !strings.Contains(rec.Body.String(), "--") {
			t.Errorf("%s %s without tokens: %d %s", method, path, rec.Code, rec.Body.String())
		}
	}
}

// TLS on every hop: clients to the gateway (certificate reloaded from files), and the gateway to
// an instance registered with an https:// URL, verified with the configured CA.
func TestTLSEveryHop(t *testing.T) {
	files, err := natsauth.LoadOrCreateTLS(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	rl, err := certfile.New(files.Cert, files.Key, nil)
	if err != nil {
		t.Fatal(err)
	}
	cas, err := certfile.Pool(files.CA)
	if err != nil {
		t.Fatal(err)
	}
	b := &backend{id: schema.InstanceID{Kind: "aggregate", Shard: "aggregate-1", Instance: "tls"}}
	b.Server = httptest.NewUnstartedServer(http.HandlerFunc(b.serve))
	pair, err := tls.LoadX509KeyPair(files.Cert, files.Key)
	if err != nil {
		t.Fatal(err)
	}
	b.Server.TLS = &tls.Config{Certificates: []tls.Certificate{pair}} // StartTLS would add its own otherwise
	b.StartTLS()
	t.Cleanup(b.Close)
	e := newEnv(t, Config{TLS: rl.ServerConfig(), UpstreamCAs: cas}, nil, func(e *env) {
		e.register(b, b.URL, 10, aggRoute)
		e.place("aggregate", "t1", "aggregate-1")
	})
	if !strings.HasPrefix(b.URL, "https://") {
		t.Fatalf("backend URL %s", b.URL)
	}
	e.url = strings.Replace(e.url, "http://", "https://", 1)
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: cas}}
	t.Cleanup(tr.CloseIdleConnections)
	e.client = &http.Client{Transport: tr, Timeout: 10 * time.Second}
	resp, body := e.do("GET", "/agg/x", "t1", "", nil)
	if resp.StatusCode != 200 || body != b.id.Key() || resp.TLS == nil {
		t.Fatalf("over TLS: %d %q (tls %v)", resp.StatusCode, body, resp.TLS != nil)
	}
	reqs, _ := b.requests()
	if len(reqs) != 1 || reqs[0].TLS == nil || reqs[0].Header.Get("X-Forwarded-Proto") != "https" {
		t.Fatalf("instance saw %d requests; TLS %v, X-Forwarded-Proto %q", len(reqs), len(reqs) == 1 && reqs[0].TLS != nil, reqs[0].Header.Get("X-Forwarded-Proto"))
	}
	// A plain-HTTP client is refused by the TLS listener.
	plain := &http.Client{Timeout: 5 * time.Second}
	if resp, err := plain.Get(strings.Replace(e.url, "https://", "http://", 1) + "/healthz"); err == nil {
		resp.Body.Close()
		if resp.StatusCode == 200 {
			t.Error("plain HTTP answered 200 on the TLS listener")
		}
	}
}
