package schema_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

func TestCheckTenant(t *testing.T) {
	tests := []struct {
		name, given string
		ok          bool
		detail      string
	}{
		{"simple", "acme", true, ""},
		{"all classes", "Acme_corp-42", true, ""},
		{"max length", strings.Repeat("a", 128), true, ""},
		{"empty", "", false, "empty"},
		{"too long", strings.Repeat("a", 129), false, "at most 128"},
		{"dot would split a key", "a.b", false, "outside"},
		{"wildcard", "a*", false, "outside"},
		{"space", "a b", false, "outside"},
		{"unicode", "café", false, "outside"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := schema.CheckTenant(tt.given)
			if (err == nil) != tt.ok || schema.ValidTenant(tt.given) != tt.ok {
				t.Fatalf("CheckTenant(%q) = %v, want ok=%v", tt.given, err, tt.ok)
			}
			if err != nil {
				if !errors.Is(err, schema.ErrInvalidTenant) || !strings.Contains(err.Error(), tt.detail) {
					t.Fatalf("error %q: want ErrInvalidTenant mentioning %q", err, tt.detail)
				}
			}
		})
	}
}

func FuzzCheckTenant(f *testing.F) {
	for _, s := range []string{"acme", "", "a.b", "x>", strings.Repeat("z", 200)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		err := schema.CheckTenant(s)
		if err == nil && (strings.ContainsAny(s, ".*> \t") || len(s) == 0 || len(s) > 128) {
			t.Fatalf("accepted %q", s)
		}
	})
}

func TestPlacementCAS(t *testing.T) {
	st := kittest.StoreAt(t, natstest.Server(t).URL())
	ctx := context.Background()
	p, err := st.Placements("aggregate").Create(ctx, schema.Placement{Tenant: "acme", Shard: "aggregate-1"})
	if err != nil {
		t.Fatal(err)
	}
	if p.Epoch != 1 || p.Phase != schema.PhaseActive || p.Revision == 0 {
		t.Fatalf("created %+v", p)
	}
	// A second create loses with the typed conflict.
	_, err = st.Placements("aggregate").Create(ctx, schema.Placement{Tenant: "acme", Shard: "aggregate-2"})
	var ce *schema.ConflictError
	if !errors.As(err, &ce) || !errors.Is(err, schema.ErrConflict) || ce.Expected != 0 {
		t.Fatalf("second create: %v", err)
	}
	// Ensure returns the winner.
	got, created, err := st.Placements("aggregate").Ensure(ctx, schema.Placement{Tenant: "acme", Shard: "aggregate-2"})
	if err != nil || created || got.Shard != "aggregate-1" {
		t.Fatalf("ensure = %+v, %v, %v", got, created, err)
	}
	warming := p
	warming.Phase, warming.Target = schema.PhaseWarming, "aggregate-2"
	w1, err := st.Placements(warming.Kind).Update(ctx, p, warming)
	if err != nil {
		t.Fatal(err)
	}
	if w1.Revision <= p.Revision {
		t.Fatalf("new revision %d not after %d", w1.Revision, p.Revision)
	}
	// An update from the stale revision is the typed conflict, naming the revision.
	_, err = st.Placements(warming.Kind).Update(ctx, p, warming)
	if !errors.As(err, &ce) || ce.Expected != p.Revision || ce.Key != "acme" {
		t.Fatalf("stale update: %v", err)
	}
	if !strings.Contains(err.Error(), "read it again") {
		t.Fatalf("conflict error does not say what to do: %v", err)
	}
	// The stored value is the winner's.
	cur, err := st.Placements("aggregate").Get(ctx, "acme")
	if err != nil || cur.Phase != schema.PhaseWarming || cur.Revision != w1.Revision {
		t.Fatalf("stored %+v, %v", cur, err)
	}
	// Delete by stale revision conflicts; by the current one succeeds.
	if err := st.Placements("aggregate").Delete(ctx, "acme", p.Revision); !errors.Is(err, schema.ErrConflict) {
		t.Fatalf("stale delete: %v", err)
	}
	if err := st.Placements("aggregate").Delete(ctx, "acme", cur.Revision); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Placements("aggregate").Get(ctx, "acme"); !errors.Is(err, schema.ErrNotFound) {
		t.Fatalf("after delete: %v", err)
	}
	// A deleted tenant can be placed again.
	if _, err := st.Placements("aggregate").Create(ctx, schema.Placement{Tenant: "acme", Shard: "aggregate-3"}); err != nil {
		t.Fatalf("re-create after delete: %v", err)
	}
	// The handle's kind is the placement's: an empty Kind takes it (above), another is refused.
	if p.Kind != "aggregate" {
		t.Fatalf("created placement has kind %q, want the handle's", p.Kind)
	}
	other := schema.Placement{Kind: "projection", Tenant: "acme", Shard: "projection-1"}
	if _, err := st.Placements("aggregate").Create(ctx, other); !errors.Is(err, schema.ErrInvalid) {
		t.Fatalf("create of another kind's placement: %v, want ErrInvalid", err)
	}
	if _, err := st.Placements("aggregate").Update(ctx, p, other); !errors.Is(err, schema.ErrInvalid) {
		t.Fatalf("update to another kind's placement: %v, want ErrInvalid", err)
	}
}

