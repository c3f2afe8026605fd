package shardkit_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

const testToken = "s3cret-token"

// app is a test service: it answers who served it, and its /slow route blocks until released.
type app struct {
	calls     atomic.Int64
	entered   chan struct{}
	release   chan struct{}
	forwarded atomic.Value // last x-forwarded-by seen
}

func newApp() *app {
	return &app{entered: make(chan struct{}, 16), release: make(chan struct{})}
}

func (a *app) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	a.calls.Add(1)
	a.forwarded.Store(r.Header.Get(tmhttp.HeaderForwardedBy))
	if strings.HasSuffix(r.URL.Path, "/slow") {
		a.entered <- struct{}{}
		select {
		case <-a.release:
		case <-r.Context().Done():
			return
		}
	}
	body, _ := io.ReadAll(r.Body)
	w.Header().Set("Content-Type", "text/plain")
	_, _ = io.WriteString(w, "ok "+shardkit.Tenant(r)+" "+string(body))
}

// testShard is a shard instance running behind a real HTTP server.
type testShard struct {
	*shardkit.Shard
	URL    string
	app    *app
	cancel context.CancelFunc
	done   chan error
}

// startShard builds a shard from cfg (ID, Store required), serves it and runs it until the test
// ends; it returns once the shard is registered.
func startShard(t testing.TB, cfg shardkit.Config) *testShard {
	t.Helper()
	r := chi.NewRouter()
	srv := httptest.NewUnstartedServer(r)
	cfg.URL = "http://" + srv.Listener.Addr().String()
	if cfg.Heartbeat == 0 {
		cfg.Heartbeat = 200 * time.Millisecond
	}
	if cfg.DrainTimeout == 0 {
		cfg.DrainTimeout = 20 * time.Second
	}
	sk, err := shardkit.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	a := newApp()
	sk.Mount(r)
	r.With(sk.Gate).Handle("/t/*", a)
	srv.Start()
	ctx, cancel := context.WithCancel(context.Background())
	ts := &testShard{Shard: sk, URL: cfg.URL, app: a, cancel: cancel, done: make(chan error, 1)}
	go func() { ts.done <- sk.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-ts.done:
		case <-time.After(30 * time.Second):
			t.Error("shard did not stop within 30s")
		}
		srv.Close()
	})
	select {
	case <-sk.Running():
	case err := <-ts.done:
		t.Fatalf("shard stopped at start: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("shard not running within 30s")
	}
	return ts
}

// stop cancels the shard's Run (a SIGTERM) and waits for it.
func (ts *testShard) stop(t testing.TB) error {
	t.Helper()
	ts.cancel()
	select {
	case err := <-ts.done:
		ts.done <- err
		return err
	case <-time.After(30 * time.Second):
		t.Fatal("shard did not stop within 30s")
	}
	return nil
}

var client = &http.Client{Timeout: 20 * time.Second}

// call sends a request for tenant and returns status, headers and body.
func call(t testing.TB, method, url, tenant string, hdr map[string]string, body string) (int, http.Header, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if tenant != "" {
		req.Header.Set(tmhttp.HeaderTenant, tenant)
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(b)
}

func problemOf(t testing.TB, h http.Header, body string) tmhttp.Problem {
	t.Helper()
	if ct := h.Get("Content-Type"); ct != tmhttp.ContentTypeProblem {
		t.Fatalf("content type %q, body %s", ct, body)
	}
	var p tmhttp.Problem
	if err := json.Unmarshal([]byte(body), &p); err != nil {
		t.Fatal(err)
	}
	return p
}

func admin(t testing.TB, method, url, token string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// place creates or updates a tenant's placement and returns it as stored.
func place(t testing.TB, st *schema.Store, p schema.Placement) schema.Placement {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	prev, err := st.Placements(p.Kind).Get(ctx, p.Tenant)
	if err != nil {
		got, err := st.Placements(p.Kind).Create(ctx, p)
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	got, err := st.Placements(p.Kind).Update(ctx, prev, p)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// synced waits until every shard applied placement revision rev.
func synced(t testing.TB, rev uint64, shards ...*testShard) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, s := range shards {
		if err := s.WaitPlacement(ctx, rev); err != nil {
			t.Fatal(err)
		}
	}
}

// awaitPlacement waits until the tenant's placement satisfies ok and returns it.
func awaitPlacement(t testing.TB, st *schema.Store, kind, tenant string, ok func(schema.Placement) bool) schema.Placement {
	t.Helper()
	var p schema.Placement
	tmtest.WaitFor(t, 10*time.Second, func() error {
		var err error
		if p, err = st.Placements(kind).Latest(context.Background(), tenant); err != nil {
			return err
		}
		if !ok(p) {
			return fmt.Errorf("placement of %s/%s is %s@%d %s", kind, tenant, p.Shard, p.Epoch, p.Phase)
		}
		return nil
	})
	return p
}

// signalWatch follows one instance's signal for a tenant.
type signalWatch struct {
	w jetstream.KeyWatcher
}

func watchSignal(t testing.TB, st *schema.Store, kind, tenant string, id schema.InstanceID) *signalWatch {
	t.Helper()
	key := kind + "." + tenant + "." + id.Shard + "." + id.Instance
	w, err := st.KV(schema.BucketTenantState).Watch(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Stop() })
	return &signalWatch{w: w}
}

// next waits for a signal satisfying ok (nil signal: deleted) and returns it.
func (sw *signalWatch) next(t testing.TB, what string, ok func(*schema.TenantSignal) bool) *schema.TenantSignal {
	t.Helper()
	deadline := time.After(20 * time.Second)
	for {
		select {
		case e, open := <-sw.w.Updates():
			if !open {
				t.Fatalf("signal watch closed waiting for %s", what)
			}
			if e == nil {
				continue
			}
			var sig *schema.TenantSignal
			if e.Operation() == jetstream.KeyValuePut {
				sig = new(schema.TenantSignal)
				if err := json.Unmarshal(e.Value(), sig); err != nil {
					t.Fatal(err)
				}
			}
			if ok(sig) {
				return sig
			}
		case <-deadline:
			t.Fatalf("no signal %s within 20s", what)
		}
	}
}

func phaseIs(p schema.SignalPhase) func(*schema.TenantSignal) bool {
	return func(s *schema.TenantSignal) bool { return s != nil && s.Phase == p }
}

func id(shard, inst string) schema.InstanceID {
	return schema.InstanceID{Kind: "aggregate", Shard: shard, Instance: inst}
}

// loadReports subscribes to kind's load reports until the test ends; reports beyond buf
// waiting are dropped.
func loadReports(t testing.TB, st *schema.Store, kind string, buf int) <-chan schema.LoadReport {
	t.Helper()
	reports := make(chan schema.LoadReport, buf)
	sub, err := st.SubscribeLoad(kind, func(r schema.LoadReport) {
		select {
		case reports <- r:
		default:
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	return reports
}
