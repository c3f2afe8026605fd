package gateway

import (
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"

	"github.com/tenantmesh/tenantmesh/internal/gatesig"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// TestAttackShardTrustsCaller (item 4): a shard believed x-tenant-id and x-tm-epoch from
// anyone, so a caller who reached a shard's port directly acted as any tenant, past the edge's
// identity check. With the gateways' key, the gateway proves each request (X-Tm-Proof) and a
// real shardkit instance with its kind's key serves only proven requests: a direct call gets
// 403, and so does a proof copied onto another request, one for another kind, or an old one.
func TestAttackShardTrustsCaller(t *testing.T) {
	master := gatesig.NewKey()
	v, sign := testVerifier(t)
	var (
		mu     sync.Mutex
		proofs []string
	)
	served := func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		proofs = append(proofs, r.Header.Get(tmhttp.HeaderProof))
		mu.Unlock()
		_, _ = io.WriteString(w, "served "+shardkit.Tenant(r))
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	shardURL := "http://" + ln.Addr().String()
	e := newEnv(t, Config{Auth: v, ShardKey: master}, nil, func(e *env) {
		e.place("aggregate", "t1", "aggregate-1")
		sk := kittest.Shard(t, shardkit.Config{Store: e.st, URL: shardURL, Capacity: 10,
			ID:     schema.InstanceID{Kind: "aggregate", Shard: "aggregate-1", Instance: "i1"},
			Routes: []schema.Route{aggRoute}, GatewayKey: gatesig.KindKey(master, "aggregate")})
		srv := &http.Server{Handler: sk.Gate(http.HandlerFunc(served)), ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = srv.Serve(ln) }()
		t.Cleanup(func() { _ = srv.Close() })
	})
	token := "Bearer " + sign(jwt.MapClaims{"sub": "user-7", "tenant_id": "t1"})
	eventually(t, 10*time.Second, "the shard routed", func() bool {
		resp, _ := e.do("GET", "/agg/x", "t1", "", map[string]string{"Authorization": token})
		return resp.StatusCode == 200
	})

	direct := func(path string, hdr map[string]string) int {
		req, _ := http.NewRequest("GET", shardURL+path, nil)
		req.Header.Set(tmhttp.HeaderTenant, "t1")
		req.Header.Set(tmhttp.HeaderEpoch, "1")
		req.Header.Set(tmhttp.HeaderShard, "aggregate-1")
		req.Header.Set(tmhttp.HeaderKind, "aggregate")
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		resp, err := tmtest.HTTP.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == 200 && !strings.Contains(string(body), "served t1") {
			t.Fatalf("unexpected body %q", body)
		}
		return resp.StatusCode
	}
	if code := direct("/agg/x", nil); code != http.StatusForbidden {
		t.Fatalf("a direct call to the shard as tenant t1, with no token: status %d, want 403", code)
	}
	mu.Lock()
	copied := proofs[len(proofs)-1] // a proof the gateway made for GET /agg/x
	mu.Unlock()
	if code := direct("/agg/other", map[string]string{tmhttp.HeaderProof: copied}); code != http.StatusForbidden {
		t.Fatalf("a copied proof on another path: status %d, want 403", code)
	}
	if code := direct("/agg/x", map[string]string{tmhttp.HeaderProof: copied, tmhttp.HeaderSubject: "admin"}); code != http.StatusForbidden {
		t.Fatalf("a copied proof with another subject: status %d, want 403", code)
	}
	f := &gatesig.Fields{Method: "GET", Target: "/agg/x", Kind: "aggregate", Shard: "aggregate-1", Tenant: "t1", Epoch: "1"}
	other := gatesig.NewSigner(gatesig.KindKey(master, "runner")).Append(nil, time.Now().Unix(), f)
	if code := direct("/agg/x", map[string]string{tmhttp.HeaderProof: string(other)}); code != http.StatusForbidden {
		t.Fatalf("a proof made with another kind's key: status %d, want 403", code)
	}
	old := gatesig.NewSigner(gatesig.KindKey(master, "aggregate")).Append(nil, time.Now().Add(-2*time.Minute).Unix(), f)
	if code := direct("/agg/x", map[string]string{tmhttp.HeaderProof: string(old)}); code != http.StatusForbidden {
		t.Fatalf("a proof made two minutes ago: status %d, want 403", code)
	}
	fresh := gatesig.NewSigner(gatesig.KindKey(master, "aggregate")).Append(nil, time.Now().Unix(), f)
	if code := direct("/agg/x", map[string]string{tmhttp.HeaderProof: string(fresh)}); code != 200 {
		t.Fatalf("a fresh proof with the kind's key: status %d, want 200", code)
	}
}