func TestPlacementTypedErrors(t *testing.T) {
	st := kittest.StoreAt(t, natstest.Server(t).URL())
	ctx := context.Background()
	_, err := st.Placements("nosuchkind").Get(ctx, "acme")
	if !errors.Is(err, schema.ErrUnknownKind) {
		t.Fatalf("unknown kind: %v", err)
	}
	_, err = st.Placements("nosuchkind").Create(ctx, schema.Placement{Tenant: "acme", Shard: "s-1"})
	if !errors.Is(err, schema.ErrUnknownKind) {
		t.Fatalf("create in unknown kind: %v", err)
	}
	_, err = st.Placements("aggregate").Get(ctx, "bad.tenant")
	if !errors.Is(err, schema.ErrInvalidTenant) {
		t.Fatalf("invalid tenant: %v", err)
	}
	_, err = st.Placements("bad.kind").Get(ctx, "acme")
	if !errors.Is(err, schema.ErrInvalidName) {
		t.Fatalf("invalid kind name: %v", err)
	}
	// A kind registered later works.
	if _, err := st.Kinds().Put(ctx, schema.KindConfig{Kind: "render", Policy: schema.PolicyAffinity}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Placements("render").Create(ctx, schema.Placement{Tenant: "acme", Shard: "render-1"}); err != nil {
		t.Fatal(err)
	}
	k, err := st.Kinds().Get(ctx, "render")
	if err != nil || k.Affinity == nil || k.Affinity.Multiplex != 1 || k.Capacity != 4 {
		t.Fatalf("render kind = %+v, %v", k, err)
	}
	if _, err := st.Kinds().Put(ctx, schema.KindConfig{Kind: "x", Policy: "random"}); !errors.Is(err, schema.ErrInvalid) {
		t.Fatalf("bad policy: %v", err)
	}
}

func TestCheckTransition(t *testing.T) {
	a := schema.Placement{Kind: "k", Tenant: "t", Shard: "A", Epoch: 4, Phase: schema.PhaseActive}
	warm := a
	warm.Phase, warm.Target = schema.PhaseWarming, "B"
	hand := warm
	hand.Phase = schema.PhaseHandoff
	drain := schema.Placement{Kind: "k", Tenant: "t", Shard: "B", Epoch: 5, Phase: schema.PhaseDraining, Source: "A"}
	done := schema.Placement{Kind: "k", Tenant: "t", Shard: "B", Epoch: 5, Phase: schema.PhaseActive}
	bumpNoMove := a
	bumpNoMove.Epoch = 5
	stealNoBump := done
	stealNoBump.Epoch = 4
	skipTwo := done
	skipTwo.Epoch = 6
	wrongCommit := drain
	wrongCommit.Shard = "C"
	tests := []struct {
		name       string
		prev, next schema.Placement
		ok         bool
	}{
		{"start move", a, warm, true},
		{"warm to handoff", warm, hand, true},
		{"abort warming", warm, a, true},
		{"abort handoff", hand, a, true},
		{"commit", hand, drain, true},
		{"finish drain", drain, done, true},
		{"reassign active with epoch+1", a, done, true},
		{"epoch bump without owner change", a, bumpNoMove, false},
		{"owner change without epoch bump", a, stealNoBump, false},
		{"epoch jumps by two", a, skipTwo, false},
		{"commit to a shard that is not the target", hand, wrongCommit, false},
		{"commit straight from warming", warm, drain, false},
		{"draining back to old owner", drain, a, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := schema.CheckTransition(tt.prev, tt.next)
			if (err == nil) != tt.ok {
				t.Fatalf("CheckTransition = %v, want ok=%v", err, tt.ok)
			}
			if err != nil && !errors.Is(err, schema.ErrTransition) {
				t.Fatalf("error %v does not match ErrTransition", err)
			}
		})
	}
}

