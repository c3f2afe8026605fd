package gateway

import (
	"go/ast"
	"go/parser"
	"go/token"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/openapitest"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// adminPatterns reads, from the package's source, the patterns adminMux registers on its
// ServeMux, following the functions it hands the mux to (registerServerRoutes). A ServeMux
// cannot list its patterns, so the source is the route table; a pattern that is not a string
// literal fails the test.
func adminPatterns(t *testing.T) []string {
	t.Helper()
	fset := token.NewFileSet()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	funcs := map[string]*ast.FuncDecl{}
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		af, err := parser.ParseFile(fset, f, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range af.Decls {
			if fd, ok := d.(*ast.FuncDecl); ok {
				funcs[fd.Name.Name] = fd
			}
		}
	}
	var patterns []string
	seen := map[string]bool{}
	var walk func(name string)
	walk = func(name string) {
		fd := funcs[name]
		if fd == nil || seen[name] {
			if fd == nil {
				t.Fatalf("no func %s in package gateway", name)
			}
			return
		}
		seen[name] = true
		ast.Inspect(fd.Body, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok {
				return true
			}
			if recv, ok := sel.X.(*ast.Ident); ok && recv.Name == "mux" && (sel.Sel.Name == "Handle" || sel.Sel.Name == "HandleFunc") {
				lit, ok := call.Args[0].(*ast.BasicLit)
				if !ok || lit.Kind != token.STRING {
					t.Fatalf("%s: mux.%s with a pattern that is not a string literal", fset.Position(call.Pos()), sel.Sel.Name)
				}
				p, _ := strconv.Unquote(lit.Value)
				patterns = append(patterns, p)
				return true
			}
			for _, a := range call.Args {
				if id, ok := a.(*ast.Ident); ok && id.Name == "mux" {
					walk(sel.Sel.Name) // the mux is handed to another registering function
				}
			}
			return true
		})
	}
	walk("adminMux")
	return patterns
}

// patternRoute turns a ServeMux pattern into a route; the catch-all "/" (no method: the 404
// answer) is not one.
func patternRoute(p string) (openapitest.Route, bool) {
	method, path, ok := strings.Cut(p, " ")
	if !ok {
		return openapitest.Route{}, false
	}
	return openapitest.Route{Method: method, Path: strings.TrimSuffix(path, "{$}")}, true
}

// TestOpenAPI: openapi.json is a valid OpenAPI 3.1 document whose examples match their schemas;
// it documents exactly the admin mux's routes, each documented operation reaches its own
// handler (not the 404 catch-all), and a running gateway's answers (real NATS, a real shard
// instance and a registered prerender server) match the documented responses.
func TestOpenAPI(t *testing.T) {
	doc := openapitest.Load(t, OpenAPI())
	if n := openapitest.CheckExamples(t, doc); n < 10 {
		t.Errorf("only %d examples checked", n)
	}
	var served []openapitest.Route
	for _, p := range adminPatterns(t) {
		if r, ok := patternRoute(p); ok {
			served = append(served, r)
		}
	}
	openapitest.CheckRoutes(t, doc, served)
	mux := (&Gateway{cfg: Config{Registry: prometheus.NewRegistry(), Pprof: true}}).adminMux()
	for _, op := range openapitest.Operations(doc) {
		path := strings.NewReplacer("{kind}", "aggregate", "{tenant}", "acme", "{realm}", "acme").Replace(op.Path)
		if _, pattern := mux.Handler(httptest.NewRequest(op.Method, path, nil)); pattern == "/" || pattern == "" {
			t.Errorf("%v: the admin mux answers %s with its catch-all", op, path)
		}
	}

	if testing.Short() {
		return
	}
	render := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) }))
	t.Cleanup(render.Close)
	e := newEnv(t, Config{Pprof: true}, []schema.KindConfig{{Kind: "aggregate"}, renderKind(1, 4223, time.Hour)}, nil)
	b := newBackend(t, "aggregate", "aggregate-1", "a1")
	e.register(b, "", 100, schema.Route{Method: "*", Prefix: "/aggregates", Kind: "aggregate"})
	e.place("aggregate", "acme", "aggregate-1")
	e.waitServedBy("/aggregates/x", "acme", b.id.Key())

	c := &openapitest.Client{T: t, Doc: doc, Base: e.url}
	admin := http.Header{"Authorization": {"Bearer " + testAdminToken}}
	wrong := http.Header{"Authorization": {"Bearer nope"}}
	if code, body := c.Do("GET", "/admin/openapi.json", "/admin/openapi.json", nil, nil); code != 200 || !strings.Contains(string(body), `"openapi": "3.1.0"`) {
		t.Fatalf("GET /admin/openapi.json: %d", code)
	}
	c.Do("GET", "/healthz", "/healthz", nil, nil)
	c.Do("GET", "/readyz", "/readyz", nil, nil)
	c.Do("GET", "/metrics", "/metrics", nil, nil)
	c.Do("GET", "/", "/", nil, nil)
	c.Do("GET", "/admin/balance", "/admin/balance", nil, admin)
	c.Do("GET", "/admin/balance", "/admin/balance", nil, wrong)
	c.Do("GET", "/admin/placement/{kind}/{tenant}", "/admin/placement/aggregate/acme", nil, admin)
	c.Do("GET", "/admin/placement/{kind}/{tenant}", "/admin/placement/aggregate/nobody", nil, admin)
	c.Do("GET", "/admin/placement/{kind}/{tenant}", "/admin/placement/nokind/acme", nil, admin)
	c.Do("GET", "/admin/placement/{kind}/{tenant}", "/admin/placement/aggregate/a.b", nil, admin)
	c.Do("GET", "/debug/pprof/", "/debug/pprof/", nil, admin)
	c.Do("GET", "/debug/pprof/symbol", "/debug/pprof/symbol", nil, admin)
	reg := map[string]any{"data": map[string]any{"type": "prerender-server", "attributes": map[string]any{"url": render.URL, "capacity": 5}}}
	if code, body := c.Do("POST", "/prerender-servers", "/prerender-servers?kind=render", reg, admin); code != http.StatusNoContent {
		t.Fatalf("register: %d %s", code, body)
	}
	c.Do("POST", "/prerender-servers", "/prerender-servers?kind=aggregate", reg, admin)
	c.Do("POST", "/prerender-servers", "/prerender-servers?kind=render", reg, wrong)
	self := http.Header{"Authorization": admin["Authorization"], HeaderServerURL: {render.URL}}
	c.Do("DELETE", "/prerender-servers/realms/{realm}", "/prerender-servers/realms/acme?kind=render", nil, self)
	c.Do("DELETE", "/prerender-servers", "/prerender-servers?kind=render", nil, self)
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("the registration to be gone from the directory", func() bool {
		insts, err := e.st.Directory().Instances(t.Context(), "render")
		return err == nil && len(insts) == 0
	}))
	for _, want := range []string{"GET /readyz 200", "GET /admin/balance 200", "GET /admin/balance 401",
		"GET /admin/placement/{kind}/{tenant} 200", "GET /admin/placement/{kind}/{tenant} 404",
		"GET /admin/placement/{kind}/{tenant} 400", "POST /prerender-servers 204", "POST /prerender-servers 400",
		"POST /prerender-servers 401", "DELETE /prerender-servers 204", "DELETE /prerender-servers/realms/{realm} 204",
		"GET /debug/pprof/symbol 200"} {
		if !c.Seen[want] {
			t.Errorf("no answer %s was validated (validated: %v)", want, c.Seen)
		}
	}
}
