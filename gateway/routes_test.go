package gateway

import (
	"testing"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

func TestRouteMatch(t *testing.T) {
	r := newRegistry(&Gateway{})
	for _, rt := range []struct{ method, prefix, kind string }{
		{"*", "/", "root"},
		{"*", "/api/", "any"},
		{"POST", "/api/orders/", "orders-post"},
		{"*", "/api/orders/", "orders"},
		{"GET", "/api/orders/special", "special-get"},
	} {
		r.routes[rt.method+rt.prefix] = schema.Route{Method: rt.method, Prefix: rt.prefix, Kind: rt.kind}
	}
	r.rebuild()
	s := r.snap.Load()
	for _, tc := range []struct{ method, path, want string }{
		{"GET", "/", "root"},
		{"GET", "/other", "root"},
		{"GET", "/api/x", "any"},
		{"POST", "/api/orders/1", "orders-post"},
		{"GET", "/api/orders/1", "orders"},
		{"GET", "/api/orders/special/1", "special-get"},
		{"POST", "/api/orders/special/1", "orders-post"},
		{"DELETE", "/api/orders/special", "orders"},
	} {
		got := s.match(tc.method, tc.path)
		if got == nil || got.kind != tc.want {
			t.Errorf("%s %s -> %v, want %s", tc.method, tc.path, got, tc.want)
		}
	}
	r.routes = map[string]schema.Route{}
	r.rebuild()
	if r.snap.Load().match("GET", "/") != nil {
		t.Error("empty table matched")
	}
}
