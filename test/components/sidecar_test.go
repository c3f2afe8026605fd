package components_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/tenantmesh/tenantmesh/gateway"
	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/natsconn"
	"github.com/tenantmesh/tenantmesh/shardkit/natsperm"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/shardmain"
	"github.com/tenantmesh/tenantmesh/shardkit/sidecar"
	"github.com/tenantmesh/tenantmesh/shardkit/sidecar/sidecartest"
)

// python starts testdata/notes.py (state files in dir) and returns its URL; it is killed when
// the test ends.
func python(t *testing.T, dir string) string {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		// make test (TM_REQUIRE_TOOLS=1) and CI need it: there the sidecar's test must run.
		if os.Getenv("TM_REQUIRE_TOOLS") != "" || os.Getenv("CI") != "" {
			t.Fatal("python3 is not installed: the sidecar test runs a Python service (apt-get install python3)")
		}
		t.Skip("python3 is not installed; set TM_REQUIRE_TOOLS=1 to make this a failure, as make test does")
	}
	cmd := exec.Command(py, "testdata/notes.py", dir)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &syncWriter{w: &stderr}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
		if t.Failed() && stderr.Len() > 0 {
			t.Logf("notes.py said:\n%s", stderr.String())
		}
	})
	port := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		if sc.Scan() {
			port <- sc.Text()
		}
		_, _ = io.Copy(io.Discard, out)
	}()
	select {
	case p := <-port:
		return "http://127.0.0.1:" + strings.TrimSpace(p)
	case <-done:
		t.Fatal("notes.py exited before listening")
	case <-time.After(20 * time.Second):
		t.Fatal("notes.py did not listen within 20s")
	}
	return ""
}

var client = &http.Client{Timeout: 15 * time.Second}

// note sends one request for tenant and returns its status, X-Served-By and body.
func note(method, url, tenant, body string) (int, string, string, error) {
	req, _ := http.NewRequest(method, url+"/notes", strings.NewReader(body))
	req.Header.Set("x-tenant-id", tenant)
	resp, err := client.Do(req)
	if err != nil {
		return 0, "", "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return resp.StatusCode, resp.Header.Get("X-Served-By"), string(b), nil
}

// TestPythonServiceMovesLive runs a notes service written in Python twice, each behind a
// sidecar as one shard, with a gateway in front, and moves a tenant from notes-1 to notes-2
// through the rebalancer's engine while four writers add notes: no request may fail, every
// acknowledged note must be on the new owner, and the hooks carried the state over (fence on
// the source, warm on the target, release on the source).
func TestPythonServiceMovesLive(t *testing.T) {
	srv := natstest.Server(t)
	st, natsURL := kittest.StoreAt(t, srv.URL()), srv.URL()
	ctx := context.Background()
	if _, err := st.Kinds().Ensure(ctx, schema.KindConfig{Kind: "notes"}); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	sidecartest.Start(t, natsURL, "notes", "notes-1", "a", python(t, dir), "warm,applied,fence,release")
	sidecartest.Start(t, natsURL, "notes", "notes-2", "a", python(t, dir), "warm,applied,fence,release")
	p, err := st.Placements("notes").Create(ctx, schema.Placement{Tenant: "alice", Shard: "notes-1"})
	if err != nil {
		t.Fatal(err)
	}
	gw := startGateway(t, st, gateway.Config{})
	tmtest.WaitFor(t, 20*time.Second, func() error {
		code, by, body, err := note("POST", gw, "alice", `{"id":"first","text":"hello"}`)
		if err != nil || code != http.StatusCreated || by != "notes.notes-1.a" {
			return fmt.Errorf("first note through the gateway: %d %q %s %v", code, by, body, err)
		}
		return nil
	})

	var mu sync.Mutex
	acked, failures, requests := []string{"first"}, []string{}, 0
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			tick := time.NewTicker(5 * time.Millisecond)
			defer tick.Stop()
			for i := 0; i < 10000; i++ {
				select {
				case <-stop:
					return
				case <-tick.C:
				}
				id := fmt.Sprintf("w%d-%d", w, i)
				code, _, body, err := note("POST", gw, "alice", `{"id":"`+id+`","text":"under load"}`)
				mu.Lock()
				requests++
				if err != nil || code != http.StatusCreated {
					failures = append(failures, fmt.Sprintf("%s: %d %s %v", id, code, body, err))
				} else {
					acked = append(acked, id)
				}
				mu.Unlock()
			}
		})
	}
	tmtest.WaitFor(t, 10*time.Second, func() error { // the move starts under load
		mu.Lock()
		defer mu.Unlock()
		if len(acked) < 20 {
			return fmt.Errorf("%d notes written before the move", len(acked))
		}
		return nil
	})
	eng, err := rebalancer.New(rebalancer.Config{Store: st, Holder: "sidecar-test"})
	if err != nil {
		t.Fatal(err)
	}
	rec, err := eng.CreatePlan(ctx, &planner.Plan{Strategy: "manual", Concurrency: 1, Waves: 1,
		Moves: []planner.Move{{Kind: "notes", Tenant: "alice", From: "notes-1", To: "notes-2", Revision: p.Revision, Wave: 1}}}, "test")
	if err != nil {
		t.Fatal(err)
	}
	actx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	done, err := eng.Apply(actx, rec.ID)
	close(stop)
	wg.Wait()
	if err != nil || done.Status != rebalancer.PlanDone {
		t.Fatalf("the move: %s %v", done.Status, err)
	}
	if len(failures) > 0 {
		t.Errorf("%d of %d requests failed during the move; first: %s", len(failures), requests, strings.Join(failures[:min(5, len(failures))], "; "))
	}
	code, by, body, err := note("GET", gw, "alice", "")
	if err != nil || code != http.StatusOK || by != "notes.notes-2.a" {
		t.Fatalf("after the move: %d %q %v", code, by, err)
	}
	var got []struct{ ID string }
	if err := json.Unmarshal([]byte(body), &got); err != nil {
		t.Fatal(err)
	}
	have := map[string]bool{}
	for _, n := range got {
		have[n.ID] = true
	}
	lost := slices.DeleteFunc(slices.Clone(acked), func(id string) bool { return have[id] })
	if len(lost) > 0 {
		t.Errorf("%d of %d acknowledged notes are not on the new owner, e.g. %v", len(lost), len(acked), lost[:min(5, len(lost))])
	}
	t.Logf("moved under load: %d requests, %d acknowledged, %d failed; notes-2 serves %d notes", requests, len(acked), len(failures), len(got))
}

