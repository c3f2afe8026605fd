package projection

import (
	"fmt"
	"net/http/httptest"
	"testing"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/services/aggregate"
)

// The Cloudlysis PRD's Projection 5, per view type: query latency, rows scanned and the lag of
// the view a query read.
func TestQueryMetricsPerViewType(t *testing.T) {
	st := openStore(t)
	a := newAggregate(t, st)
	reg := prometheus.NewRegistry()
	s, _ := newService(t, st, Config{Registerer: reg})
	for i := range 4 {
		id := fmt.Sprintf("acc%d", i)
		do(t, a, "acme", command(id, aggregate.CmdOpen, 0))
		do(t, a, "acme", command(id, aggregate.CmdDeposit, 10))
	}
	last := do(t, a, "acme", command("acc0", aggregate.CmdDeposit, 1)).Seq
	warm(t, s, "acme", last)
	r := chi.NewRouter()
	s.Mount(r, passThrough, passThrough)
	srv := httptest.NewServer(r)
	defer srv.Close()
	for range 2 {
		if code, _, body := post(t, srv.URL, "acme", "accounts", `{"filter":[{"field":"balance","op":"gte","value":11}]}`); code != 200 {
			t.Fatalf("accounts: %d %s", code, body)
		}
	}
	if code, _, body := post(t, srv.URL, "acme", "transactions", `{}`); code != 200 {
		t.Fatalf("transactions: %d %s", code, body)
	}
	want := map[string]struct {
		count        uint64
		scanned, lag float64
	}{"accounts": {2, 8, 0}, "transactions": {1, 5, 0}} // 4 accounts per query; 5 deposits
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			view := ""
			for _, l := range m.GetLabel() {
				if l.GetName() == "view" {
					view = l.GetValue()
				}
			}
			w, ok := want[view]
			h := m.GetHistogram()
			if !ok || h == nil {
				continue
			}
			switch mf.GetName() {
			case "tm_projection_query_duration_seconds":
				if h.GetSampleCount() != w.count || h.GetSampleSum() <= 0 {
					t.Errorf("%s latency: %d queries, %v s", view, h.GetSampleCount(), h.GetSampleSum())
				}
			case "tm_projection_query_rows_scanned":
				if h.GetSampleCount() != w.count || h.GetSampleSum() != w.scanned {
					t.Errorf("%s rows scanned: %d queries, %v rows; want %d, %v", view, h.GetSampleCount(), h.GetSampleSum(), w.count, w.scanned)
				}
			case "tm_projection_view_lag":
				if h.GetSampleCount() != w.count || h.GetSampleSum() != w.lag {
					t.Errorf("%s lag: %d queries, %v", view, h.GetSampleCount(), h.GetSampleSum())
				}
			default:
				continue
			}
			seen[mf.GetName()+" "+view] = true
		}
	}
	if len(seen) != 6 {
		t.Fatalf("per-view metrics seen: %v", seen)
	}
}
