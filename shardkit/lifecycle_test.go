package shardkit_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// watchInstance follows one directory entry; nil values are deletions.
func watchInstance(t *testing.T, st *schema.Store, key string) <-chan *schema.Instance {
	t.Helper()
	w, err := st.KV(schema.BucketInstances).Watch(context.Background(), key, jetstream.UpdatesOnly())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Stop() })
	ch := make(chan *schema.Instance, 64)
	go func() {
		for e := range w.Updates() {
			if e == nil {
				continue
			}
			var inst *schema.Instance
			if e.Operation() == jetstream.KeyValuePut {
				inst = new(schema.Instance)
				if json.Unmarshal(e.Value(), inst) != nil {
					continue
				}
				inst.Revision = e.Revision()
			}
			select {
			case ch <- inst:
			default:
			}
		}
	}()
	return ch
}

func nextInstance(t *testing.T, ch <-chan *schema.Instance, what string, ok func(*schema.Instance) bool) *schema.Instance {
	t.Helper()
	deadline := time.After(20 * time.Second)
	for {
		select {
		case inst := <-ch:
			if ok(inst) {
				return inst
			}
		case <-deadline:
			t.Fatalf("no directory update %s within 20s", what)
		}
	}
}

// Between refreshes the load report is the heartbeat: an instance publishes one every Heartbeat
// but writes its directory entry (a replicated JetStream write) only when it changes or every
// DirectoryRefresh. Here the refresh is an hour: ten load reports arrive and the entry is still
// the registration's; a change of the reported status (draining, at shutdown) is written.
func TestLoadReportsAreTheHeartbeat(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	place(t, st, schema.Placement{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1"})
	reports := loadReports(t, st, "aggregate", 64)
	a := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "a"), Heartbeat: 20 * time.Millisecond,
		DirectoryRefresh: time.Hour})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	reg, err := st.Directory().Instance(ctx, a.ID())
	if err != nil {
		t.Fatal(err)
	}
	if reg.Refresh() != time.Hour {
		t.Fatalf("the entry's refresh interval: %v, want 1h", reg.Refresh())
	}
	// The first heartbeat writes the entry once more, with the first metrics.
	var first schema.Instance
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("the first heartbeat's metrics in the directory", func() bool {
		first, err = st.Directory().Instance(ctx, a.ID())
		return err == nil && first.Metrics != nil
	}))
	for i := range 10 {
		select {
		case <-reports:
		case <-ctx.Done():
			t.Fatalf("%d load reports within 10s, want 10", i)
		}
	}
	now, err := st.Directory().Instance(ctx, a.ID())
	if err != nil {
		t.Fatal(err)
	}
	if now.Revision != first.Revision {
		t.Fatalf("the directory entry was rewritten (revision %d -> %d) with nothing changed", first.Revision, now.Revision)
	}
	if s := (schema.Thresholds{}).Status(now, time.Now()); s != schema.StatusOnline {
		t.Fatalf("status between refreshes: %s, want online", s)
	}
	updates := watchInstance(t, st, a.ID().Key())
	go func() { _ = a.Shutdown(context.WithoutCancel(ctx)) }()
	nextInstance(t, updates, "reporting draining", func(i *schema.Instance) bool { return i != nil && i.Reported == schema.StatusDraining })
}

