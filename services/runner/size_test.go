package runner

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// A tenant's queue depth is in the instance's load reports and /admin/tenants (shardkit, fed
// by the runner's Sizes hook): three jobs held by a delay stay queued.
func TestQueueDepthInTelemetryAndAdmin(t *testing.T) {
	st := openStore(t)
	const tenant = "acme"
	place(t, st, tenant, "runner-1")
	svc := startService(t, st, "runner-1", "a", Config{SizeEvery: 100 * time.Millisecond})
	url := startShardkit(t, st, svc)
	owning(t, svc, tenant, true)
	reports := make(chan schema.LoadReport, 64)
	sub, err := st.SubscribeLoad(Kind, func(r schema.LoadReport) {
		select {
		case reports <- r:
		default:
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	create(t, svc, tenant, 3, NewJob{Type: "noop", Delay: "1h"})

	deadline := time.After(10 * time.Second)
	for found := false; !found; {
		select {
		case r := <-reports:
			for _, z := range r.Sizes {
				found = found || z.Tenant == tenant && z.Queued == 3 && z.Outbox == 0
			}
		case <-deadline:
			t.Fatal("no load report with acme's 3 queued jobs within 10s")
		}
	}
	req, _ := http.NewRequest("GET", url+"/admin/tenants", nil)
	req.Header.Set("Authorization", "Bearer token")
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var body struct {
		Sizes []schema.TenantSize `json:"sizes"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil || len(body.Sizes) != 1 || body.Sizes[0].Queued != 3 {
		t.Fatalf("/admin/tenants sizes %+v (%v), want acme with 3 queued", body.Sizes, err)
	}
}

// startShardkit serves svc behind shardkit (the gate, the admin API, the move protocol) on a
// real HTTP server, as the binary does, until the test ends; it returns the URL.
func startShardkit(t *testing.T, st *schema.Store, svc *Service) string {
	t.Helper()
	r := chi.NewRouter()
	srv := httptest.NewUnstartedServer(r)
	sk, err := shardkit.New(shardkit.Config{Store: st, ID: svc.cfg.ID, URL: "http://" + srv.Listener.Addr().String(),
		Routes: svc.Routes(), Hooks: svc.Hooks(), AdminToken: "token", Heartbeat: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	sk.Mount(r)
	svc.Mount(r, sk.Gate, sk.RequireAdmin)
	srv.Start()
	t.Cleanup(srv.Close)
	kittest.Run(t, sk)
	return srv.URL
}