func TestDirectoryStatus(t *testing.T) {
	st := kittest.StoreAt(t, natstest.Server(t).URL())
	ctx := context.Background()
	id := schema.InstanceID{Kind: "aggregate", Shard: "aggregate-1", Instance: "a"}
	inst, err := st.Directory().Register(ctx, schema.Instance{InstanceID: id, URL: "http://127.0.0.1:9001", Capacity: 100, Labels: map[string]string{"region": "eu"}})
	if err != nil {
		t.Fatal(err)
	}
	th := schema.Thresholds{DegradedAfter: 3 * time.Second, OfflineAfter: 2 * time.Minute}
	hb := inst.Heartbeat
	for _, c := range []struct {
		age  time.Duration
		want schema.Status
	}{
		{0, schema.StatusOnline},
		{2 * time.Second, schema.StatusOnline},
		{3 * time.Second, schema.StatusDegraded},
		{119 * time.Second, schema.StatusDegraded},
		{2 * time.Minute, schema.StatusOffline},
	} {
		if got := th.Status(inst, hb.Add(c.age)); got != c.want {
			t.Errorf("status at age %s = %s, want %s", c.age, got, c.want)
		}
	}
	// An entry rewritten every 15 s (its liveness in between is its load reports) is late only
	// DegradedAfter past its refresh; offline stays OfflineAfter.
	slow := inst
	slow.RefreshMS = 15000
	for _, c := range []struct {
		age  time.Duration
		want schema.Status
	}{
		{14 * time.Second, schema.StatusOnline},
		{17 * time.Second, schema.StatusOnline},
		{18 * time.Second, schema.StatusDegraded},
		{2 * time.Minute, schema.StatusOffline},
	} {
		if got := th.Status(slow, hb.Add(c.age)); got != c.want {
			t.Errorf("15 s refresh: status at age %s = %s, want %s", c.age, got, c.want)
		}
	}
	inst.Reported = schema.StatusDraining
	if got := th.Status(inst, hb); got != schema.StatusDraining || got.Live() {
		t.Errorf("draining instance: %s live=%v", got, got.Live())
	}
	if _, err := st.Directory().Register(ctx, schema.Instance{InstanceID: id, URL: "not a url"}); !errors.Is(err, schema.ErrInvalid) {
		t.Fatalf("bad url: %v", err)
	}
	list, err := st.Directory().Instances(ctx, "aggregate")
	if err != nil || len(list) != 1 || list[0].Labels["region"] != "eu" {
		t.Fatalf("instances = %+v, %v", list, err)
	}
	if err := st.Directory().Unregister(ctx, id); err != nil {
		t.Fatal(err)
	}
	if list, _ := st.Directory().Instances(ctx, ""); len(list) != 0 {
		t.Fatalf("after unregister: %+v", list)
	}
}

func TestRoutesAddRemove(t *testing.T) {
	st := kittest.StoreAt(t, natstest.Server(t).URL())
	ctx := context.Background()
	r := schema.Route{Method: "POST", Prefix: "/commands", Kind: "aggregate"}
	a := schema.InstanceID{Kind: "aggregate", Shard: "aggregate-1", Instance: "a"}
	b := schema.InstanceID{Kind: "aggregate", Shard: "aggregate-2", Instance: "b"}
	// Concurrent publishers all land (CAS retries).
	errs := make(chan error, 2)
	for _, id := range []schema.InstanceID{a, b} {
		go func() { _, err := st.Routes().AddInstance(ctx, r, id); errs <- err }()
	}
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	got, err := st.Routes().Get(ctx, "aggregate", "POST", "/commands")
	if err != nil || len(got.Instances) != 2 {
		t.Fatalf("route = %+v, %v", got, err)
	}
	// Adding again is idempotent.
	if got2, _ := st.Routes().AddInstance(ctx, r, a); len(got2.Instances) != 2 {
		t.Fatalf("re-add: %+v", got2)
	}
	if _, err := st.Routes().RemoveInstance(ctx, r, a); err != nil {
		t.Fatal(err)
	}
	if n, err := st.Routes().RemoveInstanceEverywhere(ctx, b); err != nil || n != 1 {
		t.Fatalf("sweep = %d, %v", n, err)
	}
	// The emptied route is deleted.
	if _, err := st.Routes().Get(ctx, "aggregate", "POST", "/commands"); !errors.Is(err, schema.ErrNotFound) {
		t.Fatalf("empty route not deleted: %v", err)
	}
	if _, err := st.Routes().AddInstance(ctx, schema.Route{Method: "get", Prefix: "/x", Kind: "aggregate"}, a); !errors.Is(err, schema.ErrInvalid) {
		t.Fatalf("lower-case method: %v", err)
	}
}