// A shard instance learns a moving tenant's signals from its own shard's notes; a note for
// another shard does not reach it. (A lost note is covered by a waiting target's own reads of
// tm_tenant_state, which every move test goes through when it starts waiting.)
func TestSignalNotes(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	place(t, st, schema.Placement{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1"})
	b := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-2", "b")})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	// A signal noted for another shard: nothing.
	other, err := st.Signals().Put(ctx, schema.TenantSignal{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1", Instance: "y",
		Phase: schema.SignalDrained, Epoch: 1, Fence: 7})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Signals().Note("aggregate-3", other); err != nil {
		t.Fatal(err)
	}
	// Then a real signal noted for B's shard: B's view has it, with what was written.
	sig, err := st.Signals().Put(ctx, schema.TenantSignal{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1", Instance: "a",
		Phase: schema.SignalDrained, Epoch: 1, Fence: 42})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Signals().Note("aggregate-2", sig); err != nil {
		t.Fatal(err)
	}
	for {
		sigs, changed := b.SignalsForTest("t1", "aggregate-1")
		if got, ok := sigs["a"]; ok {
			if got.Fence != 42 || got.Phase != schema.SignalDrained {
				t.Fatalf("the noted signal in B's view: %+v", got)
			}
			if len(sigs) != 1 {
				t.Fatalf("B's view holds %d signals of aggregate-1 (%v); want only the one noted for it", len(sigs), sigs)
			}
			return
		}
		select {
		case <-changed:
		case <-ctx.Done():
			t.Fatalf("the noted signal did not reach B's view: %v", sigs)
		}
	}
}

// An instance heartbeats into the directory, but its peers follow memberships, which carry no
// heartbeats: however many heartbeats A writes, B's view of the kind does not change. When A's
// heartbeats stop (its NATS connection is gone), the sweeper marks it offline; B sees that at
// once and stops forwarding to it.
func TestHeartbeatsStoppingMakeInstanceOffline(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	rev := place(t, st, schema.Placement{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1"}).Revision
	stA := kittest.StoreAt(t, srv.URL())
	updates := watchInstance(t, st, "aggregate.aggregate-1.a")
	a := startShard(t, shardkit.Config{Store: stA, ID: id("aggregate-1", "a"), Heartbeat: 50 * time.Millisecond,
		DirectoryRefresh: 50 * time.Millisecond})
	b := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-2", "b"), Forward: true})
	synced(t, rev, b)

	first := nextInstance(t, updates, "registration", func(i *schema.Instance) bool { return i != nil })
	awaitPeer(t, b, a.ID(), func(i schema.Instance) bool { return i.URL == a.URL })
	awaitPeer(t, b, b.ID(), func(i schema.Instance) bool { return i.URL == b.URL })
	seen := b.PeerVersionForTest()
	beat := first
	for range 5 { // five heartbeats after the registration B has seen
		beat = nextInstance(t, updates, "heartbeat", func(i *schema.Instance) bool { return i != nil && i.Heartbeat.After(beat.Heartbeat) })
	}
	if beat.Metrics == nil || beat.URL != a.URL || beat.Reported != schema.StatusOnline {
		t.Fatalf("heartbeat entry: %+v", beat)
	}
	// A heartbeat that reached B would have been applied before the membership write a
	// change makes now: that write is B's next version.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := st.Directory().PutMember(ctx, schema.Instance{InstanceID: id("aggregate-9", "probe"), URL: "http://127.0.0.1:1"}); err != nil {
		t.Fatal(err)
	}
	awaitPeer(t, b, id("aggregate-9", "probe"), func(schema.Instance) bool { return true })
	if got := b.PeerVersionForTest(); got != seen+1 {
		t.Fatalf("B's view applied %d entries across 5 heartbeats of A and one membership change; want 1", got-seen)
	}
	if s, _ := b.PeerStatus(a.ID()); s != schema.StatusOnline {
		t.Fatalf("A while it heartbeats: %s", s)
	}
	if code, _, body := call(t, "GET", b.URL+"/t/x", "t1", nil, ""); code != http.StatusOK {
		t.Fatalf("forward to the live owner: %d %s", code, body)
	}

	stA.JS().Conn().Close() // A's heartbeats stop; its entries stay behind, as after a crash
	last, err := st.Directory().Instance(ctx, a.ID())
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Directory().MarkOffline(ctx, last); err != nil { // what the sweeper does after OfflineAfter
		t.Fatal(err)
	}
	awaitPeer(t, b, a.ID(), func(i schema.Instance) bool { return i.Reported == schema.StatusOffline })
	if s, _ := b.PeerStatus(a.ID()); s != schema.StatusOffline {
		t.Fatalf("A once marked offline: %s", s)
	}
	code, h, body := call(t, "GET", b.URL+"/t/x", "t1", nil, "")
	if p := problemOf(t, h, body); code != http.StatusServiceUnavailable || p.Owner != "aggregate-1" {
		t.Fatalf("forward to an offline owner: %d %+v", code, p)
	}
}

// An instance the sweeper wrongly marked offline (it was cut off for a while) writes its
// membership back at its next heartbeat, and its peers see it online again.
func TestMarkedOfflineInstanceComesBack(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	a := startShard(t, shardkit.Config{Store: kittest.StoreAt(t, srv.URL()), ID: id("aggregate-1", "a"), Heartbeat: 50 * time.Millisecond})
	b := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "b")})
	awaitPeer(t, b, a.ID(), func(i schema.Instance) bool { return i.URL == a.URL })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	inst, err := st.Directory().Instance(ctx, a.ID())
	if err != nil {
		t.Fatal(err)
	}
	for { // a heartbeat may land between the read and the CAS: read again
		err = st.Directory().MarkOffline(ctx, inst)
		if !errors.Is(err, schema.ErrConflict) {
			break
		}
		if inst, err = st.Directory().Instance(ctx, a.ID()); err != nil {
			t.Fatal(err)
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	m := awaitPeer(t, b, a.ID(), func(i schema.Instance) bool { return i.Reported != schema.StatusOffline && i.Revision > inst.Revision })
	if m.Reported != schema.StatusOnline {
		t.Fatalf("A after coming back: %+v", m)
	}
}

// awaitPeer waits until s's membership view holds an entry for id that satisfies ok.
func awaitPeer(t *testing.T, s *testShard, id schema.InstanceID, ok func(schema.Instance) bool) schema.Instance {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for {
		inst, found, changed := s.PeerForTest(id)
		if found && ok(inst) {
			return inst
		}
		select {
		case <-changed:
		case <-ctx.Done():
			t.Fatalf("%s's view never showed the expected entry for %s (last %+v)", s.ID().Key(), id.Key(), inst)
		}
	}
}

// SIGTERM (Run's context ending) reports not-ready first, refuses new requests, waits for the
// one in flight, then leaves no directory entry and no route behind; routes shared with another
// instance keep only that one.
func TestShutdownLeavesNothingBehind(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	rev := place(t, st, schema.Placement{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1"}).Revision
	routes := []schema.Route{{Method: "POST", Prefix: "/t/commands"}, {Method: "GET", Prefix: "/t/state"}}
	a := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "a"), Routes: routes})
	b := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "b"), Routes: routes[:1]})
	synced(t, rev, a, b)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	routeInstances := func() map[string][]string {
		t.Helper()
		rs, err := st.Routes().List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		out := map[string][]string{}
		for _, r := range rs {
			out[r.Method+" "+r.Prefix] = r.Instances
		}
		return out
	}
	got := routeInstances()
	if !slices.Equal(got["POST /t/commands"], []string{"aggregate.aggregate-1.a", "aggregate.aggregate-1.b"}) ||
		!slices.Equal(got["GET /t/state"], []string{"aggregate.aggregate-1.a"}) {
		t.Fatalf("published routes: %v", got)
	}

	updates := watchInstance(t, st, "aggregate.aggregate-1.a")
	slow := make(chan int, 1)
	go func() { code, _, _ := call(t, "GET", a.URL+"/t/slow", "t1", nil, ""); slow <- code }()
	<-a.app.entered
	a.cancel() // SIGTERM
	nextInstance(t, updates, "draining", func(i *schema.Instance) bool { return i != nil && i.Reported == schema.StatusDraining })
	if code, _, _ := call(t, "GET", a.URL+"/readyz", "", nil, ""); code != http.StatusServiceUnavailable {
		t.Fatalf("readyz while draining: %d", code)
	}
	// The gate refuses new requests once the draining report is written (after ShutdownGrace);
	// a watcher may see the report a moment before that.
	tmtest.WaitFor(t, 5*time.Second, func() error {
		if code, _, _ := call(t, "GET", a.URL+"/t/x", "t1", nil, ""); code != http.StatusServiceUnavailable {
			return fmt.Errorf("new request while draining: %d, want 503", code)
		}
		return nil
	})
	if _, err := st.Directory().Instance(ctx, a.ID()); err != nil {
		t.Fatalf("entry gone while a request is in flight: %v", err)
	}
	close(a.app.release)
	if code := <-slow; code != http.StatusOK {
		t.Fatalf("in-flight request: %d", code)
	}
	if err := a.stop(t); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if _, err := st.Directory().Instance(ctx, a.ID()); !errors.Is(err, schema.ErrNotFound) {
		t.Fatalf("directory entry after shutdown: %v", err)
	}
	got = routeInstances()
	if !slices.Equal(got["POST /t/commands"], []string{"aggregate.aggregate-1.b"}) || got["GET /t/state"] != nil {
		t.Fatalf("routes after A's shutdown: %v", got)
	}

	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if err := b.stop(t); err != nil {
		t.Fatalf("Run after Close: %v", err)
	}
	if got := routeInstances(); len(got) != 0 {
		t.Fatalf("routes after both shut down: %v", got)
	}
	if _, err := st.Directory().Instance(ctx, b.ID()); !errors.Is(err, schema.ErrNotFound) {
		t.Fatalf("B's entry after Close: %v", err)
	}
}

