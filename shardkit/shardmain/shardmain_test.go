package shardmain_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/natsconn"
	"github.com/tenantmesh/tenantmesh/shardkit/natsperm"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/shardmain"
)

// echo is a service on net/http's ServeMux: /echo behind the gate, /admin/echo behind the
// admin token, and a background loop that counts its runs.
type echo struct{ ran chan struct{} }

func (e *echo) Hooks() shardkit.Hooks  { return shardkit.Hooks{} }
func (e *echo) Routes() []schema.Route { return []schema.Route{{Method: "GET", Prefix: "/echo"}} }
func (e *echo) Handler(sk *shardkit.Shard) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /echo", sk.Gate(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "echo "+shardkit.Tenant(r))
	})))
	mux.Handle("GET /admin/echo", sk.RequireAdmin(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "admin")
	})))
	return mux
}
func (e *echo) Run(ctx context.Context) error {
	close(e.ran)
	<-ctx.Done()
	return nil
}

func get(t *testing.T, url, tenant, token string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("GET", url, nil)
	if tenant != "" {
		req.Header.Set("x-tenant-id", tenant)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	return resp.StatusCode, string(b)
}

// TestRun runs a shard binary's main in process on the secured NATS path (the shard role's
// credentials): it serves its tenants behind the gate beside the shard's own routes, refuses
// another shard's, and on cancel shuts down cleanly and leaves the directory.
func TestRun(t *testing.T) {
	srv := natstest.Server(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st := kittest.StoreAt(t, srv.URL())
	if _, err := st.Kinds().Ensure(ctx, schema.KindConfig{Kind: "echo"}); err != nil {
		t.Fatal(err)
	}
	for tenant, shard := range map[string]string{"acme": "echo-1", "globex": "echo-2"} {
		if _, err := st.Placements("echo").Create(ctx, schema.Placement{Tenant: tenant, Shard: shard, Epoch: 1, Phase: schema.PhaseActive}); err != nil {
			t.Fatal(err)
		}
	}
	m := &shardmain.Main{Kind: "echo", Addr: "127.0.0.1:0", Shard: "echo-1", Instance: "a", AdminToken: "tok",
		NATS:     natsconn.Options{URL: srv.URL(), Creds: natstest.CredsFile(t, natsperm.Shard("echo", "echo-1", natsperm.Assets{}))},
		LogLevel: "error", LogFormat: "json", Stderr: io.Discard, Heartbeat: 100 * time.Millisecond, DrainTimeout: time.Second}
	app := &echo{ran: make(chan struct{})}
	ready := m.Listening()
	rctx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	var runErr error
	go func() {
		defer close(done)
		runErr = m.Run(rctx, func(context.Context, shardmain.Env) (shardmain.App, error) { return app, nil })
	}()
	defer func() { stop(); <-done }()
	var url string
	select {
	case url = <-ready:
	case <-done:
		t.Fatalf("stopped before serving: %v", runErr)
	case <-time.After(20 * time.Second):
		t.Fatal("not serving within 20s")
	}
	<-app.ran

	for _, c := range []struct {
		path, tenant, token string
		code                int
		body                string
	}{
		{"/healthz", "", "", 200, `"status": "ok"`},
		{"/readyz", "", "", 200, `"ready": true`},
		{"/echo", "acme", "", 200, "echo acme"},
		{"/echo", "globex", "", 421, `"owner":"echo-2"`},
		{"/admin/echo", "", "", 401, ""},
		{"/admin/echo", "", "tok", 200, "admin"},
		{"/admin/tenants", "", "tok", 200, "["},
		{"/metrics", "", "", 200, "go_goroutines"},
	} {
		code, body := get(t, url+c.path, c.tenant, c.token)
		if code != c.code || !strings.Contains(body, c.body) {
			t.Errorf("GET %s (tenant %q): %d %s; want %d with %q", c.path, c.tenant, code, body, c.code, c.body)
		}
	}
	if _, err := st.Directory().Instance(ctx, schema.InstanceID{Kind: "echo", Shard: "echo-1", Instance: "a"}); err != nil {
		t.Fatalf("not in the directory while serving: %v", err)
	}
	stop()
	select {
	case <-done:
		if runErr != nil {
			t.Fatalf("Run: %v", runErr)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("did not stop within 20s")
	}
	if _, err := st.Directory().Instance(ctx, schema.InstanceID{Kind: "echo", Shard: "echo-1", Instance: "a"}); !errors.Is(err, schema.ErrNotFound) {
		t.Errorf("directory entry after a clean stop: %v, want not found", err)
	}
}

// TestParseFlags: every flag also comes from its TM_* variable, a flag wins over it, and a
// variable that does not parse is an error.
func TestParseFlags(t *testing.T) {
	t.Setenv("TM_SHARD", "notes-2")
	t.Setenv("TM_NATS_URL", "nats://10.0.0.1:4222")
	t.Setenv("TM_DRAIN_TIMEOUT", "3s")
	var m shardmain.Main
	if err := m.ParseFlags("notes", []string{"--instance", "b", "--drain-timeout", "4s"}); err != nil {
		t.Fatal(err)
	}
	if m.Kind != "notes" || m.Shard != "notes-2" || m.Instance != "b" || m.NATS.URL != "nats://10.0.0.1:4222" || m.DrainTimeout != 4*time.Second {
		t.Errorf("parsed %+v", m)
	}
	t.Setenv("TM_HEARTBEAT", "often")
	if err := new(shardmain.Main).ParseFlags("notes", nil); err == nil || !strings.Contains(err.Error(), "TM_HEARTBEAT") {
		t.Errorf("bad TM_HEARTBEAT: %v", err)
	}
}

// A binary that serves any kind (the sidecar) reads --kind, its shard defaulting to
// <kind>-1, and defines its own flags through Extra; without a kind it is a usage error.
func TestParseFlagsAnyKind(t *testing.T) {
	var upstream string
	m := shardmain.Main{Extra: func(fs *flag.FlagSet) { fs.StringVar(&upstream, "upstream", "", "") }}
	if err := m.ParseFlags("", []string{"--kind", "notes", "--upstream", "http://127.0.0.1:8000"}); err != nil {
		t.Fatal(err)
	}
	if m.Kind != "notes" || m.Shard != "notes-1" || upstream != "http://127.0.0.1:8000" {
		t.Errorf("kind %q shard %q upstream %q", m.Kind, m.Shard, upstream)
	}
	if err := new(shardmain.Main).ParseFlags("", nil); err == nil || !strings.Contains(err.Error(), "--kind") {
		t.Errorf("no kind: %v", err)
	}
}

// The standard flags come from the command line or their TM_* variables.
func ExampleMain_ParseFlags() {
	var m shardmain.Main
	err := m.ParseFlags("notes", []string{"--shard", "notes-2", "--instance", "a", "--nats-url", "nats://10.0.0.1:4222"})
	fmt.Println(err, m.Kind, m.Shard, m.Instance, m.NATS.URL, m.DrainTimeout)
	// Output: <nil> notes notes-2 a nats://10.0.0.1:4222 10s
}
