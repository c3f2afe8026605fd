package shardkit_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Release (the prerender manager: a server disposing a realm) removes the instance from an affinity tenant's
// owners, and deletes the placement with the last owner; managed kinds refuse it.
func TestReleaseAffinityTenant(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := st.Kinds().Put(ctx, schema.KindConfig{Kind: "prerender", Policy: schema.PolicyAffinity}); err != nil {
		t.Fatal(err)
	}
	me := schema.InstanceID{Kind: "prerender", Shard: "prerender-1", Instance: "a"}
	place(t, st, schema.Placement{Kind: "prerender", Tenant: "realm1", Shard: "prerender-1", Owners: []string{me.Key(), "prerender.prerender-2.b"}})
	rev := place(t, st, schema.Placement{Kind: "prerender", Tenant: "realm2", Shard: "prerender-1", Owners: []string{me.Key()}}).Revision
	a := startShard(t, shardkit.Config{Store: st, ID: me})
	synced(t, rev, a)
	if code, _, body := call(t, "GET", a.URL+"/t/render", "realm1", nil, ""); code != http.StatusOK {
		t.Fatalf("owned realm: %d %s", code, body)
	}

	if err := a.Release(ctx, "realm1"); err != nil {
		t.Fatal(err)
	}
	p, err := st.Placements("prerender").Get(ctx, "realm1")
	if err != nil || !slices.Equal(p.Owners, []string{"prerender.prerender-2.b"}) || p.Epoch != 1 {
		t.Fatalf("realm1 after release: %+v %v", p, err)
	}
	if err := a.Release(ctx, "realm1"); err != nil {
		t.Fatalf("second release: %v", err)
	}
	if err := a.Release(ctx, "realm2"); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Placements("prerender").Get(ctx, "realm2"); !errors.Is(err, schema.ErrNotFound) {
		t.Fatalf("realm2 after its last owner released it: %v", err)
	}
	if err := a.Release(ctx, "never-placed"); err != nil {
		t.Fatal(err)
	}

	m := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "m")})
	if err := m.Release(ctx, "t1"); !errors.Is(err, shardkit.ErrNotAffinity) {
		t.Fatalf("release on a managed kind: %v", err)
	}
}

// Load telemetry goes out on tm.load.<kind>.<shard>.<instance> with in-flight, rate and the
// busiest tenants.
func TestLoadTelemetry(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	rev := place(t, st, schema.Placement{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1"}).Revision
	reports := loadReports(t, st, "aggregate", 256)
	a := startShard(t, shardkit.Config{Store: st, ID: id("aggregate-1", "a"), Capacity: 50, Heartbeat: 50 * time.Millisecond})
	synced(t, rev, a)

	slow := make(chan int, 1)
	go func() { code, _, _ := call(t, "GET", a.URL+"/t/slow", "t1", nil, ""); slow <- code }()
	<-a.app.entered
	for range 3 {
		if code, _, _ := call(t, "GET", a.URL+"/t/x", "t1", nil, ""); code != http.StatusOK {
			t.Fatal(code)
		}
	}
	deadline := time.After(20 * time.Second)
	for {
		select {
		case r := <-reports:
			if r.InstanceID != a.ID() || r.InFlight != 1 || len(r.Top) == 0 {
				continue
			}
			if r.Capacity != 50 || r.Tenants != 1 || r.Top[0].Tenant != "t1" || r.Top[0].InFlight != 1 {
				b, _ := json.Marshal(r)
				t.Fatalf("report: %s", b)
			}
			close(a.app.release)
			<-slow
			return
		case <-deadline:
			t.Fatal("no load report with the in-flight request and t1 in the top within 20s")
		}
	}
}
