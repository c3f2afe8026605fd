package runner

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/certfile"
	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/natsauth"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/natsconn"
	"github.com/tenantmesh/tenantmesh/shardkit/natsperm"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/shardmain"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// binary runs one runner instance the way cmd/runner does (shardmain: shardkit gate,
// registration, heartbeats, moves), in process.
func binary(t *testing.T, natsURL, shard, instance string, opts ...func(*shardmain.Main)) string {
	t.Helper()
	m := &shardmain.Main{Kind: Kind, Addr: "127.0.0.1:0", NATS: natsconn.Options{URL: natsURL, Creds: natstest.CredsFile(t, natsperm.Shard(Kind, shard, natsperm.KindAssets(Kind)))}, Shard: shard, Instance: instance, AdminToken: "secret",
		LogLevel: "error", LogFormat: "json", Stderr: io.Discard, Heartbeat: 100 * time.Millisecond, DrainTimeout: 5 * time.Second}
	for _, o := range opts {
		o(m)
	}
	ready := m.Listening()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		err := m.Run(ctx, func(ctx context.Context, env shardmain.Env) (shardmain.App, error) {
			return New(ctx, Config{Store: env.Store, ID: env.ID, Logger: env.Logger, Registerer: env.Registerer, MaxConcurrent: 8,
				WebhookAllow: testReceivers})
		})
		if err != nil {
			t.Error(err)
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	select {
	case url := <-ready:
		return url
	case <-done:
		t.Fatal("runner stopped before serving")
	case <-time.After(20 * time.Second):
		t.Fatal("runner did not start")
	}
	return ""
}

func post(t *testing.T, url, tenant, body string) (int, Run) {
	t.Helper()
	return postKeyed(t, url, tenant, body, "")
}

func postKeyed(t *testing.T, url, tenant, body, key string) (int, Run) {
	t.Helper()
	req, _ := http.NewRequest("POST", url+"/jobs", strings.NewReader(body))
	req.Header.Set(tmhttp.HeaderTenant, tenant)
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := tmtest.HTTP.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var r Run
	_ = json.NewDecoder(resp.Body).Decode(&r)
	return resp.StatusCode, r
}

// create posts a job as a client that follows the store-unavailable answer's advice: on 503
// it retries with the same Idempotency-Key (at most 10 times), so the job is created once.
func createJob(t *testing.T, url, tenant, body, key string) (int, Run) {
	t.Helper()
	for range 10 {
		code, r := postKeyed(t, url, tenant, body, key)
		if code != http.StatusServiceUnavailable {
			return code, r
		}
		time.Sleep(100 * time.Millisecond) // the answer's Retry-After, shortened
	}
	return http.StatusServiceUnavailable, Run{}
}

// signal waits until every instance of shard reports phase at epoch for tenant.
func awaitSignal(t *testing.T, st *schema.Store, tenant, shard string, phase schema.SignalPhase, epoch uint64) {
	t.Helper()
	waitUntil(t, 20*time.Second, fmt.Sprintf("%s %s at epoch %d or later", shard, phase, epoch), func() bool {
		sigs, err := st.Signals().List(context.Background(), Kind, tenant, shard)
		if err != nil || len(sigs) == 0 {
			return false
		}
		for _, s := range sigs {
			// At epoch or later: the target commits as soon as it is at the fence, and the
			// source's drained at the handoff epoch is then overwritten by drained at the next.
			if s.Phase != phase || s.Epoch < epoch {
				return false
			}
		}
		return true
	})
}

// readRun reads a run straight from the runs bucket.
func readRun(t *testing.T, st *schema.Store, tenant, id string) (Run, error) {
	kv, err := st.JS().JetStream().KeyValue(context.Background(), schema.ServiceBucket(Kind, "runs"))
	if err != nil {
		return Run{}, err
	}
	e, err := kv.Get(context.Background(), runKey(tenant, id))
	if err != nil {
		return Run{}, err
	}
	var r Run
	err = json.Unmarshal(e.Value(), &r)
	return r, err
}

// The runner binary under real shardkit: jobs go in through the gate, the move follows the
// signal protocol as the rebalancer drives it (shardkit calls Fence at handoff and Release
// after the commit), and every effect is delivered once.
func TestBinaryMove(t *testing.T) {
	srv := natstest.Server(t)
	ctx := context.Background()
	st := kittest.StoreAt(t, srv.URL())
	if err := st.Provision(ctx); err != nil { // as the rebalancer does; the shards wait for it
		t.Fatal(err)
	}
	rc := newReceiver(t)
	rc.delay = time.Millisecond
	const tenant, n = "acme", 300
	p := place(t, st, tenant, "runner-1")
	a := binary(t, srv.URL(), "runner-1", "a")
	b := binary(t, srv.URL(), "runner-2", "b")
	body, _ := json.Marshal(hookJob(rc.URL, "hi"))
	if code, _ := post(t, b, tenant, string(body)); code != http.StatusMisdirectedRequest {
		t.Fatalf("POST to the non-owner: %d, want 421", code)
	}
	ids := make([]string, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			code, r := createJob(t, a, tenant, string(body), fmt.Sprintf("binary-move-%d", i))
			if code != http.StatusAccepted && code != http.StatusOK { // 200: a retry found it created
				t.Errorf("POST: %d", code)
			}
			ids[i] = r.ID
		})
		if i%50 == 49 {
			wg.Wait()
		}
	}
	wg.Wait()
	rc.await(t, 50, 20*time.Second)

	p = step(t, st, p, func(p *schema.Placement) { p.Phase, p.Target = schema.PhaseWarming, "runner-2" })
	awaitSignal(t, st, tenant, "runner-2", schema.SignalReady, p.Epoch)
	p = step(t, st, p, func(p *schema.Placement) { p.Phase = schema.PhaseHandoff })
	awaitSignal(t, st, tenant, "runner-1", schema.SignalDrained, p.Epoch) // after the runner's Fence drained it
	awaitSignal(t, st, tenant, "runner-2", schema.SignalReady, p.Epoch)
	p = kittest.Commit(t, st, p, "runner-2")
	awaitSignal(t, st, tenant, "runner-1", schema.SignalDrained, p.Epoch)
	step(t, st, p, func(p *schema.Placement) { p.Phase, p.Source = schema.PhaseActive, "" })

	// Jobs keep coming, now to B.
	var more []string
	waitUntil(t, 10*time.Second, "B accepting jobs", func() bool {
		code, r := post(t, b, tenant, string(body))
		if code == http.StatusAccepted {
			more = append(more, r.ID)
		}
		return code == http.StatusAccepted
	})
	ids = append(ids, more...)

	// Wait through the API: every job succeeded.
	waitUntil(t, 60*time.Second, "every job succeeded", func() bool {
		req, _ := http.NewRequest("GET", b+"/jobs?status=succeeded&limit=1000", nil)
		req.Header.Set(tmhttp.HeaderTenant, tenant)
		resp, err := tmtest.HTTP.Do(req)
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		var out struct{ Jobs []Run }
		_ = json.NewDecoder(resp.Body).Decode(&out)
		return len(out.Jobs) == len(ids)
	})
	ranOn := map[string]int{}
	for _, id := range ids {
		r, err := readRun(t, st, tenant, id)
		if err != nil {
			t.Fatal(err)
		}
		ranOn[r.RanOn]++
	}
	t.Logf("jobs per instance: %v", ranOn)
	counts, total := rc.snapshot()
	if total != len(ids) || len(counts) != len(ids) {
		t.Fatalf("receiver got %d deliveries over %d keys, want %d each once", total, len(counts), len(ids))
	}
	// The source writes its drain record after its release, in the background.
	tmtest.WaitFor(t, 10*time.Second, func() error {
		kv, err := st.JS().JetStream().KeyValue(ctx, schema.ServiceBucket(Kind, "checkpoints"))
		if err != nil {
			return err
		}
		v, err := kv.Get(ctx, drainKey(tenant))
		if err != nil {
			return fmt.Errorf("drain record: %w", err)
		}
		if !strings.Contains(string(v.Value()), "runner-1") {
			return fmt.Errorf("drain record %q is not runner-1's", v.Value())
		}
		return nil
	})

	// The host dashboard view, once both instances heartbeated and wrote their runner status.
	waitUntil(t, 10*time.Second, "both instances in the view with metrics and runner status", func() bool {
		req, _ := http.NewRequest("GET", a+"/admin/runner/instances", nil)
		req.Header.Set("Authorization", "Bearer secret")
		resp, err := tmtest.HTTP.Do(req)
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		var view struct{ Instances []InstanceView }
		if err := json.NewDecoder(resp.Body).Decode(&view); err != nil || resp.StatusCode != 200 || len(view.Instances) != 2 {
			return false
		}
		for _, v := range view.Instances {
			if v.Status != schema.StatusOnline || v.Metrics == nil || v.Runner == nil || v.Runner.MaxConcurrent != 8 {
				return false
			}
		}
		return true
	})
}

// --tls-cert/--tls-key: the instance serves HTTPS and registers an https:// URL.
func TestBinaryServesTLS(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	if err := st.Provision(context.Background()); err != nil {
		t.Fatal(err)
	}
	files, err := natsauth.LoadOrCreateTLS(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	url := binary(t, srv.URL(), "runner-1", "a", func(m *shardmain.Main) { m.TLSCert, m.TLSKey = files.Cert, files.Key })
	if !strings.HasPrefix(url, "https://") {
		t.Fatalf("instance URL %s", url)
	}
	in, err := st.Directory().Instance(context.Background(), schema.InstanceID{Kind: Kind, Shard: "runner-1", Instance: "a"})
	if err != nil || in.URL != url {
		t.Fatalf("directory has %q (%v), want %s", in.URL, err, url)
	}
	cas, err := certfile.Pool(files.CA)
	if err != nil {
		t.Fatal(err)
	}
	c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: cas}}}
	resp, err := c.Get(url + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.TLS == nil {
		t.Fatalf("GET /healthz over TLS: %d", resp.StatusCode)
	}
}
