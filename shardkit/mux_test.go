package shardkit_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// A service on net/http's ServeMux mounts the shard's routes with MountMux beside its own,
// /admin/... ones included; Handler serves them alone to a router that delegates a path.
func TestMountMuxAndHandler(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	rev := place(t, st, schema.Placement{Kind: "aggregate", Tenant: "mine", Shard: "aggregate-1"}).Revision
	mux := http.NewServeMux()
	hs := httptest.NewUnstartedServer(mux)
	url := "http://" + hs.Listener.Addr().String()
	sk, err := shardkit.New(shardkit.Config{Store: st, ID: id("aggregate-1", "a"), URL: url, AdminToken: testToken, Heartbeat: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	a := newApp()
	sk.MountMux(mux)
	mux.Handle("/t/", sk.Gate(a))
	mux.Handle("GET /admin/app", sk.RequireAdmin(a))
	mux.Handle("/shard/", http.StripPrefix("/shard", sk.Handler()))
	hs.Start()
	defer hs.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- sk.Run(ctx) }()
	defer func() { cancel(); <-done }()
	select {
	case <-sk.Running():
	case err := <-done:
		t.Fatalf("shard stopped at start: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("shard not running within 30s")
	}
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	if err := sk.WaitPlacement(wctx, rev); err != nil {
		t.Fatal(err)
	}

	if code, _, body := call(t, "GET", url+"/t/x", "mine", nil, ""); code != http.StatusOK || !strings.HasPrefix(body, "ok mine") {
		t.Errorf("owned tenant through the mux: %d %s", code, body)
	}
	if code, _, _ := call(t, "GET", url+"/t/x", "theirs", nil, ""); code != http.StatusMisdirectedRequest {
		t.Errorf("unowned tenant through the mux: %d", code)
	}
	for _, c := range []struct {
		method, path, token string
		code                int
		body                string
	}{
		{"GET", "/healthz", "", 200, `"status": "ok"`},
		{"GET", "/readyz", "", 200, `"ready": true`},
		{"GET", "/metrics", "", 200, "tm_"},
		{"GET", "/admin/tenants", "", 401, ""},
		{"GET", "/admin/tenants", testToken, 200, `"tenant": "mine"`},
		{"GET", "/admin/app", "", 401, ""},
		{"GET", "/admin/app", testToken, 200, "ok"},
		{"GET", "/shard/healthz", "", 200, `"status": "ok"`},
		{"GET", "/shard/admin/tenants", testToken, 200, `"tenant": "mine"`},
		{"GET", "/shard/nothing", "", 404, "not a shard route"},
	} {
		code, body := admin(t, c.method, url+c.path, c.token)
		if code != c.code || !strings.Contains(body, c.body) {
			t.Errorf("%s %s: %d %s; want %d with %q", c.method, c.path, code, body, c.code, c.body)
		}
	}
}
