package aggregate

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// instance is one aggregate shard instance with shardkit, served over real HTTP.
type instance struct {
	url string
	svc *Service
	sk  *shardkit.Shard
}

func startInstance(t *testing.T, st *schema.Store, shard string) *instance {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	svc := newService(t, st, Config{SnapshotEvery: 100})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	url := "http://" + ln.Addr().String()
	sk, err := shardkit.New(shardkit.Config{
		Store: st, ID: schema.InstanceID{Kind: "aggregate", Shard: shard, Instance: "i1"}, URL: url,
		Routes: svc.Routes(), Hooks: svc.Hooks(), AdminToken: "t", DrainTimeout: 5 * time.Second,
		Heartbeat: 200 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	r := chi.NewRouter()
	sk.Mount(r)
	svc.Mount(r, sk.Gate, sk.RequireAdmin)
	srv := &http.Server{Handler: r, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(ln)
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
	return &instance{url: url, svc: svc, sk: sk}
}

// client sends commands the way a gateway does: to the current owner with its epoch,
// following 421 and waiting out 503 (bounded), until the command is acknowledged.
type client struct {
	st    *schema.Store
	urls  map[string]string // shard -> url
	hc    *http.Client
	mu    sync.Mutex
	acked map[string]int64 // idempotency key -> amount
	tries int
}

func (c *client) send(t *testing.T, tenant string, cmd Command, amount int64) {
	body, _ := json.Marshal(cmd)
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		c.mu.Lock()
		c.tries++
		c.mu.Unlock()
		p, err := c.st.Placements("aggregate").Get(context.Background(), tenant)
		if err != nil {
			t.Errorf("placement: %v", err)
			return
		}
		req, _ := http.NewRequest("POST", c.urls[p.Shard]+"/commands", bytes.NewReader(body))
		req.Header.Set(tmhttp.HeaderTenant, tenant)
		req.Header.Set(tmhttp.HeaderEpoch, strconv.FormatUint(p.Epoch, 10))
		resp, err := c.hc.Do(req)
		if err != nil {
			continue // connection trouble: the same idempotency key makes the retry safe
		}
		var res Result
		_ = json.NewDecoder(resp.Body).Decode(&res)
		resp.Body.Close()
		switch resp.StatusCode {
		case http.StatusCreated, http.StatusOK:
			c.mu.Lock()
			c.acked[cmd.IdempotencyKey] = amount
			c.mu.Unlock()
			return
		case http.StatusMisdirectedRequest, http.StatusServiceUnavailable:
			// Moving: a gateway holds or re-routes; here, poll the placement again shortly.
			time.Sleep(10 * time.Millisecond)
		default:
			t.Errorf("command %s: status %d", cmd.IdempotencyKey, resp.StatusCode)
			return
		}
	}
	t.Errorf("command %s not acknowledged within 30s", cmd.IdempotencyKey)
}

// waitSignals polls tm_tenant_state until ok holds for the shard's signals of tenant.
func waitSignals(t *testing.T, st *schema.Store, tenant, shard string, ok func([]schema.TenantSignal) bool) []schema.TenantSignal {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		sigs, err := st.Signals().List(context.Background(), "aggregate", tenant, shard)
		if err == nil && ok(sigs) {
			return sigs
		}
		if time.Now().After(deadline) {
			t.Fatalf("signals of %s on %s: %+v", tenant, shard, sigs)
		}
		time.Sleep(20 * time.Millisecond) // polling NATS state; no local event to await
	}
}

func phaseIs(p schema.SignalPhase, epoch uint64) func([]schema.TenantSignal) bool {
	return func(s []schema.TenantSignal) bool {
		return len(s) == 1 && s[0].Phase == p && s[0].Epoch == epoch
	}
}

func update(t *testing.T, st *schema.Store, next func(p schema.Placement) schema.Placement) schema.Placement {
	t.Helper()
	p, err := st.Placements("aggregate").Get(context.Background(), "acme")
	if err != nil {
		t.Fatal(err)
	}
	n, err := st.Placements(p.Kind).Update(context.Background(), p, next(p))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestMoveDuringCommandStream moves a tenant from aggregate-1 to aggregate-2 while clients
// stream deposits and withdrawals; no acknowledged command may be lost or applied twice.
func TestMoveDuringCommandStream(t *testing.T) {
	if testing.Short() {
		t.Skip("integration: two shards and a move")
	}
	st := openStore(t)
	ctx := context.Background()
	if _, err := st.Placements("aggregate").Create(ctx, schema.Placement{Tenant: "acme", Shard: "aggregate-1"}); err != nil {
		t.Fatal(err)
	}
	a := startInstance(t, st, "aggregate-1")
	b := startInstance(t, st, "aggregate-2")
	c := &client{st: st, urls: map[string]string{"aggregate-1": a.url, "aggregate-2": b.url},
		hc: &http.Client{Timeout: 10 * time.Second}, acked: map[string]int64{}}
	for i := range 5 {
		c.send(t, "acme", cmd(fmt.Sprintf("acc%d", i), CmdOpen, 0, fmt.Sprintf("open-%d", i)), 0)
	}
	const perClient = 150
	var wg sync.WaitGroup
	started := make(chan struct{})
	var once sync.Once
	for w := range 4 {
		wg.Go(func() {
			for i := range perClient {
				if i == 20 {
					once.Do(func() { close(started) })
				}
				key := fmt.Sprintf("w%d-%d", w, i)
				c.send(t, "acme", cmd(fmt.Sprintf("acc%d", (w+i)%5), CmdDeposit, int64(i+1), key), int64(i+1))
			}
		})
	}
	<-started
	// The move, step by step, as the rebalancer drives it.
	p := update(t, st, func(p schema.Placement) schema.Placement {
		p.Phase, p.Target, p.Strategy = schema.PhaseWarming, "aggregate-2", string(StrategySnapshot)
		return p
	})
	waitSignals(t, st, "acme", "aggregate-2", phaseIs(schema.SignalReady, p.Epoch))
	p = update(t, st, func(p schema.Placement) schema.Placement { p.Phase = schema.PhaseHandoff; return p })
	// The target commits as soon as it is at the fence, and the source then reports drained at
	// the next epoch with the same fence: a look at the signal may find either.
	src := waitSignals(t, st, "acme", "aggregate-1", func(s []schema.TenantSignal) bool {
		return phaseIs(schema.SignalDrained, p.Epoch)(s) || phaseIs(schema.SignalDrained, p.Epoch+1)(s)
	})
	fence := src[0].Fence
	waitSignals(t, st, "acme", "aggregate-2", func(s []schema.TenantSignal) bool {
		return len(s) == 1 && s[0].Phase == schema.SignalReady && s[0].Fence == fence && s[0].Applied >= fence
	})
	committed := kittest.Commit(t, st, p, "aggregate-2")
	waitSignals(t, st, "acme", "aggregate-1", phaseIs(schema.SignalDrained, committed.Epoch))
	update(t, st, func(p schema.Placement) schema.Placement {
		p.Phase, p.Source = schema.PhaseActive, ""
		return p
	})
	wg.Wait()
	if t.Failed() {
		return
	}
	// Every acknowledged command is in the stream exactly once; nothing else is.
	seen := map[string]int{}
	var deposits int64
	err := a.svc.replay(ctx, "acme", "", func(ev Event) error {
		seen[ev.CommandKey]++
		if ev.Event == EvDeposited {
			var p amountPayload
			_ = json.Unmarshal(ev.Data, &p)
			deposits += p.Amount
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	var want int64
	for key, amount := range c.acked {
		if seen[key] != 1 {
			t.Errorf("acknowledged command %s is in the stream %d times", key, seen[key])
		}
		want += amount
	}
	if len(seen) != len(c.acked) {
		t.Errorf("stream has %d commands, %d were acknowledged", len(seen), len(c.acked))
	}
	tot, _, err := b.svc.Totals(ctx, "acme")
	if err != nil {
		t.Fatal(err)
	}
	if tot.Deposits != want || deposits != want || tot.Deposits-tot.Withdrawals != tot.Balances {
		t.Fatalf("new owner's totals %+v; acknowledged deposits %d, stream deposits %d", tot, want, deposits)
	}
	if slices.Contains(a.svc.Hosted(), "acme") {
		t.Error("the old owner still holds the tenant after the move")
	}
	t.Logf("%d commands acknowledged over %d attempts across the move", len(c.acked), c.tries)
}
