// Package openapitest checks an HTTP API against its OpenAPI 3.1 document in tests: the
// document is valid (kin-openapi, JSON Schema 2020-12), every example validates against its
// schema, the routes a server registers and the document's paths are the same set, and real
// responses match their documented status, content type and schema.
package openapitest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"
)

func init() {
	// Bodies kin-openapi has no decoder for: a page, and a server-sent event stream, both text.
	openapi3filter.RegisterBodyDecoder("text/html", openapi3filter.PlainBodyDecoder)
	openapi3filter.RegisterBodyDecoder("text/event-stream", openapi3filter.PlainBodyDecoder)
}

// Load parses and validates an OpenAPI 3.1 document, examples included.
func Load(t testing.TB, data []byte) *openapi3.T {
	t.Helper()
	loader := openapi3.NewLoader()
	doc, err := loader.LoadFromData(data)
	if err != nil {
		t.Fatalf("openapi: %v", err)
	}
	if !doc.IsOpenAPI31OrLater() || !strings.HasPrefix(doc.OpenAPI, "3.1") {
		t.Fatalf("openapi: version %q, want 3.1.x", doc.OpenAPI)
	}
	if err := doc.Validate(context.Background(), openapi3.EnableExamplesValidation()); err != nil {
		t.Fatalf("openapi: the document is invalid: %v", err)
	}
	return doc
}

// Route is a method and path template ({name} parameters) a server serves.
type Route struct{ Method, Path string }

func (r Route) String() string { return r.Method + " " + r.Path }

// Operations lists the document's operations.
func Operations(doc *openapi3.T) []Route {
	var out []Route
	for path, item := range doc.Paths.Map() {
		for method := range item.Operations() {
			out = append(out, Route{Method: method, Path: path})
		}
	}
	sortRoutes(out)
	return out
}

func sortRoutes(rs []Route) {
	sort.Slice(rs, func(i, j int) bool { return rs[i].String() < rs[j].String() })
}

// CheckRoutes reports served routes the document lacks and documented operations no route
// serves. Method "*" (a handler for every method) is matched by a documented GET.
func CheckRoutes(t testing.TB, doc *openapi3.T, served []Route) {
	t.Helper()
	ops := Operations(doc)
	if len(served) == 0 || len(ops) == 0 {
		t.Fatalf("openapi: %d routes served, %d documented", len(served), len(ops))
	}
	sortRoutes(served)
	for _, r := range served {
		want := r
		if r.Method == "*" {
			want.Method = http.MethodGet
		}
		if !slices.Contains(ops, want) {
			t.Errorf("openapi: %v is served but not documented", r)
		}
	}
	for _, op := range ops {
		if !slices.Contains(served, op) && !slices.Contains(served, Route{Method: "*", Path: op.Path}) {
			t.Errorf("openapi: %v is documented but not served", op)
		}
	}
}

