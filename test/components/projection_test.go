package components_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/services/aggregate"
	"github.com/tenantmesh/tenantmesh/services/aggregate/ledgertest"
	"github.com/tenantmesh/tenantmesh/services/projection"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// projectionInstance is one projection shard instance (the service with shardkit) on real
// HTTP, with its own metrics.
type projectionInstance struct {
	url string
	svc *projection.Service
	sk  *shardkit.Shard
	reg *prometheus.Registry
}

// startProjection runs a projection instance of shard on st with cfg (Store, Shard and
// Registerer set here) until the test ends.
func startProjection(t testing.TB, st *schema.Store, shard string, cfg projection.Config) *projectionInstance {
	t.Helper()
	in := &projectionInstance{reg: prometheus.NewRegistry()}
	cfg.Store, cfg.Shard, cfg.Registerer = st, shard, in.reg
	svc, err := projection.New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	runService(t, svc.Run)
	in.svc = svc
	in.sk, in.url = serveShard(t, shardkit.Config{Store: st, ID: schema.InstanceID{Kind: "projection", Shard: shard, Instance: "i1"},
		Routes: svc.Routes(), Hooks: svc.Hooks(), WarmRetry: 50 * time.Millisecond},
		func(r chi.Router, sk *shardkit.Shard) { svc.Mount(r, sk.Gate, sk.RequireAdmin) })
	return in
}

// passes is how many passes the instance's placement watch made over changed tenants.
func (in *projectionInstance) passes(t testing.TB) float64 {
	t.Helper()
	mfs, err := in.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "tm_projection_placement_passes_total" {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatal("no tm_projection_placement_passes_total")
	return 0
}

// damageViews waits until the stored views of tenant cover sequence seq, then stores them
// again with account's balance 1000 higher: views damaged in the object store.
func damageViews(t *testing.T, st *schema.Store, in *projectionInstance, tenant, account string, seq uint64) {
	t.Helper()
	ctx := context.Background()
	tmtest.WaitFor(t, 10*time.Second, func() error {
		cp, err := in.svc.Checkpoint(ctx, tenant)
		if err != nil {
			return err
		}
		if cp.Applied < seq {
			return fmt.Errorf("the views are stored at %d, not yet %d", cp.Applied, seq)
		}
		return nil
	})
	os, err := st.JS().ObjectStore(ctx, schema.ServiceBucket("projection", "views"), "")
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.GetBytes(ctx, tenant)
	if err != nil {
		t.Fatal(err)
	}
	var head map[string]any
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	if err := d.Decode(&head); err != nil {
		t.Fatal(err)
	}
	found := false
	for _, a := range head["accounts"].([]any) {
		if acc := a.(map[string]any); acc["id"] == account {
			bal, _ := acc["balance"].(json.Number).Int64()
			acc["balance"], found = bal+1000, true
		}
	}
	if !found {
		t.Fatalf("no account %s in the stored views of %s", account, tenant)
	}
	if b, err = json.Marshal(head); err != nil {
		t.Fatal(err)
	}
	if _, err := os.PutBytes(ctx, tenant, b); err != nil {
		t.Fatal(err)
	}
}

// TestVerifyViewsAtTheFence moves two tenants' projections. One moves while the ledger keeps
// writing to it, so both shards apply events past the fence before their digests are asked
// for: the digests at the fence (the source's taken at its fence, the target's from its
// history) match. The other's target loads stored views someone damaged (a balance off by
// 1000): its digest differs, and with verify on for the kind the source keeps the tenant.
func TestVerifyViewsAtTheFence(t *testing.T) {
	st, _ := kittest.Store(t)
	a := startLedger(t, st)
	ctx := context.Background()
	verifiedKind(t, st, "projection", "projection-1", "busy", "acme")
	// The source stores the views at every event, so the damaged ones are what the target loads.
	src := startProjection(t, st, "projection-1", projection.Config{CheckpointEvery: 1})
	startProjection(t, st, "projection-2", projection.Config{})

	stop, progress := make(chan struct{}), make(chan int)
	done := ledgertest.Writer(t, a, "busy", stop, progress)
	ledgertest.WaitProgress(t, progress, 50)
	m := moveWithEngine(t, st, "projection", "busy", "projection-2", "")
	ledgertest.WaitProgress(t, progress, 20) // the ledger goes on after the move
	close(stop)
	<-done
	v, err := rebalancer.VerifyMove(ctx, st, m)
	if err != nil || v.Result != schema.VerifyMatch || v.Fence == 0 {
		t.Fatalf("a move under writes: %v %+v", err, v)
	}
	t.Logf("under writes: %s; digests took %dus (source), %dus (target)", v.Detail, v.Source[0].TookMicros, v.Target[0].TookMicros)

	var last aggregate.Result
	for i := range 5 {
		acc := fmt.Sprintf("acc%d", i)
		command(t, a, "acme", acc, aggregate.CmdOpen, 0, "open-"+acc)
		last = command(t, a, "acme", acc, aggregate.CmdDeposit, int64(10*(i+1)), "dep-"+acc)
	}
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if err := src.svc.Warm(wctx, "acme", last.Seq); err != nil {
		t.Fatal(err)
	}
	damageViews(t, st, src, "acme", "acc2", last.Seq)
	m = moveWithEngine(t, st, "projection", "acme", "projection-2", "")
	v, err = rebalancer.VerifyMove(ctx, st, m)
	if err != nil || v.Result != schema.VerifyMismatch {
		t.Fatalf("a target loaded from damaged views: %v %+v", err, v)
	}
	t.Logf("damaged: %s", v.Detail)
	if held := src.sk.HeldTenants(); len(held) != 1 || held[0].Tenant != "acme" {
		t.Fatalf("held: %+v", held)
	}
	// The source's placement watch sees the move end; it must not drop what shardkit holds.
	// Two reloads, each waited for: the second wait ends with a pass that began after the
	// first reload, so the tenant was looked at.
	for range 2 {
		passes := src.passes(t)
		if err := src.svc.Reload(ctx); err != nil {
			t.Fatal(err)
		}
		tmtest.WaitFor(t, 10*time.Second, tmtest.Until("the placement watch's pass over the reloaded tenants", func() bool {
			return src.passes(t) > passes
		}))
	}
	if !slices.Contains(src.svc.Tenants(), "acme") {
		t.Fatal("the source dropped a tenant its move verification holds")
	}
	if err := src.sk.ReleaseHeld(ctx, "acme"); err != nil {
		t.Fatal(err)
	}
	if slices.Contains(src.svc.Tenants(), "acme") {
		t.Fatal("the operator's release did not drop the held tenant")
	}
}
