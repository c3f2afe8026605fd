package server

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/openapitest"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/rebalancer/sweeper"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// servedRoutes walks the router: every method and pattern it serves. A pattern registered for
// every method (Handle) is "*"; the dashboard's catch-all /* is its page, /.
func servedRoutes(t *testing.T, h http.Handler) []openapitest.Route {
	t.Helper()
	methods := map[string][]string{}
	var order []string
	err := chi.Walk(h.(chi.Routes), func(method, route string, _ http.Handler, _ ...func(http.Handler) http.Handler) error {
		if route == "/*" {
			route = "/"
		}
		if _, ok := methods[route]; !ok {
			order = append(order, route)
		}
		methods[route] = append(methods[route], method)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	var out []openapitest.Route
	for _, route := range order {
		ms := methods[route]
		if len(ms) >= 9 { // chi registers Handle for all nine methods
			out = append(out, openapitest.Route{Method: "*", Path: route})
			continue
		}
		for _, m := range ms {
			out = append(out, openapitest.Route{Method: m, Path: route})
		}
	}
	return out
}

// TestOpenAPI: openapi.json is a valid OpenAPI 3.1 document whose examples match their schemas,
// it documents exactly the routes the router serves, the server serves it, and real answers of
// a running rebalancer (real NATS, real shards, a plan applied) match the documented responses.
func TestOpenAPI(t *testing.T) {
	doc := openapitest.Load(t, OpenAPI())
	if n := openapitest.CheckExamples(t, doc); n < 20 {
		t.Errorf("only %d examples checked", n)
	}
	srv := natstest.Server(t)
	st := openStore(t, srv.URL())
	for _, s := range []string{"aggregate-1", "aggregate-2"} {
		startShard(t, st, s)
	}
	r := start(t, st, "r1", sweeper.Config{})
	openapitest.CheckRoutes(t, doc, servedRoutes(t, r.s.Handler()))
	r.await(t, "leadership", leading)

	c := &openapitest.Client{T: t, Doc: doc, Base: r.ts.URL}
	admin := http.Header{"Authorization": {"Bearer " + testToken}}
	if code, body := c.Do("GET", "/openapi.json", "/openapi.json", nil, nil); code != 200 || !strings.Contains(string(body), `"openapi": "3.1.0"`) {
		t.Fatalf("GET /openapi.json: %d", code)
	}
	c.Do("GET", "/healthz", "/healthz", nil, nil)
	c.Do("GET", "/readyz", "/readyz", nil, nil)
	c.Do("GET", "/metrics", "/metrics", nil, nil)
	c.Do("GET", "/", "/", nil, nil)
	c.Do("GET", "/api/leader", "/api/leader", nil, nil)
	c.Do("GET", "/api/kinds", "/api/kinds", nil, nil)
	c.Do("PUT", "/api/kinds/{kind}", "/api/kinds/aggregate", map[string]any{"policy": "managed", "hold_budget": "2s"}, admin)
	c.Do("PUT", "/api/kinds/{kind}", "/api/kinds/aggregate", map[string]any{"polcy": "managed"}, admin)
	c.Do("PUT", "/api/kinds/{kind}", "/api/kinds/aggregate", map[string]any{"policy": "managed"}, nil)
	tmtest.WaitFor(t, 20*time.Second, tmtest.Until("both shards in the directory", func() bool {
		insts, err := st.Directory().Instances(t.Context(), "aggregate")
		return err == nil && len(insts) == 2
	}))
	c.Do("GET", "/api/instances", "/api/instances?kind=aggregate", nil, nil)
	if code, body := c.Do("GET", "/api/instances", "/api/instances?kind=aggregate&status=online,degraded&label=region=eu", nil, nil); code != 200 || strings.Contains(string(body), "aggregate-1") {
		t.Fatalf("instances filtered by a label no instance has: %d %s", code, body)
	}
	c.Do("GET", "/api/instances", "/api/instances?status=sleeping", nil, nil)
	inst := "/api/instances/aggregate.aggregate-1.i1"
	c.Do("PUT", "/api/instances/{key}/degraded", inst+"/degraded", map[string]any{"reason": "disk replacement"}, admin)
	c.Do("PUT", "/api/instances/{key}/degraded", inst+"/degraded", map[string]any{"reason": "x"}, nil)
	c.Do("PUT", "/api/instances/{key}/degraded", inst+"/degraded", map[string]any{"typo": "x"}, admin)
	c.Do("GET", "/api/instances/{key}", inst, nil, nil)
	c.Do("DELETE", "/api/instances/{key}/degraded", inst+"/degraded", nil, admin)
	c.Do("GET", "/api/instances/{key}", "/api/instances/aggregate.aggregate-9.i1", nil, nil)
	c.Do("GET", "/api/instances/{key}", "/api/instances/nodots", nil, nil)
	for _, tenant := range []string{"acme", "globex", "initech"} {
		if _, err := st.Placements("aggregate").Create(t.Context(), schema.Placement{Tenant: tenant, Shard: "aggregate-1"}); err != nil {
			t.Fatal(err)
		}
	}
	c.Do("POST", "/api/plans", "/api/plans", map[string]any{"strategy": "balance", "kind": "aggregate", "dry_run": true}, admin)
	c.Do("POST", "/api/plans", "/api/plans", map[string]any{"strategy": "manual", "kind": "aggregate",
		"moves": []any{map[string]any{"tenant": "nobody", "to": "aggregate-2"}}}, admin)
	c.Do("POST", "/api/plans", "/api/plans", map[string]any{"strategy": "balance", "kind": "aggregate", "typo": 1}, admin)
	code, body := c.Do("POST", "/api/plans", "/api/plans", map[string]any{"strategy": "manual", "kind": "aggregate",
		"moves": []any{map[string]any{"tenant": "acme", "to": "aggregate-2"}}}, admin)
	if code != http.StatusCreated {
		t.Fatalf("POST /api/plans: %d %s", code, body)
	}
	id := planID(t, body)
	c.Do("GET", "/api/plans", "/api/plans?limit=10", nil, nil)
	c.Do("GET", "/api/plans", "/api/plans?limit=-1", nil, nil)
	c.Do("GET", "/api/plans/{id}", "/api/plans/"+id, nil, nil)
	c.Do("GET", "/api/plans/{id}", "/api/plans/p-none", nil, nil)
	c.Do("POST", "/api/plans/{id}/apply", "/api/plans/"+id+"/apply", nil, nil)
	c.Do("POST", "/api/plans/{id}/apply", "/api/plans/p-none/apply", nil, admin)
	if code, _ := c.Do("POST", "/api/plans/{id}/apply", "/api/plans/"+id+"/apply", nil, admin); code != http.StatusAccepted {
		t.Fatalf("apply: %d", code)
	}
	tmtest.WaitFor(t, 30*time.Second, tmtest.Until("the plan to finish", func() bool {
		var pr PlanResponse
		_, body := c.Do("GET", "/api/plans/{id}", "/api/plans/"+id, nil, nil)
		return json.Unmarshal(body, &pr) == nil && pr.Plan.Status == "done"
	}))
	c.Do("POST", "/api/plans/{id}/apply", "/api/plans/"+id+"/apply", nil, admin)
	c.Do("GET", "/api/plans/{id}/verify", "/api/plans/"+id+"/verify", nil, nil)
	c.Do("GET", "/api/plans/{id}/verify", "/api/plans/p-none/verify", nil, nil)
	c.Do("GET", "/api/plans/{id}/moves/{move}/verify", "/api/plans/"+id+"/moves/m00001/verify", nil, nil)
	c.Do("GET", "/api/plans/{id}/moves/{move}/verify", "/api/plans/"+id+"/moves/m00009/verify", nil, nil)
	c.Do("GET", "/api/audit", "/api/audit?kind=aggregate&since=1h&limit=50", nil, nil)
	c.Do("GET", "/api/audit", "/api/audit?since=yesterday", nil, nil)
	c.Do("POST", "/api/plans/{id}/rollback", "/api/plans/"+id+"/rollback", nil, admin)
	for _, want := range []string{"POST /api/plans 201", "POST /api/plans 200", "POST /api/plans 422", "POST /api/plans 400",
		"POST /api/plans/{id}/apply 202", "POST /api/plans/{id}/apply 401", "POST /api/plans/{id}/apply 404",
		"POST /api/plans/{id}/apply 409", "GET /api/plans/{id} 404", "PUT /api/kinds/{kind} 200", "PUT /api/kinds/{kind} 400",
		"PUT /api/kinds/{kind} 401", "GET /api/audit 200", "GET /api/audit 400", "GET /api/instances 200", "GET /api/instances 400",
		"GET /api/instances/{key} 200", "GET /api/instances/{key} 404", "GET /api/instances/{key} 400", "PUT /api/instances/{key}/degraded 200",
		"PUT /api/instances/{key}/degraded 401", "PUT /api/instances/{key}/degraded 400", "DELETE /api/instances/{key}/degraded 200",
		"GET /api/plans/{id}/verify 200", "GET /api/plans/{id}/verify 404", "GET /api/plans/{id}/moves/{move}/verify 200",
		"GET /api/plans/{id}/moves/{move}/verify 404"} {
		if !c.Seen[want] {
			t.Errorf("no answer %s was validated (validated: %v)", want, c.Seen)
		}
	}
}

// planID reads the id of the plan in a PlanResponse body.
func planID(t *testing.T, body []byte) string {
	t.Helper()
	var pr PlanResponse
	if err := json.Unmarshal(body, &pr); err != nil || pr.Plan.ID == "" {
		t.Fatalf("no plan id in %s: %v", body, err)
	}
	return pr.Plan.ID
}
