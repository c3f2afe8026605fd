package natsperm_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/natsperm"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// role is a store opened as one role, and the permission violations its connection saw.
type role struct {
	st *schema.Store
	mu sync.Mutex
	vs []string
}

func (r *role) refused(t *testing.T, subject string) {
	t.Helper()
	// The server reports a violation asynchronously.
	tmtest.WaitFor(t, 5*time.Second, func() error {
		r.mu.Lock()
		defer r.mu.Unlock()
		for _, v := range r.vs {
			if strings.Contains(v, subject) {
				return nil
			}
		}
		return fmt.Errorf("no permission violation for %s; saw %q", subject, r.vs)
	})
}

func open(t *testing.T, url string, p natsperm.Role) *role {
	t.Helper()
	r := &role{}
	nc := natstest.ConnectAs(t, url, p, nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		r.mu.Lock()
		r.vs = append(r.vs, err.Error())
		r.mu.Unlock()
	}))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, err := schema.Open(ctx, nc, schema.Options{Attach: true, Timeout: 2 * time.Second})
	if err != nil {
		t.Fatalf("%s: open: %v", p.Name, err)
	}
	r.st = st
	return r
}

// short is a context for an operation that must be refused: the server drops it, so it fails
// only when this ends.
func short(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	t.Cleanup(cancel)
	return ctx
}

