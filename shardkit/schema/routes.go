package schema

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/backoff"

	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
)

// Route is one entry of the route registry (Aether routing's HttpRouteValue): requests whose method
// and longest matching path prefix are these go to kind, served by Instances.
type Route struct {
	Method    string   `json:"method"` // "*" matches any method
	Prefix    string   `json:"prefix"`
	Kind      string   `json:"kind"`
	Instances []string `json:"instances"` // InstanceID keys, sorted
	// Producer, if set, makes the route a producer route (see ProducerRoute).
	Producer *ProducerRoute `json:"producer,omitempty"`
	// Consumer, if set, makes the route a consumer route (see ConsumerRoute).
	Consumer *ConsumerRoute `json:"consumer,omitempty"`

	Revision uint64 `json:"-"`
	// key is where the route was read from (List, Get), so an edit writes the same key even
	// when it is in the format before kinds led the key.
	key string
}

// Key is the route's key in tm_routes: <kind>.<METHOD>.<base64url(prefix)> (or the key it
// was read from).
func (r Route) Key() string {
	if r.key != "" {
		return r.key
	}
	return routeKey(r.Kind, r.Method, r.Prefix)
}

// Validate checks method, prefix and kind.
func (r Route) Validate() error {
	if r.Method != "*" && (r.Method == "" || strings.ToUpper(r.Method) != r.Method || !isToken(r.Method)) {
		return fmt.Errorf("%w: route method %q must be an upper-case HTTP method or *", ErrInvalid, r.Method)
	}
	if !strings.HasPrefix(r.Prefix, "/") || len(r.Prefix) > 512 {
		return fmt.Errorf("%w: route prefix %q must start with / and be at most 512 bytes", ErrInvalid, truncate(r.Prefix, 40))
	}
	if r.Producer != nil {
		if err := r.Producer.Validate(); err != nil {
			return err
		}
	}
	if r.Consumer != nil {
		if err := r.Consumer.Validate(); err != nil {
			return err
		}
	}
	return CheckName("kind", r.Kind)
}

// RouteRegistry is tm_routes, the route registry: which kind, and which of its instances, serve
// a method and path prefix.
type RouteRegistry struct{ s *Store }

// Routes is the route registry.
func (s *Store) Routes() RouteRegistry { return RouteRegistry{s} }

// maxCASAttempts bounds read-modify-write retries on contended keys.
const maxCASAttempts = 32

// AddInstance adds id to the route (creating it), by CAS: Aether routing's publish.
func (rr RouteRegistry) AddInstance(ctx context.Context, r Route, id InstanceID) (Route, error) {
	return rr.edit(ctx, r, func(cur *Route) bool {
		changed := false
		if cur.Kind != r.Kind {
			cur.Kind, changed = r.Kind, true
		}
		if !sameProducer(cur.Producer, r.Producer) {
			cur.Producer, changed = r.Producer, true // the newest publisher's declaration wins
		}
		if !sameConsumer(cur.Consumer, r.Consumer) {
			cur.Consumer, changed = r.Consumer, true
		}
		k := id.Key()
		if i, found := slices.BinarySearch(cur.Instances, k); !found {
			cur.Instances = slices.Insert(cur.Instances, i, k)
			return true
		}
		return changed || cur.Revision == 0
	})
}

func sameConsumer(a, b *ConsumerRoute) bool {
	return a == nil && b == nil || a != nil && b != nil && slices.Equal(a.Key, b.Key)
}

func sameProducer(a, b *ProducerRoute) bool {
	return a == nil && b == nil || a != nil && b != nil && *a == *b
}

// RemoveInstance removes id from the route, deleting the route when it becomes empty:
// Aether routing's unpublish.
func (rr RouteRegistry) RemoveInstance(ctx context.Context, r Route, id InstanceID) (Route, error) {
	return rr.edit(ctx, r, func(cur *Route) bool {
		k := id.Key()
		if i, found := slices.BinarySearch(cur.Instances, k); found {
			cur.Instances = slices.Delete(cur.Instances, i, i+1)
			return true
		}
		return false
	})
}