func TestLease(t *testing.T) {
	st := kittest.StoreAt(t, natstest.Server(t).URL())
	ctx := context.Background()
	l1, err := st.Rebalance().AcquireLease(ctx, schema.LeaderLease, "r1", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Rebalance().AcquireLease(ctx, schema.LeaderLease, "r2", time.Minute); !errors.Is(err, schema.ErrLeaseHeld) || !strings.Contains(err.Error(), "r1") {
		t.Fatalf("second holder: %v", err)
	}
	l1, err = st.Rebalance().RenewLease(ctx, l1, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Rebalance().ReleaseLease(ctx, l1); err != nil {
		t.Fatal(err)
	}
	l2, err := st.Rebalance().AcquireLease(ctx, schema.LeaderLease, "r2", time.Millisecond)
	if err != nil {
		t.Fatalf("after release: %v", err)
	}
	// r1's stale copy cannot renew over r2.
	if _, err := st.Rebalance().RenewLease(ctx, l1, time.Minute); !errors.Is(err, schema.ErrLeaseHeld) {
		t.Fatalf("stale renew: %v", err)
	}
	_ = l2
}

func TestAuditAndSignals(t *testing.T) {
	st := kittest.StoreAt(t, natstest.Server(t).URL())
	ctx := context.Background()
	for i, tenant := range []string{"a", "b", "a"} {
		ev := schema.AuditEvent{Actor: "test", Action: "placement.assign", Kind: "aggregate", Tenant: tenant, Revision: uint64(i + 1)}
		if err := st.Audit().Append(ctx, ev); err != nil {
			t.Fatal(err)
		}
	}
	all, err := st.Audit().Read(ctx, schema.AuditQuery{})
	if err != nil || len(all) != 3 {
		t.Fatalf("audit = %d, %v", len(all), err)
	}
	onlyA, err := st.Audit().Read(ctx, schema.AuditQuery{Tenant: "a", Limit: 1})
	if err != nil || len(onlyA) != 1 || onlyA[0].Revision != 3 {
		t.Fatalf("audit for a, newest 1 = %+v, %v", onlyA, err)
	}
	id := schema.InstanceID{Kind: "aggregate", Shard: "aggregate-2", Instance: "x"}
	if _, err := st.Signals().Put(ctx, schema.TenantSignal{Kind: "aggregate", Tenant: "a", Shard: id.Shard, Instance: id.Instance, Phase: schema.SignalReady, Applied: 10, Fence: 10}); err != nil {
		t.Fatal(err)
	}
	sigs, err := st.Signals().List(ctx, "aggregate", "a", "aggregate-2")
	if err != nil || len(sigs) != 1 || sigs[0].Phase != schema.SignalReady {
		t.Fatalf("signals = %+v, %v", sigs, err)
	}
}

func TestRecords(t *testing.T) {
	st := kittest.StoreAt(t, natstest.Server(t).URL())
	ctx := context.Background()
	type rec struct{ N int }
	rev, err := st.Rebalance().Create(ctx, schema.PlanKey("p1"), rec{1})
	if err != nil {
		t.Fatal(err)
	}
	var got rec
	if r, err := st.Rebalance().Latest(ctx, schema.PlanKey("p1"), &got); err != nil || r != rev || got.N != 1 {
		t.Fatalf("GetRecord = %d %+v %v, want %d {1}", r, got, err, rev)
	}
	if _, err := st.Rebalance().Create(ctx, schema.PlanKey("p1"), rec{2}); !errors.Is(err, schema.ErrConflict) {
		t.Fatalf("second create: %v, want a conflict", err)
	}
	if err := st.Rebalance().Delete(ctx, schema.PlanKey("p1"), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Rebalance().Latest(ctx, schema.PlanKey("p1"), &got); !errors.Is(err, schema.ErrNotFound) {
		t.Fatalf("deleted record: %v, want ErrNotFound", err)
	}
	if _, err := st.Rebalance().Latest(ctx, schema.PlanKey("never"), &got); !errors.Is(err, schema.ErrNotFound) {
		t.Fatalf("absent record: %v, want ErrNotFound", err)
	}
}

// TestUnavailable: with NATS gone, reads and writes fail within the store's timeout with an
// error that wraps ErrUnavailable (answered 503 + Retry-After over HTTP), not a bare NATS error.
func TestUnavailable(t *testing.T) {
	srv := natstest.Server(t)
	nc := natstest.Connect(t, srv.URL())
	ctx := context.Background()
	st, err := schema.Open(ctx, nc, schema.Options{Timeout: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	var v struct{}
	for name, call := range map[string]func() error{
		"get record": func() error { _, err := st.Rebalance().Latest(ctx, schema.PlanKey("p1"), &v); return err },
		"kind":       func() error { _, err := st.Kinds().Get(ctx, "aggregate"); return err },
		"kinds":      func() error { _, err := st.Kinds().List(ctx); return err },
		"create":     func() error { _, err := st.Rebalance().Create(ctx, schema.PlanKey("p2"), v); return err },
		"audit":      func() error { _, err := st.Audit().Read(ctx, schema.AuditQuery{}); return err },
	} {
		start := time.Now()
		err := call()
		if !errors.Is(err, schema.ErrUnavailable) {
			t.Errorf("%s: %v, want ErrUnavailable", name, err)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("%s took %s with a 500ms timeout", name, d)
		}
	}
}

// LastSeq answers the newest message on a subject filter from the stream leader; none is 0.
func TestLastSeq(t *testing.T) {
	st := kittest.StoreAt(t, natstest.Server(t).URL())
	ctx := context.Background()
	if err := st.EnsureEventsStream(ctx); err != nil {
		t.Fatal(err)
	}
	js := st.JS().JetStream()
	var last uint64
	for i, subj := range []string{"events.acme.account.a", "events.globex.account.a", "events.acme.account.b", "events.globex.account.b"} {
		ack, err := js.Publish(ctx, subj, []byte(fmt.Sprint(i)))
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasPrefix(subj, "events.acme.") {
			last = ack.Sequence
		}
	}
	for filter, want := range map[string]uint64{schema.TenantEvents("acme"): last, schema.TenantEvents("initech"): 0} {
		if got, err := st.JS().LastSeq(ctx, schema.StreamEvents, filter); err != nil || got != want {
			t.Errorf("LastSeq(%s) = %d %v, want %d", filter, got, err, want)
		}
	}
}

// A service bucket made without per-key TTLs gets them when asked; a write with a TTL is gone
// (for a direct get, a leader read and a listing) once it runs out, one without stays, and a
// write on a stale revision is a conflict.
func TestPerKeyTTL(t *testing.T) {
	st := kittest.StoreAt(t, natstest.Server(t).URL())
	ctx := context.Background()
	spec := jsx.KVSpec{Bucket: "tm_test_runs", Description: "test"}
	if _, err := st.JS().EnsureKV(ctx, spec); err != nil {
		t.Fatal(err)
	}
	spec.PerKeyTTL = true
	kv, err := st.JS().EnsureKV(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.JS().JetStream().Stream(ctx, jsx.KVStream(spec.Bucket))
	if err != nil || !info.CachedInfo().Config.AllowMsgTTL {
		t.Fatalf("per-message TTLs not allowed on the bucket's stream: %v", err)
	}
	rev, err := st.JS().UpdateKV(ctx, spec.Bucket, "done", []byte("1"), 0, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.JS().UpdateKV(ctx, spec.Bucket, "done", []byte("2"), rev+7, time.Second); !errors.Is(err, jetstream.ErrKeyExists) {
		t.Fatalf("write on a stale revision: %v, want jetstream.ErrKeyExists", err)
	}
	if _, err := st.JS().UpdateKV(ctx, spec.Bucket, "open", []byte("1"), 0, 0); err != nil {
		t.Fatal(err)
	}
	if b, got, err := st.JS().LeaderGet(ctx, spec.Bucket, "done"); err != nil || got != rev || string(b) != "1" {
		t.Fatalf("leader read: %q rev %d %v, want \"1\" rev %d", b, got, err, rev)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := kv.Get(ctx, "done")
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the 1s value still there after 10s: %v", err)
		}
		time.Sleep(50 * time.Millisecond) // JetStream expires it on its own clock
	}
	if _, _, err := st.JS().LeaderGet(ctx, spec.Bucket, "done"); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Fatalf("leader read of an expired value: %v, want jetstream.ErrKeyNotFound", err)
	}
	keys, err := kv.ListKeys(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var left []string
	for k := range keys.Keys() {
		left = append(left, k)
	}
	if len(left) != 1 || left[0] != "open" {
		t.Fatalf("keys left %v, want [open]", left)
	}
}
