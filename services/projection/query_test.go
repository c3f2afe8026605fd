package projection

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/services/aggregate"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

func passThrough(h http.Handler) http.Handler { return h }

// post sends a query over HTTP and returns the status, content type and body.
func post(t *testing.T, url, tenant, view, body string) (int, string, []byte) {
	t.Helper()
	req, _ := http.NewRequest("POST", url+"/query/"+view, strings.NewReader(body))
	req.Header.Set(tmhttp.HeaderTenant, tenant)
	resp, err := tmtest.HTTP.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("Content-Type"), b
}

// TestQueryAPI covers the query language over HTTP: filters, sort, pagination, and 400s whose
// detail says what is wrong and what is allowed; an unknown view type is 404.
func TestQueryAPI(t *testing.T) {
	st := openStore(t)
	a := newAggregate(t, st)
	s, _ := newService(t, st, Config{})
	for i := range 25 {
		id := fmt.Sprintf("acc%02d", i)
		do(t, a, "acme", command(id, aggregate.CmdOpen, 0))
		do(t, a, "acme", command(id, aggregate.CmdDeposit, int64(100*(i%5)+i+1)))
	}
	last := do(t, a, "acme", command("acc03", aggregate.CmdWithdraw, 4)).Seq
	warm(t, s, "acme", last)
	r := chi.NewRouter()
	s.Mount(r, passThrough, passThrough)
	srv := httptest.NewServer(r)
	defer srv.Close()

	t.Run("filter sort page", func(t *testing.T) {
		q := `{"filter":[{"field":"balance","op":"gte","value":200},{"field":"id","op":"prefix","value":"acc1"}],
			"sort":[{"field":"balance","desc":true}],"limit":2}`
		var got []AccountRow
		for page := 0; page < 20; page++ {
			status, _, body := post(t, srv.URL, "acme", "accounts", q)
			if status != 200 {
				t.Fatalf("status %d: %s", status, body)
			}
			var res struct {
				Items      []AccountRow `json:"items"`
				NextCursor string       `json:"next_cursor"`
				Applied    uint64       `json:"applied"`
				Lag        uint64       `json:"lag"`
			}
			if err := json.Unmarshal(body, &res); err != nil {
				t.Fatal(err)
			}
			if res.Applied != last || res.Lag != 0 || len(res.Items) > 2 {
				t.Fatalf("page %d: %s", page, body)
			}
			got = append(got, res.Items...)
			if res.NextCursor == "" {
				break
			}
			q = fmt.Sprintf(`{"filter":[{"field":"balance","op":"gte","value":200},{"field":"id","op":"prefix","value":"acc1"}],
				"sort":[{"field":"balance","desc":true}],"limit":2,"cursor":%q}`, res.NextCursor)
		}
		// acc1x: balances 100*(i%5)+i+1 for i in 10..19; >= 200: i%5 >= 2.
		var want []string
		for i := 10; i < 20; i++ {
			if 100*(i%5)+i+1 >= 200 {
				want = append(want, fmt.Sprintf("acc%02d", i))
			}
		}
		slices.SortFunc(want, func(x, y string) int {
			var a, b int
			fmt.Sscanf(x, "acc%d", &a)
			fmt.Sscanf(y, "acc%d", &b)
			return (100*(b%5) + b) - (100*(a%5) + a)
		})
		var ids []string
		for _, row := range got {
			ids = append(ids, row.ID)
		}
		if !slices.Equal(ids, want) {
			t.Fatalf("pages gave %v, want %v", ids, want)
		}
	})

	t.Run("transactions", func(t *testing.T) {
		status, _, body := post(t, srv.URL, "acme", "transactions", `{"filter":[{"field":"kind","op":"eq","value":"withdraw"}]}`)
		var res struct{ Items []TxRow }
		_ = json.Unmarshal(body, &res)
		if status != 200 || len(res.Items) != 1 || res.Items[0].Account != "acc03" || res.Items[0].Amount != 4 || res.Items[0].Seq != last {
			t.Fatalf("status %d: %s", status, body)
		}
		status, _, body = post(t, srv.URL, "acme", "transactions", ``)
		_ = json.Unmarshal(body, &res)
		if status != 200 || len(res.Items) != 26 {
			t.Fatalf("empty query: status %d, %d items", status, len(res.Items))
		}
	})

	bad := []struct {
		name, view, body string
		status           int
		detail           []string // each must appear in the detail
	}{
		{"unknown view", "orders", `{}`, 404, []string{`"orders"`, "accounts, transactions"}},
		{"unknown field", "accounts", `{"filter":[{"field":"colour","op":"eq","value":"red"}]}`, 400,
			[]string{`filter[0]: unknown field "colour"`, "balance (integer)", "owner (string)"}},
		{"op not allowed", "accounts", `{"filter":[{"field":"balance","op":"prefix","value":1}]}`, 400,
			[]string{`op "prefix" is not allowed on integer field "balance"`, "eq, ne, lt, lte, gt, gte"}},
		{"unknown op", "accounts", `{"filter":[{"field":"id","op":"like","value":"a%"}]}`, 400,
			[]string{`op "like"`, "eq, ne, lt, lte, gt, gte, prefix"}},
		{"wrong value type", "accounts", `{"filter":[{"field":"balance","op":"gt","value":"100"}]}`, 400,
			[]string{`"balance" is an integer`}},
		{"bad time", "transactions", `{"filter":[{"field":"at","op":"gt","value":"yesterday"}]}`, 400,
			[]string{"RFC 3339"}},
		{"missing value", "accounts", `{"filter":[{"field":"closed","op":"eq"}]}`, 400, []string{`"closed" needs a value (boolean)`}},
		{"unknown sort field", "transactions", `{"sort":[{"field":"when"}]}`, 400, []string{`sort[0]: unknown field "when"`, "seq (integer)"}},
		{"limit too big", "accounts", `{"limit":5000}`, 400, []string{"limit 5000", "1 to 1000"}},
		{"negative limit", "accounts", `{"limit":-1}`, 400, []string{"1 to 1000"}},
		{"misspelt key", "accounts", `{"filters":[]}`, 400, []string{`unknown field "filters"`, `"filter"`}},
		{"not json", "accounts", `filter=balance`, 400, []string{"one JSON object"}},
		{"two objects", "accounts", `{} {}`, 400, []string{"exactly one JSON object"}},
		{"garbage cursor", "accounts", `{"cursor":"!!"}`, 400, []string{"next_cursor"}},
		{"cursor of another query", "accounts", `{"sort":[{"field":"owner"}],"cursor":"` + cursorFor(t, srv.URL) + `"}`, 400,
			[]string{"different query"}},
		{"too many filters", "accounts", `{"filter":[` + strings.Repeat(`{"field":"id","op":"ne","value":"x"},`, 20) + `{"field":"id","op":"ne","value":"x"}]}`, 400,
			[]string{"at most 20"}},
		{"body too large", "accounts", `{"cursor":"` + strings.Repeat("a", MaxQueryBytes) + `"}`, 400, []string{"over 65536 bytes"}},
	}
	for _, tt := range bad {
		t.Run(tt.name, func(t *testing.T) {
			status, ctype, body := post(t, srv.URL, "acme", tt.view, tt.body)
			var p tmhttp.Problem
			if err := json.Unmarshal(body, &p); err != nil {
				t.Fatalf("body %s: %v", body, err)
			}
			if status != tt.status || ctype != tmhttp.ContentTypeProblem || p.Status != tt.status || p.Tenant != "acme" || p.Kind != Kind {
				t.Fatalf("status %d, content type %q, problem %+v", status, ctype, p)
			}
			for _, d := range tt.detail {
				if !strings.Contains(p.Detail, d) {
					t.Errorf("detail %q lacks %q", p.Detail, d)
				}
			}
		})
	}
}

// cursorFor returns a valid cursor of the default query of accounts, limit 1.
func cursorFor(t *testing.T, url string) string {
	_, _, body := post(t, url, "acme", "accounts", `{"limit":1}`)
	var res struct {
		NextCursor string `json:"next_cursor"`
	}
	if err := json.Unmarshal(body, &res); err != nil || res.NextCursor == "" {
		t.Fatalf("no cursor: %s", body)
	}
	return res.NextCursor
}

func FuzzCompile(f *testing.F) {
	f.Add(`{"filter":[{"field":"balance","op":"gte","value":1}],"sort":[{"field":"id","desc":true}],"limit":3}`)
	f.Add(`{"cursor":"eyJkIjoiYWJjIn0"}`)
	f.Fuzz(func(t *testing.T, body string) {
		var q Query
		if json.Unmarshal([]byte(body), &q) != nil {
			return
		}
		for _, v := range Views {
			p, err := compile(v, q)
			if err == nil {
				ts := newTenantState("x")
				ts.accounts["a"] = &AccountRow{ID: "a"}
				ts.txs = []TxRow{{Seq: 1, Account: "a", Kind: TxDeposit, Amount: 1}}
				p.run(ts)
			}
		}
	})
}