// edit applies edit to the stored route by CAS, retrying on conflict (writers that collided
// back off at random, or they collide again). edit reports whether it changed anything. An
// emptied route is deleted.
func (rr RouteRegistry) edit(ctx context.Context, r Route, edit func(*Route) bool) (Route, error) {
	if err := r.Validate(); err != nil {
		return Route{}, err
	}
	var out Route
	err := backoff.Retry(ctx, backoff.Policy{Initial: 2 * time.Millisecond, Max: 50 * time.Millisecond, Tries: maxCASAttempts,
		RetryIf: func(err error) bool { return errors.Is(err, ErrConflict) },
	}, func(ctx context.Context) (err error) {
		out, err = rr.editOnce(ctx, r, edit)
		return err
	})
	switch {
	case err == nil:
		return out, nil
	case !errors.Is(err, ErrConflict):
		return Route{}, err
	case ctx.Err() != nil:
		return Route{}, ctx.Err()
	}
	return Route{}, fmt.Errorf("schema: route %s %s: gave up after %d conflicting writers", r.Method, r.Prefix, maxCASAttempts)
}

// editOnce is one try of edit: a read, edit, and a write of the stored route if it changed.
func (rr RouteRegistry) editOnce(ctx context.Context, r Route, edit func(*Route) bool) (Route, error) {
	key := r.Key()
	var cur Route
	rev, err := rr.s.js.Records(rr.s.routes).Get(ctx, key, &cur)
	switch {
	case errors.Is(err, ErrNotFound):
		cur = Route{Method: r.Method, Prefix: r.Prefix, Kind: r.Kind}
	case errors.Is(err, ErrCorrupt):
		rr.s.opts.Logger.Warn("replacing corrupt route", "key", key, "err", err)
		cur = Route{Method: r.Method, Prefix: r.Prefix, Kind: r.Kind}
	case err != nil:
		return Route{}, err
	}
	cur.Revision, cur.key = rev, key
	if !edit(&cur) {
		return cur, nil
	}
	if len(cur.Instances) == 0 {
		if rev == 0 {
			return cur, nil
		}
		if err := rr.s.js.Records(rr.s.routes).Delete(ctx, key, rev); err != nil {
			return Route{}, err
		}
		cur.Revision = 0
		return cur, nil
	}
	nrev, err := rr.s.js.Records(rr.s.routes).CompareAndSet(ctx, key, rev, cur)
	if err != nil {
		return Route{}, err
	}
	cur.Revision = nrev
	return cur, nil
}

// Get reads one route of kind.
func (rr RouteRegistry) Get(ctx context.Context, kind, method, prefix string) (Route, error) {
	var r Route
	key := routeKey(kind, method, prefix)
	rev, err := rr.s.js.Records(rr.s.routes).Get(ctx, key, &r)
	if err != nil {
		return Route{}, err
	}
	r.Revision, r.key = rev, key
	return r, nil
}

// List lists the registry.
func (rr RouteRegistry) List(ctx context.Context) ([]Route, error) {
	var out []Route
	_, err := jsx.ListJSON(ctx, rr.s.js.Records(rr.s.routes), ">", func(key string, rev uint64, r Route) {
		r.Revision, r.key = rev, key
		out = append(out, r)
	})
	return out, err
}

// RemoveInstanceEverywhere removes id from every route (the sweeper's cleanup of a dead
// instance, Aether routing). It returns how many routes changed.
func (rr RouteRegistry) RemoveInstanceEverywhere(ctx context.Context, id InstanceID) (int, error) {
	routes, err := rr.List(ctx)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, r := range routes {
		if r.Kind != id.Kind || !slices.Contains(r.Instances, id.Key()) {
			continue // an instance serves its own kind's routes only
		}
		if _, err := rr.RemoveInstance(ctx, r, id); err != nil {
			return n, err
		}
		n++
	}
	return n, nil
}
