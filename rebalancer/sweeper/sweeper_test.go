package sweeper

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/kittest"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

func openStore(t *testing.T) *schema.Store {
	st, _ := kittest.Store(t)
	return st
}

// putInstance writes a directory entry as is (with a heartbeat in the past), as an instance
// that died long ago would have left it.
func putInstance(t *testing.T, st *schema.Store, kind, shard, name string, heartbeat time.Time) schema.InstanceID {
	t.Helper()
	id := schema.InstanceID{Kind: kind, Shard: shard, Instance: name}
	i := schema.Instance{InstanceID: id, URL: "http://127.0.0.1:9", Capacity: 4, Started: heartbeat, Heartbeat: heartbeat, Reported: schema.StatusOnline}
	b, _ := json.Marshal(i)
	if _, err := st.KV(schema.BucketInstances).Put(context.Background(), id.Key(), b); err != nil {
		t.Fatal(err)
	}
	return id
}

func addRoute(t *testing.T, st *schema.Store, prefix string, ids ...schema.InstanceID) schema.Route {
	t.Helper()
	r := schema.Route{Method: "*", Prefix: prefix, Kind: ids[0].Kind}
	for _, id := range ids {
		if _, err := st.Routes().AddInstance(context.Background(), r, id); err != nil {
			t.Fatal(err)
		}
	}
	return r
}

// webhook records alerts; it fails the first failFirst requests with 500.
type webhook struct {
	mu        sync.Mutex
	alerts    []Alert
	failFirst int
	calls     int
}

func (h *webhook) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls++
	if h.calls <= h.failFirst {
		http.Error(w, "try later", http.StatusInternalServerError)
		return
	}
	b, _ := io.ReadAll(r.Body)
	var a Alert
	if json.Unmarshal(b, &a) == nil {
		h.alerts = append(h.alerts, a)
	}
}

func (h *webhook) got() ([]Alert, int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]Alert(nil), h.alerts...), h.calls
}

