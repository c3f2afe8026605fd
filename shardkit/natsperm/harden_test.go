package natsperm_test

import (
	"context"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
	"github.com/tenantmesh/tenantmesh/shardkit/natsperm"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// TestAttackRoutesOfAnotherKind (item 5): tm_routes was writable as a whole by every shard, and
// AddInstance overwrote a route's kind, so a projection shard could take over the aggregate's
// /commands (its traffic, with tenants' bodies and tokens) or delete it. Routes are keyed by
// kind now and a shard writes under its own kind only: the takeover, the old key format and a
// delete are refused; publishing its own kind's route still works. (What a gateway does with
// two kinds publishing the same route: gateway's TestAttackRouteHijack.)
func TestAttackRoutesOfAnotherKind(t *testing.T) {
	url, admin := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	agg := schema.Route{Method: "POST", Prefix: "/commands", Kind: "aggregate"}
	owner := schema.InstanceID{Kind: "aggregate", Shard: "aggregate-1", Instance: "a"}
	_, err := admin.Routes().AddInstance(ctx, agg, owner)
	ok(t, "the aggregate's route", err)

	pr := open(t, url, natsperm.Shard("projection", "projection-1", natsperm.KindAssets("projection")))
	me := schema.InstanceID{Kind: "projection", Shard: "projection-1", Instance: "a"}
	if _, err := pr.st.Routes().AddInstance(short(t), agg, me); err == nil {
		t.Error("a projection shard added itself to the aggregate's route")
	}
	pr.refused(t, "$KV.tm_routes.aggregate.POST.")
	stolen := agg
	stolen.Kind = "projection"
	if _, err := pr.st.JS().JetStream().Publish(short(t), jsx.KVSubject(schema.BucketRoutes, "POST.L2NvbW1hbmRz"),
		[]byte(`{"method":"POST","prefix":"/commands","kind":"projection","instances":["projection.projection-1.a"]}`)); err == nil {
		t.Error("a projection shard wrote a route under the old, kind-less key")
	}
	pr.refused(t, "$KV.tm_routes.POST.L2NvbW1hbmRz")
	rt, err := admin.Routes().Get(ctx, "aggregate", "POST", "/commands")
	ok(t, "read the route", err)
	if err := pr.st.JS().Records(pr.st.KV(schema.BucketRoutes)).Delete(short(t), rt.Key(), rt.Revision); err == nil {
		t.Error("a projection shard deleted the aggregate's route")
	}
	if got, err := admin.Routes().Get(ctx, "aggregate", "POST", "/commands"); err != nil || got.Kind != "aggregate" || len(got.Instances) != 1 || got.Instances[0] != owner.Key() {
		t.Fatalf("the aggregate's route after the attempts: %+v, %v", got, err)
	}
	_, err = pr.st.Routes().AddInstance(ctx, schema.Route{Method: "POST", Prefix: "/query/", Kind: "projection"}, me)
	ok(t, "its own kind's route", err)

	gw := open(t, url, natsperm.DefaultGateway())
	render := schema.InstanceID{Kind: "render", Shard: "r1", Instance: "i1"}
	_, err = gw.st.Routes().AddInstance(ctx, schema.Route{Method: "POST", Prefix: "/render", Kind: "render"}, render)
	ok(t, "the gateway publishes an affinity server's route", err)
	if _, err := gw.st.Routes().AddInstance(short(t), agg, render); err == nil {
		t.Error("the gateway added an affinity server to the aggregate's route")
	}
	gw.refused(t, "$KV.tm_routes.aggregate.POST.")
}

// TestAttackNarrowRoles (item 15): the gateway could journal audit events for any kind, and
// every role could acknowledge messages of any consumer and make durable consumers on every
// stream it reads. Now a gateway audits only the kinds it places, and no role but the
// rebalancer may ack or make a durable consumer (nothing tenantmesh runs does either).
// Deleting another role's ephemeral consumer is still possible (names are single tokens a
// permission cannot match by prefix); its owner makes a new one at once (docs/security.md).
func TestAttackNarrowRoles(t *testing.T) {
	url, _ := setup(t)
	gw := open(t, url, natsperm.Gateway([]string{"aggregate"}, nil))
	ok(t, "audit of its own kind", gw.st.Audit().Append(context.Background(), schema.AuditEvent{Actor: "gateway/x", Action: "placement.assign", Kind: "aggregate", Tenant: "t1"}))
	if err := gw.st.Audit().Append(short(t), schema.AuditEvent{Actor: "rebalancer/leader", Action: "move.commit", Kind: "projection", Tenant: "t1"}); err == nil {
		t.Error("a gateway for aggregate journaled a projection event as the rebalancer")
	}
	gw.refused(t, "tm.audit.projection.t1")

	sh := open(t, url, natsperm.Shard("runner", "runner-1", natsperm.KindAssets("runner")))
	nc := sh.st.JS().Conn()
	ack := "$JS.ACK." + schema.StreamAudit + ".someone.1.5.5.0.0"
	ok(t, "publish", nc.Publish(ack, nil))
	sh.refused(t, ack)
	durable := "$JS.API.CONSUMER.DURABLE.CREATE." + schema.StreamAudit + ".evil"
	if _, err := nc.Request(durable, []byte(`{"stream_name":"TM_AUDIT","config":{"durable_name":"evil","ack_policy":"explicit"}}`), time.Second); err == nil {
		t.Error("a shard made a durable consumer on the audit stream")
	}
	sh.refused(t, durable)
}
