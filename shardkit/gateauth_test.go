package shardkit_test

import (
	"net/http"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/gatesig"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// With the kind's gateway key, the gate serves only requests a gateway proved (the gateway's
// side and the attacks: gateway's TestAttackShardTrustsCaller); in forward mode the owner
// checks the same proof the forwarding instance received, so a proved request still reaches
// it and an unproved one is refused at the first instance.
func TestGatewayProofForwarded(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	key := gatesig.KindKey(gatesig.NewKey(), "aggregate")
	rev := place(t, st, schema.Placement{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1"}).Revision
	a := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "a"), Forward: true, GatewayKey: key})
	b := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-2", "b"), Forward: true, GatewayKey: key})
	synced(t, rev, a, b)
	hdr := map[string]string{tmhttp.HeaderKind: "aggregate", tmhttp.HeaderShard: "aggregate-1", tmhttp.HeaderEpoch: "1"}
	f := &gatesig.Fields{Method: "GET", Target: "/t/x", Kind: "aggregate", Shard: "aggregate-1", Tenant: "t1", Epoch: "1"}
	if code, _, body := call(t, "GET", b.URL+"/t/x", "t1", hdr, ""); code != http.StatusForbidden {
		t.Fatalf("no proof: %d %s", code, body)
	}
	hdr[tmhttp.HeaderProof] = string(gatesig.NewSigner(key).Append(nil, time.Now().Unix(), f))
	code, h, body := call(t, "GET", b.URL+"/t/x", "t1", hdr, "")
	if code != http.StatusOK || h.Get(tmhttp.HeaderServedBy) != "aggregate.aggregate-1.a" {
		t.Fatalf("a proved request forwarded to the owner: %d by %q: %s", code, h.Get(tmhttp.HeaderServedBy), body)
	}
}