// Admin routes refuse a missing or wrong token, and everything when no token is configured;
// health and metrics stay open.
func TestAdminRoutesNeedToken(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	t.Setenv(shardkit.EnvAdminToken, "")
	open := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "a")})
	locked := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "b"), AdminToken: testToken})
	paths := []struct{ method, path string }{
		{"GET", "/admin/tenants"}, {"POST", "/admin/reload"}, {"POST", "/admin/drain?tenant_id=t1"}, {"GET", "/admin/drain?tenant_id=t1"},
	}
	for _, p := range paths {
		if code, body := admin(t, p.method, open.URL+p.path, testToken); code != http.StatusForbidden {
			t.Fatalf("%s %s without a configured token: %d %s", p.method, p.path, code, body)
		}
		for _, tok := range []string{"", "wrong", testToken + "x"} {
			if code, _ := admin(t, p.method, locked.URL+p.path, tok); code != http.StatusUnauthorized {
				t.Fatalf("%s %s with token %q: %d", p.method, p.path, tok, code)
			}
		}
	}
	for _, p := range []string{"/admin/tenants", "/admin/drain?tenant_id=t1"} {
		if code, body := admin(t, "GET", locked.URL+p, testToken); code != http.StatusOK {
			t.Fatalf("GET %s with the token: %d %s", p, code, body)
		}
	}
	if code, body := admin(t, "POST", locked.URL+"/admin/reload", testToken); code != http.StatusOK {
		t.Fatalf("reload: %d %s", code, body)
	}
	if code, body := admin(t, "GET", locked.URL+"/admin/drain?tenant_id=bad/id", testToken); code != http.StatusBadRequest {
		t.Fatalf("bad tenant id: %d %s", code, body)
	}
	for _, p := range []string{"/healthz", "/readyz", "/metrics"} {
		if code, _ := admin(t, "GET", open.URL+p, ""); code != http.StatusOK {
			t.Fatalf("GET %s: %d", p, code)
		}
	}
}

