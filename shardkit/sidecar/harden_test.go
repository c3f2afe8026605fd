package sidecar_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/sidecar"
	"github.com/tenantmesh/tenantmesh/shardkit/sidecar/sidecartest"
)

// upstreamRecorder is a service behind the sidecar that records what reaches it.
type upstreamRecorder struct {
	mu    sync.Mutex
	paths []string
	hdrs  []http.Header
}

func (u *upstreamRecorder) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	u.paths = append(u.paths, r.URL.Path)
	u.hdrs = append(u.hdrs, r.Header.Clone())
	u.mu.Unlock()
	_, _ = w.Write([]byte(`{"applied":7}`))
}

func (u *upstreamRecorder) seen() ([]string, []http.Header) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]string(nil), u.paths...), append([]http.Header(nil), u.hdrs...)
}

// TestAttackSidecarHooks (low): a request for the hooks' path reached the service's hooks
// through the sidecar like any tenant request, so a tenant could release (drop) or warm its
// state; and underscore header fields reached the service, whose CGI-style frameworks read
// x_tenant_id as x-tenant-id. The sidecar answers the hooks' path 404, drops such fields, and
// with --hooks-secret-file proves its own hook calls.
func TestAttackSidecarHooks(t *testing.T) {
	rec := &upstreamRecorder{}
	up := httptest.NewServer(rec)
	t.Cleanup(up.Close)
	st, natsURL := openStore(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := st.Kinds().Put(ctx, schema.KindConfig{Kind: "notes"}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Placements("notes").Create(ctx, schema.Placement{Tenant: "acme", Shard: "notes-1"}); err != nil {
		t.Fatal(err)
	}
	url := sidecartest.Start(t, natsURL, "notes", "notes-1", "a", up.URL, "release")
	call := func(method, path string, hdr map[string]string) int {
		req, _ := http.NewRequest(method, url+path, strings.NewReader(`{"tenant":"acme"}`))
		req.Header.Set("x-tenant-id", "acme")
		for k, v := range hdr {
			req.Header[k] = []string{v} // as sent, not canonicalized
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	var code int
	deadline := time.Now().Add(20 * time.Second)
	for code = call("GET", "/notes", nil); code != 200 && time.Now().Before(deadline); code = call("GET", "/notes", nil) {
	}
	if code != 200 {
		t.Fatalf("the sidecar does not serve acme: %d", code)
	}
	for _, p := range []string{"/tenantmesh/release", "/TenantMesh/release", "/tenantmesh", "/tenantmesh/warm"} {
		call("POST", p, nil)
	}
	call("GET", "/notes", map[string]string{"x_tenant_id": "victim", "X_Tm_Subject": "admin"})
	paths, hdrs := rec.seen()
	for _, p := range paths {
		if !strings.HasPrefix(p, "/notes") {
			t.Errorf("a tenant request reached the service's hook %s", p)
		}
	}
	for k := range hdrs[len(hdrs)-1] {
		if strings.Contains(k, "_") {
			t.Errorf("the service received %s", k)
		}
	}

	// The hooks' secret on the sidecar's own hook calls.
	secret := filepath.Join(t.TempDir(), "hooks.secret")
	if err := os.WriteFile(secret, []byte("0123456789abcdef0123\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	sc, err := sidecar.New(sidecar.Options{Upstream: up.URL, Routes: sidecar.RouteList{{Method: "GET", Prefix: "/notes"}}, Hooks: "applied",
		HooksPath: "/tenantmesh", HookTimeout: 5 * time.Second, WarmTimeout: 5 * time.Second, HookSecretFile: secret})
	if err != nil {
		t.Fatal(err)
	}
	if n := sc.Hooks().Applied("acme"); n != 7 {
		t.Fatalf("applied = %d", n)
	}
	_, hdrs = rec.seen()
	if got := hdrs[len(hdrs)-1].Get(sidecar.HeaderHookToken); got != "0123456789abcdef0123" {
		t.Fatalf("a hook call carried %q", got)
	}
}