func ok(t *testing.T, what string, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

func setup(t *testing.T) (string, *schema.Store) {
	t.Helper()
	admin, url := kittest.Store(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ok(t, "provision", admin.Provision(ctx))
	_, err := admin.Kinds().Put(ctx, schema.KindConfig{Kind: "render", Policy: schema.PolicyAffinity})
	ok(t, "render kind", err)
	for _, tenant := range []string{"t1", "t2"} {
		for _, kind := range []string{"aggregate", "projection"} {
			_, err := admin.Placements(kind).Create(ctx, schema.Placement{Tenant: tenant, Shard: kind + "-1", Epoch: 1, Phase: schema.PhaseActive})
			ok(t, "placement", err)
		}
	}
	return url, admin
}

func TestShardDoesItsJobAndNoMore(t *testing.T) {
	url, admin := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sh := open(t, url, natsperm.Shard("aggregate", "aggregate-1", natsperm.KindAssets("aggregate")))

	// Its job: its own entry, its signals, its kind's placements (release), routes, load,
	// events, its own object store, reading the control plane.
	me := schema.InstanceID{Kind: "aggregate", Shard: "aggregate-1", Instance: "a"}
	_, err := sh.st.Directory().Register(ctx, schema.Instance{InstanceID: me, URL: "http://127.0.0.1:9"})
	ok(t, "register own instance", err)
	_, err = sh.st.Directory().Heartbeat(ctx, schema.Instance{InstanceID: me, URL: "http://127.0.0.1:9"})
	ok(t, "heartbeat", err)
	_, err = sh.st.Signals().Put(ctx, schema.TenantSignal{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1", Instance: "a", Phase: schema.SignalWarming, Epoch: 1})
	ok(t, "own signal", err)
	_, err = sh.st.Routes().AddInstance(ctx, schema.Route{Method: "*", Prefix: "/commands", Kind: "aggregate"}, me)
	ok(t, "route", err)
	p, err := sh.st.Placements("aggregate").Get(ctx, "t1")
	ok(t, "read placement", err)
	next := p
	next.UpdatedBy = "aggregate-1"
	_, err = sh.st.Placements(next.Kind).Update(ctx, p, next)
	ok(t, "update own kind's placement", err)
	_, err = sh.st.Kinds().List(ctx)
	ok(t, "read kinds", err)
	_, err = sh.st.Directory().Instances(ctx, "")
	ok(t, "read directory", err)
	ok(t, "load report", sh.st.PublishLoad(schema.LoadReport{InstanceID: me}))
	ok(t, "events stream", sh.st.EnsureEventsStream(ctx))
	_, err = sh.st.JS().JetStream().Publish(ctx, schema.EventSubject("t1", "account", "main"), []byte(`{}`))
	ok(t, "append event", err)
	_, err = sh.st.JS().ObjectStore(ctx, schema.ServiceBucket("aggregate", "snapshots"), "snapshots")
	ok(t, "own object store", err)
	digest := schema.DigestRecord{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1", Instance: "a", Role: schema.RoleSource, Epoch: 1}
	ok(t, "own digest record", sh.st.Digests().Put(ctx, digest))
	if recs, err := sh.st.Digests().List(ctx, "aggregate", "t1", 1); err != nil || len(recs) != 1 {
		t.Errorf("read digest records: %v %+v", err, recs)
	}

	// Refused: another shard's entry, another kind's placement, the rebalancer's records,
	// kind config, another shard's signals, job queues.
	other := schema.InstanceID{Kind: "aggregate", Shard: "aggregate-2", Instance: "a"}
	if _, err := sh.st.Directory().Register(short(t), schema.Instance{InstanceID: other, URL: "http://127.0.0.1:9"}); err == nil {
		t.Error("a shard registered another shard's instance")
	}
	sh.refused(t, "$KV.tm_instances.aggregate.aggregate-2.a")
	pp, err := admin.Placements("projection").Get(ctx, "t1")
	ok(t, "admin read", err)
	steal := pp
	steal.UpdatedBy = "aggregate-1"
	if _, err := sh.st.Placements(steal.Kind).Update(short(t), pp, steal); err == nil {
		t.Error("a shard rewrote another kind's placement")
	} else {
		t.Logf("refused: %v", err)
	}
	sh.refused(t, "tm_placement_projection") // its bucket cannot even be opened
	if _, err := sh.st.Rebalance().Create(short(t), "x", map[string]int{"a": 1}); err == nil {
		t.Error("a shard wrote tm_rebalance")
	}
	sh.refused(t, "$KV.tm_rebalance.x")
	if _, err := sh.st.Kinds().Put(short(t), schema.KindConfig{Kind: "aggregate"}); err == nil {
		t.Error("a shard changed kind config")
	}
	sh.refused(t, "$KV.tm_kinds.aggregate")
	if _, err := sh.st.Signals().Put(short(t), schema.TenantSignal{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-2", Instance: "a", Phase: schema.SignalWarming, Epoch: 1}); err == nil {
		t.Error("a shard wrote another shard's signal")
	}
	sh.refused(t, "$KV.tm_tenant_state.aggregate.t1.aggregate-2.a")
	if _, err := sh.st.JS().JetStream().Publish(short(t), schema.JobSubject("t1", "any"), []byte(`{}`)); err == nil {
		t.Error("an aggregate shard enqueued a job")
	}
	sh.refused(t, "jobs.t1.any")
	digest.Shard = "aggregate-2"
	if err := sh.st.Digests().Put(short(t), digest); err == nil {
		t.Error("a shard recorded another shard's digest")
	}
	sh.refused(t, "$KV.tm_verify.aggregate.t1.1.source.aggregate-2.a")
	if err := sh.st.PublishJobEvent(schema.JobEvent{Event: schema.JobCreated, Kind: "aggregate", Tenant: "t1", Job: "j"}); err != nil {
		t.Fatal(err)
	}
	sh.refused(t, "tm.job.created.aggregate.t1")

	// Admin saw none of the refused writes land.
	if got, err := admin.Placements("projection").Get(ctx, "t1"); err != nil || got.Shard != "projection-1" {
		t.Errorf("projection placement after the refused rewrite: %+v, %v", got, err)
	}
	if _, err := admin.Directory().Instance(ctx, other); err == nil {
		t.Error("the refused registration is in the directory")
	}
}

func TestProjectionReadsEventsButCannotWriteThem(t *testing.T) {
	url, _ := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pr := open(t, url, natsperm.Shard("projection", "projection-1", natsperm.KindAssets("projection")))
	ok(t, "events stream exists", pr.st.EnsureEventsStream(ctx))
	_, err := pr.st.JS().EnsureKV(ctx, jsx.KVSpec{Bucket: schema.ServiceBucket("projection", "checkpoints"), Description: "checkpoints"})
	ok(t, "own bucket", err)
	r, err := jsx.Read(ctx, pr.st.JS().JetStream(), schema.StreamEvents, jsx.ReadConfig{Filters: []string{"events.t1.>"}})
	ok(t, "read events", err)
	r.Stop()
	if _, err := pr.st.JS().JetStream().Publish(short(t), schema.EventSubject("t1", "account", "main"), []byte(`{}`)); err == nil {
		t.Error("a projection shard appended an event")
	}
	pr.refused(t, "events.t1.account.main")
}

func TestGatewayPlacesButCannotRebalance(t *testing.T) {
	url, admin := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	gw := open(t, url, natsperm.DefaultGateway())
	_, err := gw.st.Placements("aggregate").Get(ctx, "t1")
	ok(t, "read placement", err)
	_, err = gw.st.Placements("aggregate").Create(ctx, schema.Placement{Tenant: "new", Shard: "aggregate-1", Epoch: 1, Phase: schema.PhaseActive})
	ok(t, "place an unplaced tenant", err)
	render := schema.InstanceID{Kind: "render", Shard: "r1", Instance: "i1"}
	_, err = gw.st.Directory().Register(ctx, schema.Instance{InstanceID: render, URL: "http://127.0.0.1:9"})
	ok(t, "register an affinity server", err)
	ok(t, "audit", gw.st.Audit().Append(ctx, schema.AuditEvent{Actor: "gateway/test", Action: "placement.assign", Kind: "aggregate", Tenant: "new"}))

	if _, err := gw.st.Rebalance().Create(short(t), "plan-x", map[string]int{"a": 1}); err == nil {
		t.Error("the gateway wrote tm_rebalance")
	}
	gw.refused(t, "$KV.tm_rebalance.plan-x")
	agg := schema.InstanceID{Kind: "aggregate", Shard: "aggregate-1", Instance: "evil"}
	if _, err := gw.st.Directory().Register(short(t), schema.Instance{InstanceID: agg, URL: "http://127.0.0.1:9"}); err == nil {
		t.Error("the gateway registered an aggregate instance")
	}
	gw.refused(t, "$KV.tm_instances.aggregate.aggregate-1.evil")
	if _, err := admin.Directory().Instance(ctx, agg); err == nil {
		t.Error("the refused registration is in the directory")
	}
}

// TestBuiltinRolesAreScoped: with the built-in scopes in the account (natsperm.Scopes, kept by
// kittest as a deployment's chain keeps them), a shard's and the gateway's credentials carry no
// subjects, and stay small: every JetStream API request carries them to the server.
func TestBuiltinRolesAreScoped(t *testing.T) {
	for _, r := range []natsperm.Role{natsperm.DefaultGateway(), natsperm.Shard("runner", "runner-1", natsperm.KindAssets("runner")),
		natsperm.Shard("aggregate", "aggregate-7", natsperm.KindAssets("aggregate"))} {
		if uc, n := natstest.UserClaims(t, natstest.Creds(t, r)); len(uc.Pub.Allow) != 0 || n > 1500 {
			t.Errorf("%s: %d subjects in a %d-byte JWT; want a scoped user", r.Name, len(uc.Pub.Allow), n)
		}
	}
	// A kind without a scope carries its permissions, and works all the same.
	notes := natsperm.Shard("notes", "notes-1", natsperm.Assets{KV: []string{"tm_notes_x"}})
	if uc, _ := natstest.UserClaims(t, natstest.Creds(t, notes)); len(uc.Pub.Allow) == 0 {
		t.Error("a kind without a scope must carry its permissions")
	}
}
