package schema

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
)

// Route is one entry of the route registry (Aether routing's HttpRouteValue): requests whose method
// and longest matching path prefix are these go to kind, served by Instances.
type Route struct {
	Method    string   `json:"method"` // "*" matches any method
	Prefix    string   `json:"prefix"`
	Kind      string   `json:"kind"`
	Instances []string `json:"instances"` // InstanceID keys, sorted

	Revision uint64 `json:"-"`
}

// Key is the route's key in tm_routes.
func (r Route) Key() string { return routeKey(r.Method, r.Prefix) }

// Validate checks method, prefix and kind.
func (r Route) Validate() error {
	if r.Method != "*" && (r.Method == "" || strings.ToUpper(r.Method) != r.Method || !isToken(r.Method)) {
		return fmt.Errorf("%w: route method %q must be an upper-case HTTP method or *", ErrInvalid, r.Method)
	}
	if !strings.HasPrefix(r.Prefix, "/") || len(r.Prefix) > 512 {
		return fmt.Errorf("%w: route prefix %q must start with / and be at most 512 bytes", ErrInvalid, truncate(r.Prefix, 40))
	}
	return CheckName("kind", r.Kind)
}

// maxCASAttempts bounds read-modify-write retries on contended keys.
const maxCASAttempts = 32

// AddRouteInstance adds id to the route (creating it), by CAS: Aether routing's publish.
func (s *Store) AddRouteInstance(ctx context.Context, r Route, id InstanceID) (Route, error) {
	return s.editRoute(ctx, r, func(cur *Route) bool {
		if cur.Kind != r.Kind {
			cur.Kind = r.Kind
		}
		k := id.Key()
		if i, found := slices.BinarySearch(cur.Instances, k); !found {
			cur.Instances = slices.Insert(cur.Instances, i, k)
			return true
		}
		return cur.Revision == 0
	})
}

// RemoveRouteInstance removes id from the route, deleting the route when it becomes empty:
// Aether routing's unpublish.
func (s *Store) RemoveRouteInstance(ctx context.Context, r Route, id InstanceID) (Route, error) {
	return s.editRoute(ctx, r, func(cur *Route) bool {
		k := id.Key()
		if i, found := slices.BinarySearch(cur.Instances, k); found {
			cur.Instances = slices.Delete(cur.Instances, i, i+1)
			return true
		}
		return false
	})
}

// editRoute applies edit to the stored route by CAS, retrying on conflict. edit reports whether
// it changed anything. An emptied route is deleted.
func (s *Store) editRoute(ctx context.Context, r Route, edit func(*Route) bool) (Route, error) {
	if err := r.Validate(); err != nil {
		return Route{}, err
	}
	key := r.Key()
	for range maxCASAttempts {
		var cur Route
		rev, err := s.getJSON(ctx, s.routes, key, &cur)
		switch {
		case errors.Is(err, ErrNotFound):
			cur = Route{Method: r.Method, Prefix: r.Prefix, Kind: r.Kind}
		case errors.Is(err, ErrCorrupt):
			s.opts.Logger.Warn("replacing corrupt route", "key", key, "err", err)
			cur = Route{Method: r.Method, Prefix: r.Prefix, Kind: r.Kind}
		case err != nil:
			return Route{}, err
		}
		cur.Revision = rev
		if !edit(&cur) {
			return cur, nil
		}
		if len(cur.Instances) == 0 {
			if rev == 0 {
				return cur, nil
			}
			err = s.deleteKey(ctx, s.routes, key, rev)
			if err == nil {
				cur.Revision = 0
				return cur, nil
			}
		} else {
			var nrev uint64
			nrev, err = s.casJSON(ctx, s.routes, key, rev, cur)
			if err == nil {
				cur.Revision = nrev
				return cur, nil
			}
		}
		if !errors.Is(err, ErrConflict) {
			return Route{}, err
		}
	}
	return Route{}, fmt.Errorf("schema: route %s %s: gave up after %d conflicting writers", r.Method, r.Prefix, maxCASAttempts)
}

// RouteFor reads one route.
func (s *Store) RouteFor(ctx context.Context, method, prefix string) (Route, error) {
	var r Route
	rev, err := s.getJSON(ctx, s.routes, routeKey(method, prefix), &r)
	if err != nil {
		return Route{}, err
	}
	r.Revision = rev
	return r, nil
}

// Routes lists the registry.
func (s *Store) Routes(ctx context.Context) ([]Route, error) {
	var out []Route
	_, err := listJSON(ctx, s, s.routes, ">", func(_ string, rev uint64, r Route) {
		r.Revision = rev
		out = append(out, r)
	})
	return out, err
}

// RemoveInstanceFromRoutes removes id from every route (the sweeper's cleanup of a dead
// instance, Aether routing). It returns how many routes changed.
func (s *Store) RemoveInstanceFromRoutes(ctx context.Context, id InstanceID) (int, error) {
	routes, err := s.Routes(ctx)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, r := range routes {
		if !slices.Contains(r.Instances, id.Key()) {
			continue
		}
		if _, err := s.RemoveRouteInstance(ctx, r, id); err != nil {
			return n, err
		}
		n++
	}
	return n, nil
}