// CheckExamples validates every example in the document against its schema: the examples of
// schemas (the examples keyword), of parameters and of request and response media types. It
// returns how many it checked.
func CheckExamples(t testing.TB, doc *openapi3.T) int {
	t.Helper()
	n := 0
	check := func(where string, s *openapi3.SchemaRef, v any) {
		t.Helper()
		if s == nil || s.Value == nil {
			t.Errorf("openapi: %s: an example without a schema", where)
			return
		}
		// Round-trip through JSON so numbers are float64, as in a decoded body.
		b, err := json.Marshal(v)
		if err != nil {
			t.Errorf("openapi: %s: %v", where, err)
			return
		}
		var val any
		if err := json.Unmarshal(b, &val); err != nil {
			t.Errorf("openapi: %s: %v", where, err)
			return
		}
		if err := s.Value.VisitJSON(val, openapi3.EnableJSONSchema2020(), openapi3.MultiErrors()); err != nil {
			t.Errorf("openapi: %s: the example does not match its schema: %v", where, err)
		}
		n++
	}
	media := func(where string, c openapi3.Content) {
		for ct, mt := range c {
			if mt.Example != nil {
				check(where+" "+ct+" example", mt.Schema, mt.Example)
			}
			for name, ex := range mt.Examples {
				if ex.Value != nil {
					check(where+" "+ct+" example "+name, mt.Schema, ex.Value.Value)
				}
			}
		}
	}
	var schema func(where string, s *openapi3.SchemaRef, seen map[*openapi3.Schema]bool)
	schema = func(where string, s *openapi3.SchemaRef, seen map[*openapi3.Schema]bool) {
		if s == nil || s.Value == nil || seen[s.Value] {
			return
		}
		seen[s.Value] = true
		for i, ex := range s.Value.Examples {
			check(fmt.Sprintf("%s examples[%d]", where, i), s, ex)
		}
		if s.Value.Example != nil {
			check(where+" example", s, s.Value.Example)
		}
		for name, p := range s.Value.Properties {
			schema(where+"."+name, p, seen)
		}
		schema(where+"[]", s.Value.Items, seen)
		for i, sub := range slices.Concat(s.Value.AllOf, s.Value.OneOf, s.Value.AnyOf) {
			schema(fmt.Sprintf("%s/%d", where, i), sub, seen)
		}
	}
	seen := map[*openapi3.Schema]bool{}
	for name, s := range doc.Components.Schemas {
		schema("#/components/schemas/"+name, s, seen)
	}
	for name, r := range doc.Components.Responses {
		if r.Value != nil {
			media("#/components/responses/"+name, r.Value.Content)
		}
	}
	for _, op := range Operations(doc) {
		o := doc.Paths.Value(op.Path).GetOperation(op.Method)
		where := op.String()
		for _, p := range o.Parameters {
			if p.Value != nil && p.Value.Example != nil {
				check(where+" parameter "+p.Value.Name, p.Value.Schema, p.Value.Example)
			}
			if p.Value != nil {
				schema(where+" parameter "+p.Value.Name, p.Value.Schema, seen)
			}
		}
		if o.RequestBody != nil && o.RequestBody.Value != nil {
			media(where+" request", o.RequestBody.Value.Content)
		}
		for code, r := range o.Responses.Map() {
			if r.Value != nil {
				media(where+" "+code, r.Value.Content)
			}
		}
	}
	return n
}

// Client sends requests to a running server and validates each response against the document.
type Client struct {
	T    testing.TB
	Doc  *openapi3.T
	Base string // the server's URL
	// Header is added to every request (e.g. Authorization).
	Header http.Header
	// Seen collects the operations and statuses validated.
	Seen map[string]bool
}

// Do sends method to path (concrete, with its query) with body (nil or JSON-encoded), finds the
// operation by template, and checks the response: a documented status, the documented content
// type and a body valid against its schema. It returns the status and body.
func (c *Client) Do(method, template, path string, body any, header http.Header) (int, []byte) {
	c.T.Helper()
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			c.T.Fatal(err)
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, c.Base+path, rd)
	if err != nil {
		c.T.Fatal(err)
	}
	for k, vs := range c.Header {
		req.Header[k] = vs
	}
	for k, vs := range header {
		req.Header[k] = vs
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		c.T.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil {
		c.T.Fatalf("%s %s: %v", method, path, err)
	}
	c.Validate(req, template, resp.StatusCode, resp.Header, raw)
	return resp.StatusCode, raw
}

// Validate checks one response to req, whose operation has path template.
func (c *Client) Validate(req *http.Request, template string, status int, header http.Header, body []byte) {
	c.T.Helper()
	item := c.Doc.Paths.Value(template)
	if item == nil {
		c.T.Errorf("openapi: %s %s: no path %s in the document", req.Method, req.URL.Path, template)
		return
	}
	op := item.GetOperation(req.Method)
	if op == nil {
		c.T.Errorf("openapi: %s %s: %s has no %s operation", req.Method, req.URL.Path, template, req.Method)
		return
	}
	in := &openapi3filter.ResponseValidationInput{
		RequestValidationInput: &openapi3filter.RequestValidationInput{Request: req,
			Route: &routers.Route{Spec: c.Doc, Path: template, PathItem: item, Method: req.Method, Operation: op}},
		Status: status, Header: header,
		Options: &openapi3filter.Options{IncludeResponseStatus: true, MultiError: true},
	}
	in.SetBodyBytes(body)
	if err := openapi3filter.ValidateResponse(context.Background(), in); err != nil {
		c.T.Errorf("openapi: %s %s -> %d %s: %v\nbody: %.600s", req.Method, req.URL.RequestURI(), status, header.Get("Content-Type"), err, body)
	}
	if c.Seen == nil {
		c.Seen = map[string]bool{}
	}
	c.Seen[fmt.Sprintf("%s %s %d", req.Method, template, status)] = true
}
