// Package sidecartest runs the sidecar in process for tests: what its main does, on the shard
// role's credentials, in front of a service the test starts.
package sidecartest

import (
	"io"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/natsconn"
	"github.com/tenantmesh/tenantmesh/shardkit/natsperm"
	"github.com/tenantmesh/tenantmesh/shardkit/shardmain"
	"github.com/tenantmesh/tenantmesh/shardkit/sidecar"
)

// Start runs one sidecar instance of kind's shard in front of upstream (routes GET and POST
// /notes; hooks as the --hooks flag lists them) until the test ends, and returns its URL.
func Start(t testing.TB, natsURL, kind, shard, instance, upstream, hooks string) string {
	t.Helper()
	sc, err := sidecar.New(sidecar.Options{Upstream: upstream, Routes: sidecar.RouteList{{Method: "POST", Prefix: "/notes"}, {Method: "GET", Prefix: "/notes"}},
		Hooks: hooks, HooksPath: "/tenantmesh", HookTimeout: 5 * time.Second, WarmTimeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return kittest.Main(t, &shardmain.Main{Kind: kind, Addr: "127.0.0.1:0", Shard: shard, Instance: instance,
		NATS:     natsconn.Options{URL: natsURL, Creds: natstest.CredsFile(t, natsperm.Shard(kind, shard, natsperm.Assets{}))},
		LogLevel: "error", LogFormat: "json", Stderr: io.Discard, Heartbeat: 200 * time.Millisecond, DrainTimeout: 5 * time.Second}, sc.Build)
}
