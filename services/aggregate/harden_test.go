package aggregate

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
)

// TestAttackCommandLabel (item 11): the command name comes from the tenant's request and was
// the command label of tm_aggregate_commands_total, so 1,000 requests with made-up names made
// 1,000 series (each lives in this process and every Prometheus that scrapes it). A name the
// ledger does not know is counted as "other".
func TestAttackCommandLabel(t *testing.T) {
	reg := prometheus.NewRegistry()
	s := newService(t, openStore(t), Config{Registerer: reg})
	r := chi.NewRouter()
	pass := func(h http.Handler) http.Handler { return h }
	s.Mount(r, pass, pass)
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)
	for i := range 1000 {
		body := fmt.Sprintf(`{"aggregate_type":"account","aggregate_id":"a1","command":"made-up-%d","idempotency_key":"k%d"}`, i, i)
		req, _ := http.NewRequest("POST", srv.URL+"/commands", strings.NewReader(body))
		req.Header.Set("x-tenant-id", "t1")
		resp, err := tmtest.HTTP.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "tm_aggregate_commands_total" && len(mf.GetMetric()) > 10 {
			t.Fatalf("tm_aggregate_commands_total has %d series after 1,000 made-up command names", len(mf.GetMetric()))
		}
	}
}
