package sidecar_test

import (
	"net/http"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/sidecar"
)

func openStore(t testing.TB) (*schema.Store, string) {
	t.Helper()
	srv := natstest.Server(t)
	return kittest.StoreAt(t, srv.URL()), srv.URL()
}

var client = &http.Client{Timeout: 15 * time.Second}

// A sidecar that cannot reach its service answers 502 problem+json, and its flags are checked.
func TestSidecarErrors(t *testing.T) {
	for _, o := range []sidecar.Options{
		{Upstream: "127.0.0.1:8000", Routes: sidecar.RouteList{{Method: "GET", Prefix: "/x"}}},
		{Upstream: "http://127.0.0.1:8000"},
		{Upstream: "http://127.0.0.1:8000", Routes: sidecar.RouteList{{Method: "GET", Prefix: "/x"}}, Hooks: "warm,snapshot"},
	} {
		if _, err := sidecar.New(o); err == nil {
			t.Errorf("sidecar.New(%+v) accepted", o)
		}
	}
	var r sidecar.RouteList
	if err := r.Set("post /a, GET /b"); err != nil || len(r) != 2 || r[0].Method != "POST" || r[1].Prefix != "/b" {
		t.Errorf("routes %+v %v", r, err)
	}
	if err := r.Set("GET"); err == nil {
		t.Error("a route without a path accepted")
	}
}