// A route a sweeper removed while the instance was cut off comes back with its heartbeats.
func TestRoutesRepublished(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	routes := []schema.Route{{Method: "GET", Prefix: "/t/state"}}
	a := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "a"), Routes: routes, Heartbeat: 20 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	w, err := st.KV(schema.BucketRoutes).Watch(ctx, ">", jetstream.UpdatesOnly())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = w.Stop() }()
	if n, err := st.Routes().RemoveInstanceEverywhere(ctx, a.ID()); err != nil || n != 1 {
		t.Fatalf("sweeper removal: %d %v", n, err)
	}
	for {
		select {
		case e := <-w.Updates():
			if e == nil || e.Operation() != jetstream.KeyValuePut {
				continue
			}
			var r schema.Route
			if json.Unmarshal(e.Value(), &r) == nil && slices.Contains(r.Instances, a.ID().Key()) {
				return
			}
		case <-ctx.Done():
			t.Fatal("route not re-published within 20s")
		}
	}
}

// Instances hosted in one process can share one placement watcher (Config.Watcher): each
// still gates by the shared view and is told of the changes that concern it.
func TestSharedWatcher(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	if _, err := shardkit.New(shardkit.Config{Store: st, ID: id("aggregate-1", "a"), URL: "http://127.0.0.1:1",
		Watcher: newWatcher(t, placement.Config{Store: st, Kinds: []string{"aggregate"}})}); !errors.Is(err, shardkit.ErrConfig) {
		t.Fatalf("a watcher that does not confirm its view: %v", err)
	}
	w := newWatcher(t, placement.Config{Store: st, Kinds: []string{"aggregate"}, Confirm: time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	a := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "a"), Watcher: w})
	b := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-2", "b"), Watcher: w})
	rev := place(t, st, schema.Placement{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1"}).Revision
	synced(t, rev, a, b)
	if code, _, body := call(t, "GET", a.URL+"/t/x", "t1", nil, ""); code != http.StatusOK {
		t.Fatalf("owner: %d %s", code, body)
	}
	if code, _, body := call(t, "GET", b.URL+"/t/x", "t1", nil, ""); code != http.StatusMisdirectedRequest {
		t.Fatalf("not the owner: %d %s", code, body)
	}
	if _, err := shardkit.New(shardkit.Config{Store: st, ID: schema.InstanceID{Kind: "runner", Shard: "runner-1", Instance: "x"},
		URL: "http://127.0.0.1:1", Watcher: w}); !errors.Is(err, shardkit.ErrConfig) {
		t.Fatalf("a watcher of another kind: %v", err)
	}
}

// POST /admin/reload does what it says, not just answer 200: it re-reads the kind's config (a
// new default capacity reaches the instance's directory entry), re-registers the instance and
// re-publishes its routes (both removed here, as a sweeper would), and calls the service's
// Reload hook.
func TestAdminReloadReregistersAndCallsTheHook(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	ctx := context.Background()
	route := schema.Route{Method: "GET", Prefix: "/t/state", Kind: "aggregate"}
	var reloads atomic.Int32
	a := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "a"), AdminToken: testToken, Routes: []schema.Route{route},
		Heartbeat: time.Hour, DirectoryRefresh: time.Hour, // nothing but the reload rewrites the entry and routes here
		Hooks: shardkit.Hooks{Reload: func(context.Context) error { reloads.Add(1); return nil }}})
	kc, err := st.Kinds().Get(ctx, "aggregate")
	if err != nil {
		t.Fatal(err)
	}
	kc.Capacity = 77
	if _, err := st.Kinds().Put(ctx, kc); err != nil {
		t.Fatal(err)
	}
	if err := st.Directory().Unregister(ctx, a.ID()); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Routes().RemoveInstance(ctx, route, a.ID()); err != nil {
		t.Fatal(err)
	}
	if code, body := admin(t, "POST", a.URL+"/admin/reload", testToken); code != http.StatusOK || !strings.Contains(body, "reloaded") {
		t.Fatalf("reload: %d %s", code, body)
	}
	if n := reloads.Load(); n != 1 {
		t.Fatalf("the Reload hook ran %d times", n)
	}
	inst, err := st.Directory().Instance(ctx, a.ID())
	if err != nil || inst.Capacity != 77 {
		t.Fatalf("directory entry after reload: %+v %v (want capacity 77, the kind's new default)", inst, err)
	}
	rts, err := st.Routes().List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, r := range rts {
		found = found || (r.Prefix == route.Prefix && slices.Contains(r.Instances, a.ID().Key()))
	}
	if !found {
		t.Fatalf("routes after reload: %+v", rts)
	}
}

func newWatcher(t *testing.T, cfg placement.Config) *placement.Watcher {
	t.Helper()
	w, err := placement.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return w
}