// TestSweepMarksOfflineAlertsOnceAndCleansUp: an instance silent for longer than the offline
// threshold is marked offline, alerted once (after a failed first POST is retried), removed
// from every route (an emptied route is deleted) and from affinity owners; a live instance
// and its routes are untouched; a second sweep does nothing more.
func TestSweepMarksOfflineAlertsOnceAndCleansUp(t *testing.T) {
	st := openStore(t)
	ctx := context.Background()
	if _, err := st.Kinds().Put(ctx, schema.KindConfig{Kind: "render", Policy: schema.PolicyAffinity}); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	dead := putInstance(t, st, "render", "render-1", "dead", now.Add(-3*time.Minute))
	live := putInstance(t, st, "render", "render-1", "live", now)
	shared := addRoute(t, st, "/render", dead, live)
	only := addRoute(t, st, "/legacy", dead)
	both, err := st.Placements("render").Create(ctx, schema.Placement{Tenant: "acme", Shard: "render-1", Owners: []string{dead.Key(), live.Key()}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Placements("render").Create(ctx, schema.Placement{Tenant: "solo", Shard: "render-1", Owners: []string{dead.Key()}}); err != nil {
		t.Fatal(err)
	}

	hook := &webhook{failFirst: 1}
	hs := httptest.NewServer(hook)
	defer hs.Close()
	var events []Event
	sw, err := New(Config{Store: st, Webhook: hs.URL, WebhookTimeout: time.Second, Now: func() time.Time { return now },
		Health:  rebalancer.Health{Thresholds: schema.Thresholds{OfflineAfter: 2 * time.Minute}},
		OnEvent: func(ev Event) { events = append(events, ev) }})
	if err != nil {
		t.Fatal(err)
	}
	res, err := sw.Sweep(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Offline) != 1 || res.Offline[0] != dead.Key() || res.Routes != 2 || res.Owners != 2 {
		t.Fatalf("sweep result %+v", res)
	}
	got, err := st.Directory().Instance(ctx, dead)
	if err != nil || got.Reported != schema.StatusOffline {
		t.Fatalf("dead instance after sweep: %+v, %v", got, err)
	}
	// Shard instances follow memberships, not heartbeats: the sweep is how they learn.
	members, err := st.Directory().Members(ctx, dead.Kind)
	if err != nil {
		t.Fatal(err)
	}
	marked := false
	for _, m := range members {
		if m.Key() == dead.Key() {
			marked = m.Reported == schema.StatusOffline
		}
	}
	if !marked {
		t.Fatalf("the dead instance's membership after the sweep: %+v", members)
	}
	if r, err := st.Routes().Get(ctx, "render", "*", "/render"); err != nil || len(r.Instances) != 1 || r.Instances[0] != live.Key() {
		t.Fatalf("shared route: %+v, %v", r, err)
	}
	if _, err := st.Routes().Get(ctx, only.Kind, only.Method, only.Prefix); !errors.Is(err, schema.ErrNotFound) {
		t.Fatalf("a route left without instances must be deleted: %v", err)
	}
	if p, err := st.Placements("render").Get(ctx, "acme"); err != nil || len(p.Owners) != 1 || p.Owners[0] != live.Key() || p.Epoch != both.Epoch {
		t.Fatalf("acme owners: %+v, %v", p, err)
	}
	if _, err := st.Placements("render").Get(ctx, "solo"); !errors.Is(err, schema.ErrNotFound) {
		t.Fatalf("a placement left without owners must be deleted: %v", err)
	}
	alerts, calls := hook.got()
	if len(alerts) != 1 || calls != 2 || alerts[0].Type != AlertAgentOffline || alerts[0].Instance != dead.Key() || alerts[0].Content == "" {
		t.Fatalf("alerts %+v after %d calls, want one AGENT_OFFLINE after a retry", alerts, calls)
	}
	if _, err := sw.Sweep(ctx); err != nil {
		t.Fatal(err)
	}
	if alerts, _ := hook.got(); len(alerts) != 1 {
		t.Fatalf("a second sweep alerted again: %+v", alerts)
	}
	if len(events) != 0 {
		t.Fatalf("first sighting of instances is not a change: %+v", events)
	}
	// The instance comes back: it heartbeats itself online, and the sweeper reports the change.
	i, _ := st.Directory().Instance(ctx, dead)
	i.Reported = schema.StatusOnline // shardkit heartbeats its own entry, which says online
	if _, err := st.Directory().Heartbeat(ctx, i); err != nil {
		t.Fatal(err)
	}
	if _, err := sw.Sweep(ctx); err != nil {
		t.Fatal(err)
	}
	if len(events) != 1 || events[0].From != schema.StatusOffline || events[0].To == schema.StatusOffline {
		t.Fatalf("events after the instance came back: %+v", events)
	}
	_ = shared
}

// TestCleanupRoutesOnLeaderStart removes instances absent from the directory or offline from
// every route, and keeps live ones (Aether routing's cleanup on leader activation).
func TestCleanupRoutesOnLeaderStart(t *testing.T) {
	st := openStore(t)
	ctx := context.Background()
	now := time.Now()
	live := putInstance(t, st, "aggregate", "aggregate-1", "live", now)
	old := putInstance(t, st, "aggregate", "aggregate-1", "old", now.Add(-time.Hour))
	ghost := schema.InstanceID{Kind: "aggregate", Shard: "aggregate-2", Instance: "ghost"} // never in the directory
	addRoute(t, st, "/commands", live, old, ghost)
	addRoute(t, st, "/ghost", ghost)
	sw, err := New(Config{Store: st})
	if err != nil {
		t.Fatal(err)
	}
	n, err := sw.CleanupRoutes(ctx)
	if err != nil || n != 3 {
		t.Fatalf("cleanup removed %d, %v; want 3", n, err)
	}
	routes, _ := st.Routes().List(ctx)
	if len(routes) != 1 || len(routes[0].Instances) != 1 || routes[0].Instances[0] != live.Key() {
		t.Fatalf("routes after cleanup: %+v", routes)
	}
}

// TestWebhookGivesUp: a webhook answering 4xx is not retried; one answering 5xx is retried
// WebhookRetries times; neither blocks the sweep.
func TestWebhookGivesUp(t *testing.T) {
	st := openStore(t)
	ctx := context.Background()
	putInstance(t, st, "aggregate", "aggregate-1", "a", time.Now().Add(-time.Hour))
	var mu sync.Mutex
	calls := 0
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		calls++
		mu.Unlock()
		w.WriteHeader(http.StatusBadRequest)
	}))
	defer hs.Close()
	sw, err := New(Config{Store: st, Webhook: hs.URL, WebhookRetries: 2})
	if err != nil {
		t.Fatal(err)
	}
	res, err := sw.Sweep(ctx)
	if err != nil || len(res.Offline) != 1 {
		t.Fatalf("sweep %+v, %v", res, err)
	}
	mu.Lock()
	defer mu.Unlock()
	if calls != 1 {
		t.Fatalf("a 400 was posted %d times, want once", calls)
	}
}
