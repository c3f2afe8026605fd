package projection

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/services/aggregate"
	"github.com/tenantmesh/tenantmesh/services/aggregate/ledgertest"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// instance is one projection instance wired as the binary wires it: the service and shardkit
// on one router behind a real HTTP server.
type instance struct {
	svc *Service
	sk  *shardkit.Shard
	url string
}

func startInstance(t *testing.T, st *schema.Store, shard string) *instance {
	t.Helper()
	svc, _ := newService(t, st, Config{Shard: shard})
	r := chi.NewRouter()
	srv := httptest.NewUnstartedServer(r)
	url := "http://" + srv.Listener.Addr().String()
	sk, err := shardkit.New(shardkit.Config{Store: st, ID: schema.InstanceID{Kind: Kind, Shard: shard, Instance: "i1"}, URL: url,
		Routes: svc.Routes(), Hooks: svc.Hooks(), AdminToken: "token", Heartbeat: 200 * time.Millisecond,
		WarmRetry: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	sk.Mount(r)
	svc.Mount(r, sk.Gate, sk.RequireAdmin)
	srv.Start()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- sk.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Error("shard did not stop within 30s")
		}
		srv.Close()
	})
	select {
	case <-sk.Running():
	case err := <-done:
		t.Fatalf("shard stopped at start: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("shard not running within 30s")
	}
	return &instance{svc: svc, sk: sk, url: url}
}

// queryHTTP queries through the gate and returns the status and the raw items.
func (in *instance) queryHTTP(t *testing.T, tenant, view string, epoch uint64) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("POST", in.url+"/query/"+view, strings.NewReader(`{"limit":1000}`))
	req.Header.Set(tmhttp.HeaderTenant, tenant)
	req.Header.Set(tmhttp.HeaderEpoch, fmt.Sprint(epoch))
	resp, err := tmtest.HTTP.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return resp.StatusCode, string(b)
	}
	var res struct {
		Items json.RawMessage `json:"items"`
	}
	if err := json.Unmarshal(b, &res); err != nil {
		t.Fatal(err)
	}
	var compact bytes.Buffer
	if err := json.Compact(&compact, res.Items); err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, compact.String()
}

// signal polls (signals are external state) until the instance's signal for tenant satisfies ok.
func signal(t *testing.T, st *schema.Store, in *instance, tenant, what string, ok func(schema.TenantSignal) bool) schema.TenantSignal {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		sigs, err := st.Signals().List(context.Background(), Kind, tenant, in.sk.ID().Shard)
		if err == nil {
			for _, s := range sigs {
				if ok(s) {
					return s
				}
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: no signal from %s within 20s (have %+v, %v)", what, in.sk.ID().Shard, sigs, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestShardkitMove moves a tenant between two projection shards running shardkit, stepping the
// placement as the rebalancer does, while commands arrive during warming: the target reports
// ready, warms to the source's fence at handoff, serves the same views at cutover, and the
// source drops its copy (views and checkpoint stored) after the commit.
func TestShardkitMove(t *testing.T) {
	st := openStore(t)
	a := newAggregate(t, st)
	ctx := context.Background()
	p, err := st.Placements(Kind).Create(ctx, schema.Placement{Tenant: "acme", Shard: "projection-1", Epoch: 1})
	if err != nil {
		t.Fatal(err)
	}
	src := startInstance(t, st, "projection-1")
	dst := startInstance(t, st, "projection-2")
	synced := func() {
		t.Helper()
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		for _, in := range []*instance{src, dst} {
			if err := in.sk.WaitPlacement(wctx, p.Revision); err != nil {
				t.Fatal(err)
			}
		}
	}
	step := func(edit func(*schema.Placement)) {
		t.Helper()
		next := p
		edit(&next)
		if p, err = st.Placements(next.Kind).Update(ctx, p, next); err != nil {
			t.Fatal(err)
		}
		synced()
	}
	stop, progress := make(chan struct{}), make(chan int)
	done := ledgertest.Writer(t, a, "acme", stop, progress)
	ledgertest.WaitProgress(t, progress, 100)
	if code, body := src.queryHTTP(t, "acme", "accounts", 1); code != http.StatusOK {
		t.Fatalf("source before the move: %d %s", code, body)
	}

	step(func(p *schema.Placement) { p.Phase, p.Target = schema.PhaseWarming, "projection-2" })
	signal(t, st, dst, "acme", "target ready while warming", func(s schema.TenantSignal) bool {
		return s.Phase == schema.SignalReady && s.Epoch == 1
	})
	ledgertest.WaitProgress(t, progress, 200)
	close(stop)
	<-done
	if t.Failed() {
		return
	}
	warm(t, src.svc, "acme", 0) // the source has every event before the handoff
	want := itemsJSON(t, src.svc, "acme")

	step(func(p *schema.Placement) { p.Phase = schema.PhaseHandoff })
	// The target commits as soon as it is at the fence, and the source then reports drained at
	// epoch 2 with the same fence: a look at the signal may find either.
	drained := signal(t, st, src, "acme", "source drained at handoff", func(s schema.TenantSignal) bool {
		return s.Phase == schema.SignalDrained && (s.Epoch == 1 || s.Epoch == 2)
	})
	ready := signal(t, st, dst, "acme", "target ready at the fence", func(s schema.TenantSignal) bool {
		return s.Phase == schema.SignalReady && s.Fence > 0
	})
	if drained.Fence == 0 || ready.Fence != drained.Fence || ready.Applied < ready.Fence || ready.Lag != 0 {
		t.Fatalf("source %+v, target %+v", drained, ready)
	}
	// The target commits itself at the fence (kittest.Commit writes it if it has not yet).
	p = kittest.Commit(t, st, p, "projection-2")
	synced()
	code, got := dst.queryHTTP(t, "acme", "transactions", 2)
	if code != http.StatusOK || got != want {
		t.Fatalf("target at cutover: %d\n got  %.300s\n want %.300s", code, got, want)
	}
	if code, _ := src.queryHTTP(t, "acme", "transactions", 2); code != http.StatusMisdirectedRequest {
		t.Fatalf("source after the commit answered %d, want 421", code)
	}
	signal(t, st, src, "acme", "source drained after the commit", func(s schema.TenantSignal) bool {
		return s.Phase == schema.SignalDrained && s.Epoch == 2
	})
	if hosted := src.svc.Tenants(); len(hosted) != 0 {
		t.Fatalf("source still hosts %v after releasing", hosted)
	}
	if cp, err := src.svc.Checkpoint(ctx, "acme"); err != nil || cp.Applied != drained.Fence {
		t.Fatalf("checkpoint %+v, %v; want applied %d", cp, err, drained.Fence)
	}
	step(func(p *schema.Placement) { p.Phase, p.Source = schema.PhaseActive, "" })
	r := do(t, a, "acme", command("acc1", aggregate.CmdDeposit, 1))
	warm(t, dst.svc, "acme", r.Seq)
}

// itemsJSON is the tenant's transactions view as a query answer carries it.
func itemsJSON(t *testing.T, s *Service, tenant string) string {
	t.Helper()
	b, err := json.Marshal(query(t, s, tenant, "transactions", Query{Limit: 1000}).Items)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
