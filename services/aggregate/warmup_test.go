package aggregate

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// sizedInstance is an aggregate instance with shardkit on real HTTP and its own metrics.
type sizedInstance struct {
	url string
	svc *Service
	reg *prometheus.Registry
}

func startSized(t *testing.T, st *schema.Store, shard string) *sizedInstance {
	t.Helper()
	reg := prometheus.NewRegistry()
	svc := newService(t, st, Config{SnapshotEvery: 100, Registerer: reg})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	url := "http://" + ln.Addr().String()
	sk, err := shardkit.New(shardkit.Config{
		Store: st, ID: schema.InstanceID{Kind: "aggregate", Shard: shard, Instance: "i1"}, URL: url,
		Routes: svc.Routes(), Hooks: svc.Hooks(), AdminToken: "t", DrainTimeout: 5 * time.Second,
		Heartbeat: 100 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	r := chi.NewRouter()
	sk.Mount(r)
	svc.Mount(r, sk.Gate, sk.RequireAdmin)
	srv := &http.Server{Handler: r, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(ln)
	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan struct{})
	go func() { defer close(runDone); _ = sk.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-runDone
		srv.Close()
	})
	select {
	case <-sk.Running():
	case <-time.After(15 * time.Second):
		t.Fatal("shard did not start")
	}
	return &sizedInstance{url: url, svc: svc, reg: reg}
}

// rehydrations counts the instance's tenant loads by strategy.
func (in *sizedInstance) rehydrations(t *testing.T) map[string]uint64 {
	t.Helper()
	mfs, err := in.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]uint64{}
	for _, mf := range mfs {
		if mf.GetName() == "tm_aggregate_rehydrate_seconds" {
			for _, m := range mf.GetMetric() {
				out[m.GetLabel()[0].GetValue()] = m.GetHistogram().GetSampleCount()
			}
		}
	}
	return out
}

// adminTenants reads GET /admin/tenants.
func adminTenants(t *testing.T, url string) (sizes []schema.TenantSize, total uint64) {
	t.Helper()
	req, _ := http.NewRequest("GET", url+"/admin/tenants", nil)
	req.Header.Set("Authorization", "Bearer t")
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var body struct {
		Sizes       []schema.TenantSize `json:"sizes"`
		StoredBytes uint64              `json:"stored_bytes"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /admin/tenants: %d, %v", resp.StatusCode, err)
	}
	return body.Sizes, body.StoredBytes
}

// The planner reads the tenants' sizes from telemetry and chooses, per move, snapshot
// migration for the tenant whose events weigh more than the kind's threshold and cold replay
// for the lighter one; the dry run shows both with a predicted warm-up; applied by the
// rebalancer's engine, the target loads each tenant with the strategy chosen (its rehydrate
// metric, by strategy). The sizes are also in /admin/tenants.
func TestWarmupStrategyBySize(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	st := openStore(t)
	ctx := context.Background()
	kc := schema.DefaultKindConfig("aggregate")
	kc.Warmup = &schema.WarmupConfig{SnapshotAboveBytes: 100 << 10, SLO: schema.Duration(time.Hour)}
	if _, err := st.Kinds().Put(ctx, kc); err != nil {
		t.Fatal(err)
	}
	src := startSized(t, st, "aggregate-1")
	dst := startSized(t, st, "aggregate-2")
	events := map[string]int{"big": 1500, "small": 150} // ~375 KB and ~37 KB of events
	for tenant, n := range events {
		if _, err := st.Placements("aggregate").Create(ctx, schema.Placement{Tenant: tenant, Shard: "aggregate-1"}); err != nil {
			t.Fatal(err)
		}
		do(t, src.svc, tenant, cmd("acc", "open", 0, "open"))
		for i := 1; i < n; i++ {
			do(t, src.svc, tenant, cmd("acc", "deposit", 1, fmt.Sprintf("d%d", i)))
		}
	}

	tel, err := rebalancer.WatchTelemetry(st, "aggregate")
	if err != nil {
		t.Fatal(err)
	}
	defer tel.Stop()
	sized := func() map[string]schema.TenantSize {
		out := map[string]schema.TenantSize{}
		for _, r := range tel.Reports("aggregate", time.Now(), 5*time.Second) {
			for _, z := range r.Sizes {
				out[z.Tenant] = z
			}
		}
		return out
	}
	tmtest.WaitFor(t, 20*time.Second, tmtest.Until("telemetry with both tenants' events and snapshots", func() bool {
		z := sized()
		return z["big"].Events == 1500 && z["small"].Events == 150 && z["big"].SnapshotBytes > 0 && z["small"].SnapshotBytes > 0
	}))
	z := sized()
	if big, small := z["big"].EventBytes, z["small"].EventBytes; big < 100<<10 || small >= 100<<10 || big < 8*small {
		t.Fatalf("event bytes: big %d, small %d; want big over the 100 KiB threshold, small under it", big, small)
	}
	sizes, total := adminTenants(t, src.url)
	if len(sizes) != 2 || sizes[0].Tenant != "big" || sizes[0].EventBytes != z["big"].EventBytes || total < sizes[0].Bytes() {
		t.Fatalf("/admin/tenants sizes %+v (total %d), want big first with the telemetry's bytes", sizes, total)
	}

	plan, err := rebalancer.MakePlan(ctx, st, planner.Request{Strategy: planner.StrategyManual, Kind: "aggregate",
		Moves: []planner.ManualMove{{Tenant: "big", To: "aggregate-2"}, {Tenant: "small", To: "aggregate-2"}}},
		rebalancer.WorldOptions{Telemetry: tel})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"big": planner.WarmupSnapshot, "small": planner.WarmupReplay}
	for _, m := range plan.Moves {
		if m.Warmup != want[m.Tenant] || !(m.WarmupSeconds > 0) || m.Bytes == 0 {
			t.Fatalf("move of %s: warm-up %q in %vs, %d bytes; want %s", m.Tenant, m.Warmup, m.WarmupSeconds, m.Bytes, want[m.Tenant])
		}
	}
	dry := plan.String()
	if !strings.Contains(dry, "snapshot") || !strings.Contains(dry, "replay") || !strings.Contains(dry, "PREDICTED") {
		t.Fatalf("the dry run does not show the strategies:\n%s", dry)
	}
	t.Log("\n" + dry)

	before := dst.rehydrations(t)
	e, err := rebalancer.New(rebalancer.Config{Store: st, Holder: "r1"})
	if err != nil {
		t.Fatal(err)
	}
	rec, err := e.CreatePlan(ctx, plan, "test")
	if err != nil {
		t.Fatal(err)
	}
	if rec, err = e.Apply(ctx, rec.ID); err != nil || rec.Status != rebalancer.PlanDone {
		t.Fatalf("apply: %v, status %v", err, rec.Status)
	}
	after := dst.rehydrations(t)
	if after["snapshot"]-before["snapshot"] != 1 || after["replay"]-before["replay"] != 1 {
		t.Fatalf("the target loaded by strategy %v (before the moves %v), want one snapshot load and one replay", after, before)
	}
	for tenant, n := range events {
		if got := dst.svc.log.Sizes(); len(got) == 0 {
			t.Fatalf("the target holds no tenant after the moves")
		}
		if r := do(t, dst.svc, tenant, cmd("acc", "deposit", 1, "after-move")); r.Version != uint64(n)+1 {
			t.Fatalf("%s after the move: version %d, want %d (every event loaded)", tenant, r.Version, n+1)
		}
	}
}
