package server

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// TestAttackRebalancerReads (item 9): the API's reads (tenants, instance URLs, the audit
// journal, plans, the event stream) were open to anyone who reached the port; ?kind= and
// ?tenant= went into the audit stream's subject filter as they came (kind=* read the whole
// journal), limit had no bound and event streams no count. Now reads need the read or admin
// token (loopback clients only when none is set), filters are names, limit is 1 to 1000, and
// a process serves at most 64 event streams.
func TestAttackRebalancerReads(t *testing.T) {
	st, _ := kittest.Store(t)
	s, err := New(Config{Store: st, Holder: "h", AdminToken: testToken, ReadToken: "read-token",
		Health: rebalancer.Health{Thresholds: schema.Thresholds{OfflineAfter: 2 * time.Minute}}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(s.Handler())
	t.Cleanup(func() { cancel(); s.Wait(); ts.Close() })

	for _, path := range []string{"/api/instances", "/api/audit", "/api/tenants", "/api/plans", "/api/kinds", "/api/events"} {
		if code, _ := tmtest.CallJSON(t, "", "GET", ts.URL+path, nil, nil); code != http.StatusUnauthorized {
			t.Errorf("GET %s without a token: %d, want 401", path, code)
		}
		if code, _ := tmtest.CallJSON(t, "wrong", "GET", ts.URL+path, nil, nil); code != http.StatusUnauthorized {
			t.Errorf("GET %s with a wrong token: %d, want 401", path, code)
		}
	}
	if code, _ := tmtest.CallJSON(t, "read-token", "GET", ts.URL+"/api/instances", nil, nil); code != 200 {
		t.Errorf("the read token: %d", code)
	}
	if code, _ := tmtest.CallJSON(t, testToken, "GET", ts.URL+"/api/instances", nil, nil); code != 200 {
		t.Errorf("the admin token reads too: %d", code)
	}
	if code, _ := tmtest.CallJSON(t, "", "GET", ts.URL+"/healthz", nil, nil); code != 200 {
		t.Errorf("probes stay open: %d", code)
	}
	if code, _ := tmtest.CallJSON(t, "read-token", "POST", ts.URL+"/api/plans", map[string]any{}, nil); code != http.StatusUnauthorized {
		t.Errorf("the read token wrote: %d", code)
	}

	// Without a read token: loopback clients only.
	open, err := New(Config{Store: st, Holder: "h2", AdminToken: testToken})
	if err != nil {
		t.Fatal(err)
	}
	for addr, want := range map[string]int{"127.0.0.1:5000": 200, "[::1]:5000": 200, "203.0.113.9:5000": http.StatusUnauthorized} {
		req := httptest.NewRequest("GET", "/api/kinds", nil)
		req.RemoteAddr = addr
		rec := httptest.NewRecorder()
		open.Handler().ServeHTTP(rec, req)
		if rec.Code != want {
			t.Errorf("no read token, a client at %s: %d, want %d", addr, rec.Code, want)
		}
	}

	if code, _ := tmtest.CallJSON(t, "read-token", "GET", ts.URL+"/api/audit?kind=aggregate&tenant=t1&limit=1000", nil, nil); code != 200 {
		t.Errorf("audit with names and the largest limit: %d", code)
	}
	for _, q := range []string{"kind=*", "kind=>", "kind=aggregate.*", "tenant=*", "tenant=a.b", "limit=100000", "limit=0"} {
		if code, _ := tmtest.CallJSON(t, "read-token", "GET", ts.URL+"/api/audit?"+q, nil, nil); code != http.StatusBadRequest {
			t.Errorf("GET /api/audit?%s: %d, want 400", q, code)
		}
	}
	for _, q := range []string{"/api/instances?kind=*", "/api/tenants?kind=>"} {
		if code, _ := tmtest.CallJSON(t, "read-token", "GET", ts.URL+q, nil, nil); code != http.StatusBadRequest {
			t.Errorf("GET %s: %d, want 400", q, code)
		}
	}

	const bound = 64 // maxStreams
	streams := 0
	for range bound + 5 {
		sctx, scancel := context.WithCancel(context.Background())
		t.Cleanup(scancel)
		req, _ := http.NewRequestWithContext(sctx, http.MethodGet, ts.URL+"/api/events?access_token=read-token", nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != 200 {
			resp.Body.Close()
			if resp.StatusCode != http.StatusServiceUnavailable {
				t.Fatalf("stream %d: %d", streams+1, resp.StatusCode)
			}
			break
		}
		streams++
		t.Cleanup(func() { resp.Body.Close() })
	}
	if streams != bound {
		t.Fatalf("%d event streams were served at once, want at most %d", streams, bound)
	}
}
