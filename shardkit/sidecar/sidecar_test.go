package sidecar

import (
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/natsconn"
	"github.com/tenantmesh/tenantmesh/shardkit/natsperm"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/shardmain"
)

// startSidecar runs one sidecar instance in process (what main does, on the shard role's
// credentials) in front of upstream, until the test ends; it returns its URL.
func startSidecar(t testing.TB, natsURL, kind, shard, instance, upstream, hooks string) string {
	t.Helper()
	sc, err := New(Options{Upstream: upstream, Routes: RouteList{{Method: "POST", Prefix: "/notes"}, {Method: "GET", Prefix: "/notes"}},
		Hooks: hooks, HooksPath: "/tenantmesh", HookTimeout: 5 * time.Second, WarmTimeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return kittest.Main(t, &shardmain.Main{Kind: kind, Addr: "127.0.0.1:0", Shard: shard, Instance: instance,
		NATS:     natsconn.Options{URL: natsURL, Creds: natstest.CredsFile(t, natsperm.Shard(kind, shard, natsperm.Assets{}))},
		LogLevel: "error", LogFormat: "json", Stderr: io.Discard, Heartbeat: 200 * time.Millisecond, DrainTimeout: 5 * time.Second}, sc.Build)
}

func openStore(t testing.TB) (*schema.Store, string) {
	t.Helper()
	srv := natstest.Server(t)
	return kittest.StoreAt(t, srv.URL()), srv.URL()
}

var client = &http.Client{Timeout: 15 * time.Second}

// A sidecar that cannot reach its service answers 502 problem+json, and its flags are checked.
func TestSidecarErrors(t *testing.T) {
	for _, o := range []Options{
		{Upstream: "127.0.0.1:8000", Routes: RouteList{{Method: "GET", Prefix: "/x"}}},
		{Upstream: "http://127.0.0.1:8000"},
		{Upstream: "http://127.0.0.1:8000", Routes: RouteList{{Method: "GET", Prefix: "/x"}}, Hooks: "warm,snapshot"},
	} {
		if _, err := New(o); err == nil {
			t.Errorf("New(%+v) accepted", o)
		}
	}
	var r RouteList
	if err := r.Set("post /a, GET /b"); err != nil || len(r) != 2 || r[0].Method != "POST" || r[1].Prefix != "/b" {
		t.Errorf("routes %+v %v", r, err)
	}
	if err := r.Set("GET"); err == nil {
		t.Error("a route without a path accepted")
	}
}