// syncWriter serialises writes to w.
type syncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}

// TestGRPCServiceBehindSidecar: a gRPC service (grpc-go, h2c) behind the sidecar, reached
// through the gateway: a unary call and a server stream of the tenant's shard, and the
// gate's refusal of another shard's tenant is a status, never the service's answer.
func TestGRPCServiceBehindSidecar(t *testing.T) {
	srv := natstest.Server(t)
	st, natsURL := kittest.StoreAt(t, srv.URL()), srv.URL()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := st.Kinds().Ensure(ctx, schema.KindConfig{Kind: "hc"}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Placements("hc").Create(ctx, schema.Placement{Tenant: "acme", Shard: "hc-1", Epoch: 1, Phase: schema.PhaseActive}); err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	hs := health.NewServer()
	healthpb.RegisterHealthServer(gs, hs)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = gs.Serve(ln) }()
	t.Cleanup(gs.Stop)

	sc, err := sidecar.New(sidecar.Options{Upstream: "http://" + ln.Addr().String(), Routes: sidecar.RouteList{{Method: "POST", Prefix: "/grpc.health.v1.Health"}},
		HooksPath: "/tenantmesh", HookTimeout: 5 * time.Second, WarmTimeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	m := &shardmain.Main{Kind: "hc", Addr: "127.0.0.1:0", Shard: "hc-1", Instance: "a", AdminToken: "tok",
		NATS:     natsconn.Options{URL: natsURL, Creds: natstest.CredsFile(t, natsperm.Shard("hc", "hc-1", natsperm.Assets{}))},
		LogLevel: "error", LogFormat: "json", Stderr: io.Discard, Heartbeat: 200 * time.Millisecond, DrainTimeout: 5 * time.Second}
	direct := kittest.Main(t, m, sc.Build)
	gw := startGateway(t, st, gateway.Config{})

	dial := func(url string) healthpb.HealthClient {
		cc, err := grpc.NewClient("passthrough:///"+strings.TrimPrefix(url, "http://"), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cc.Close() })
		return healthpb.NewHealthClient(cc)
	}
	c := dial(gw)
	cctx := metadata.AppendToOutgoingContext(ctx, "x-tenant-id", "acme")
	var hdr metadata.MD
	var resp *healthpb.HealthCheckResponse
	tmtest.WaitFor(t, 20*time.Second, tmtest.Until("the route is published and the call served", func() bool {
		resp, err = c.Check(cctx, &healthpb.HealthCheckRequest{}, grpc.Header(&hdr))
		return err == nil
	}))
	if resp.GetStatus() != healthpb.HealthCheckResponse_SERVING || strings.Join(hdr.Get("x-served-by"), "") != "hc.hc-1.a" {
		t.Fatalf("Check through the gateway: %v, headers %v", resp, hdr)
	}
	ws, err := c.Watch(cctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if m, err := ws.Recv(); err != nil || m.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("Watch: %v %v", m, err)
	}
	hs.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	if m, err := ws.Recv(); err != nil || m.GetStatus() != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("Watch's second message: %v %v", m, err)
	}
	// The tenant starts to leave (an admin drain, as a move's handoff does): the stream ends
	// UNAVAILABLE, so the drain does not wait for it and the client calls again.
	req, _ := http.NewRequest("POST", direct+"/admin/drain?tenant_id=acme", nil)
	req.Header.Set("Authorization", "Bearer tok")
	dr, err := client.Do(req)
	if err != nil || dr.StatusCode != http.StatusAccepted {
		t.Fatalf("drain: %v %v", dr, err)
	}
	dr.Body.Close()
	if _, err := ws.Recv(); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "Tenant moved") {
		t.Fatalf("the stream at the tenant's drain: %v, want UNAVAILABLE (Tenant moved)", err)
	}
	// Straight to the sidecar, for a tenant of another shard: the gate's status.
	if _, err := st.Placements("hc").Create(ctx, schema.Placement{Tenant: "globex", Shard: "hc-2", Epoch: 1, Phase: schema.PhaseActive}); err != nil {
		t.Fatal(err)
	}
	var tr metadata.MD
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("globex refused naming its owner", func() bool {
		_, err = dial(direct).Check(metadata.AppendToOutgoingContext(ctx, "x-tenant-id", "globex"), &healthpb.HealthCheckRequest{}, grpc.Trailer(&tr))
		return status.Code(err) == codes.Unavailable && strings.Join(tr.Get("x-tm-owner"), "") == "hc-2"
	}))
}
