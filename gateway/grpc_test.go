package gateway

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/tenantmesh/tenantmesh/internal/gatesig"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// grpcRoute is the route of the test service (grpc.health.v1.Health: a real unary call,
// Check, and a real server stream, Watch).
var grpcRoute = schema.Route{Method: "POST", Prefix: "/grpc.health.v1.Health", Kind: "aggregate"}

// grpcBackend is a shard instance serving gRPC as shardmain does: a net/http server with
// HTTP/2 with prior knowledge, the calls to grpc.Server's ServeHTTP, and a hook that may
// answer a call itself (a gate refusal).
type grpcBackend struct {
	id  schema.InstanceID
	url string

	mu     sync.Mutex
	seen   []metadata.MD
	refuse func(w http.ResponseWriter, r *http.Request) bool
	// block, if set, makes Check wait for it (or the call's end).
	block chan struct{}
	// stream ends Watch with UNAVAILABLE when closed.
	stream chan struct{}
}

func newGRPCBackend(t testing.TB, kind, shard, inst string) *grpcBackend {
	t.Helper()
	b := &grpcBackend{id: schema.InstanceID{Kind: kind, Shard: shard, Instance: inst}, stream: make(chan struct{})}
	gs := grpc.NewServer()
	healthpb.RegisterHealthServer(gs, healthServer{b: b})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Protocols: serverProtocols(), ReadHeaderTimeout: 5 * time.Second,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b.mu.Lock()
			refuse := b.refuse
			b.mu.Unlock()
			if refuse != nil && refuse(w, r) {
				return
			}
			w.Header().Set(tmhttp.HeaderServedBy, b.id.Key())
			gs.ServeHTTP(w, r)
		})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
		gs.Stop()
	})
	b.url = "http://" + ln.Addr().String()
	return b
}

func (b *grpcBackend) calls() []metadata.MD {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]metadata.MD(nil), b.seen...)
}

type healthServer struct {
	healthpb.UnimplementedHealthServer
	b *grpcBackend
}

func (h healthServer) Check(ctx context.Context, in *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	h.b.mu.Lock()
	h.b.seen = append(h.b.seen, md)
	block := h.b.block
	h.b.mu.Unlock()
	if block != nil {
		select {
		case <-block:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	_ = grpc.SetTrailer(ctx, metadata.Pairs("x-trailer", "from-"+h.b.id.Instance))
	return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
}

func (h healthServer) Watch(in *healthpb.HealthCheckRequest, s grpc.ServerStreamingServer[healthpb.HealthCheckResponse]) error {
	for i := 0; ; i++ {
		if err := s.Send(&healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}); err != nil {
			return err
		}
		if i == 2 {
			break
		}
	}
	select {
	case <-h.b.stream:
		return status.Error(codes.Unavailable, "the tenant moved; call again")
	case <-s.Context().Done():
		return s.Context().Err()
	}
}

func (e *env) registerGRPC(b *grpcBackend, routes ...schema.Route) {
	e.t.Helper()
	ctx := context.Background()
	if _, err := e.st.Directory().Register(ctx, schema.Instance{InstanceID: b.id, URL: b.url, Capacity: 10}); err != nil {
		e.t.Fatal(err)
	}
	for _, r := range routes {
		if _, err := e.st.Routes().AddInstance(ctx, r, b.id); err != nil {
			e.t.Fatal(err)
		}
	}
}

// grpcClient is a gRPC client of the gateway over h2c.
func (e *env) grpcClient() healthpb.HealthClient {
	e.t.Helper()
	cc, err := grpc.NewClient("passthrough:///"+strings.TrimPrefix(e.url, "http://"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { cc.Close() })
	return healthpb.NewHealthClient(cc)
}

func tenantCtx(tenant string, kv ...string) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	if tenant != "" {
		kv = append(kv, "x-tenant-id", tenant)
	}
	return metadata.AppendToOutgoingContext(ctx, kv...), cancel
}

// grpcEnv is an env with one kind, kc, whose shards aggregate-1 ... aggregate-n each have one
// gRPC instance (a, b, ...; returned in that order), and tenants placed on aggregate-1.
func grpcEnv(t *testing.T, cfg Config, kc schema.KindConfig, n int, tenants ...string) (*env, []*grpcBackend) {
	t.Helper()
	backends := make([]*grpcBackend, n)
	e := newEnv(t, cfg, []schema.KindConfig{kc}, func(e *env) {
		for i := range backends {
			backends[i] = newGRPCBackend(t, kc.Kind, fmt.Sprintf("%s-%d", kc.Kind, i+1), string(rune('a'+i)))
			e.registerGRPC(backends[i], grpcRoute)
		}
		for _, tenant := range tenants {
			e.place(kc.Kind, tenant, kc.Kind+"-1")
		}
	})
	return e, backends
}

// recvN reads n messages of a server stream, failing the test (what names the stream) on an error.
func recvN(t *testing.T, st healthpb.Health_WatchClient, n int, what string) {
	t.Helper()
	for i := range n {
		if _, err := st.Recv(); err != nil {
			t.Fatalf("%s, message %d: %v", what, i, err)
		}
	}
}

func TestGRPCUnary(t *testing.T) {
	e, bs := grpcEnv(t, Config{}, schema.KindConfig{Kind: "aggregate"}, 1, "t1")
	a := bs[0]
	c := e.grpcClient()
	ctx, cancel := tenantCtx("t1", tmhttp.HeaderEpoch, "99", "x-tm-subject", "mallory")
	defer cancel()
	var hdr, tr metadata.MD
	resp, err := c.Check(ctx, &healthpb.HealthCheckRequest{Service: "x"}, grpc.Header(&hdr), grpc.Trailer(&tr))
	if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("Check: %v %v", resp, err)
	}
	if got := hdr.Get("x-served-by"); len(got) != 1 || got[0] != a.id.Key() {
		t.Fatalf("x-served-by %q", got)
	}
	if got := tr.Get("x-trailer"); len(got) != 1 || got[0] != "from-a" {
		t.Fatalf("trailer %q not relayed (trailers %v)", got, tr)
	}
	// Many calls on one connection: HPACK's tables keep what they encode, so nothing the
	// gateway hands its HTTP/2 sides may be a view of a pooled exchange (x-request-id was).
	for i := range 600 {
		if _, err := c.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	md := a.calls()[0]
	if md.Get("x-tm-epoch")[0] != "1" || md.Get("x-tm-kind")[0] != "aggregate" || md.Get("x-tm-shard")[0] != "aggregate-1" ||
		len(md.Get("x-tm-subject")) != 0 || md.Get("x-tenant-id")[0] != "t1" || len(md.Get("x-request-id")) != 1 {
		t.Fatalf("the instance saw %v", md)
	}

	// The gateway's own answers are gRPC statuses.
	cases := []struct {
		name   string
		tenant string
		method string
		want   codes.Code
	}{
		{"no tenant", "", "/grpc.health.v1.Health/Check", codes.InvalidArgument},
		{"invalid tenant", "bad tenant!", "/grpc.health.v1.Health/Check", codes.InvalidArgument},
		{"no route", "t1", "/other.v1.Service/Call", codes.Unimplemented},
		{"no live instance", "t9", "/grpc.health.v1.Health/Check", codes.Unavailable},
	}
	e.place("aggregate", "t9", "aggregate-9")
	e.waitPhase("aggregate", "t9", schema.PhaseActive)
	cc, _ := grpc.NewClient("passthrough:///"+strings.TrimPrefix(e.url, "http://"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	defer cc.Close()
	for _, tc := range cases {
		ctx, cancel := tenantCtx("")
		if tc.tenant != "" {
			ctx = metadata.AppendToOutgoingContext(ctx, "x-tenant-id", tc.tenant)
		}
		var tr metadata.MD
		err := cc.Invoke(ctx, tc.method, &healthpb.HealthCheckRequest{}, &healthpb.HealthCheckResponse{}, grpc.Trailer(&tr))
		cancel()
		if status.Code(err) != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
		if tc.want == codes.Unavailable && len(tr.Get("grpc-retry-pushback-ms")) != 1 {
			t.Errorf("%s: no grpc-retry-pushback-ms in %v", tc.name, tr)
		}
	}

	// The calls by status, in the metrics (their HTTP status is 200 whatever the outcome).
	_, metrics := e.do("GET", "/metrics", "", "", nil)
	for _, want := range []string{`tm_gateway_grpc_calls_total{code="OK",kind="aggregate"} 601`,
		`tm_gateway_grpc_calls_total{code="INVALID_ARGUMENT",kind="-"} 2`, `tm_gateway_grpc_calls_total{code="UNAVAILABLE",kind="aggregate"} 1`} {
		if !strings.Contains(metrics, want) {
			t.Errorf("metrics lack %s", want)
		}
	}

	// HTTP/1.1 semantics over h2c: a plain request through the same listener.
	p := new(http.Protocols)
	p.SetUnencryptedHTTP2(true)
	hc := &http.Client{Transport: &http.Transport{Protocols: p}, Timeout: 10 * time.Second}
	defer hc.CloseIdleConnections()
	req, _ := http.NewRequest("GET", e.url+"/readyz", nil)
	r, err := hc.Do(req)
	if err != nil || r.StatusCode != 200 || r.ProtoMajor != 2 {
		t.Fatalf("GET /readyz over h2c: %v %v", r, err)
	}
	r.Body.Close()
}

func TestGRPCRefusalGoesToTheOwner(t *testing.T) {
	e, bs := grpcEnv(t, Config{}, schema.KindConfig{Kind: "aggregate"}, 2, "t1")
	a, b := bs[0], bs[1]
	// aggregate-1's gate refuses: the tenant is aggregate-2's at epoch 2 (the gateway has not
	// seen the move yet).
	a.mu.Lock()
	a.refuse = func(w http.ResponseWriter, r *http.Request) bool {
		w.Header()[tmhttp.HeaderRefused] = []string{"not_owner"}
		tmhttp.WriteProblem(w, r, tmhttp.Problem{Status: http.StatusMisdirectedRequest, Title: "Not the owner", Owner: "aggregate-2", Epoch: 2})
		return true
	}
	a.mu.Unlock()
	c := e.grpcClient()
	ctx, cancel := tenantCtx("t1")
	defer cancel()
	var hdr metadata.MD
	if _, err := c.Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Header(&hdr)); err != nil {
		t.Fatal(err)
	}
	if got := hdr.Get("x-served-by"); got[0] != b.id.Key() || len(hdr.Get("x-tm-refused")) != 0 {
		t.Fatalf("served by %q, headers %v", got, hdr)
	}
	if md := b.calls(); len(md) != 1 || md[0].Get("x-tm-epoch")[0] != "2" {
		t.Fatalf("the owner saw %v", md)
	}
}

// A gate refusal the gateway gives up on (here its retry budget is none) is judged as an HTTP
// request's is (judgeAttempt): the owner unknown for a shard that is not the owner, else the
// shard's refusal, UNAVAILABLE with the pushback the shard asked for.
func TestGRPCRefusalGivenUp(t *testing.T) {
	e, bs := grpcEnv(t, Config{Retries: -1}, schema.KindConfig{Kind: "aggregate"}, 1, "t1")
	a := bs[0]
	c := e.grpcClient()
	for _, tc := range []struct {
		reason, msg, pushback string
		prob                  tmhttp.Problem
	}{
		{"handoff", "Shard refused the call", "3000", tmhttp.Problem{Status: http.StatusServiceUnavailable, Title: "Tenant in handoff", RetryAfter: 3}},
		{"not_owner", "Tenant owner unknown", "1000", tmhttp.Problem{Status: http.StatusMisdirectedRequest, Title: "Not the owner"}},
	} {
		a.mu.Lock()
		a.refuse = func(w http.ResponseWriter, r *http.Request) bool {
			w.Header()[tmhttp.HeaderRefused] = []string{tc.reason}
			tmhttp.WriteProblem(w, r, tc.prob)
			return true
		}
		a.mu.Unlock()
		ctx, cancel := tenantCtx("t1")
		var tr metadata.MD
		_, err := c.Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Trailer(&tr))
		cancel()
		if status.Code(err) != codes.Unavailable || !strings.Contains(status.Convert(err).Message(), tc.msg) {
			t.Errorf("%s: %v, want UNAVAILABLE %q", tc.reason, err, tc.msg)
		}
		if got := tr.Get(tmhttp.HeaderPushback); len(got) != 1 || got[0] != tc.pushback {
			t.Errorf("%s: pushback %q, want %s", tc.reason, got, tc.pushback)
		}
	}
}

func TestGRPCHoldAndStream(t *testing.T) {
	e, bs := grpcEnv(t, Config{}, schema.KindConfig{Kind: "aggregate", HoldBudget: schema.Duration(20 * time.Second)}, 2, "t1")
	a, b := bs[0], bs[1]
	c := e.grpcClient()
	ctx, cancel := tenantCtx("t1")
	defer cancel()
	// A server stream relays each message as it comes; the instance ends it UNAVAILABLE when
	// the tenant moves (shardkit.Leaving), and the client calls again.
	st, err := c.Watch(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	recvN(t, st, 3, "the stream")
	e.move("aggregate", "t1", func(p *schema.Placement) { p.Phase, p.Target = schema.PhaseWarming, "aggregate-2" })
	e.move("aggregate", "t1", func(p *schema.Placement) { p.Phase = schema.PhaseHandoff })
	e.waitPhase("aggregate", "t1", schema.PhaseHandoff)
	close(a.stream)
	if _, err := st.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("the stream ended with %v, want UNAVAILABLE", err)
	}
	// Calls during the handoff are held, then go to the new owner.
	done := make(chan error, 2)
	go func() {
		_, err := c.Check(ctx, &healthpb.HealthCheckRequest{})
		done <- err
	}()
	var got int
	go func() {
		st, err := c.Watch(ctx, &healthpb.HealthCheckRequest{})
		if err == nil {
			for ; got < 3; got++ {
				if _, err = st.Recv(); err != nil {
					break
				}
			}
		}
		done <- err
	}()
	eventually(t, 10*time.Second, "two calls held", func() bool {
		n, _, _ := e.gw.holds.stats()
		return n == 2
	})
	e.move("aggregate", "t1", func(p *schema.Placement) {
		p.Phase, p.Shard, p.Source, p.Target, p.Epoch = schema.PhaseDraining, "aggregate-2", "aggregate-1", "", p.Epoch+1
	})
	for range 2 {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	if got != 3 || len(b.calls()) != 1 {
		t.Fatalf("the resumed stream got %d messages; the new owner saw %d unary calls", got, len(b.calls()))
	}
}

func TestGRPCTimeoutAndTakeover(t *testing.T) {
	e, bs := grpcEnv(t, Config{}, schema.KindConfig{Kind: "aggregate", HoldBudget: schema.Duration(20 * time.Second), Idempotent: true,
		UpstreamTimeout: schema.Duration(time.Minute)}, 2, "t1", "t2")
	a, b := bs[0], bs[1]
	block := make(chan struct{})
	defer close(block)
	a.mu.Lock()
	a.block = block
	a.mu.Unlock()
	c := e.grpcClient()

	// grpc-timeout bounds the call.
	ctx, cancel := tenantCtx("t1")
	tctx, tcancel := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err := c.Check(tctx, &healthpb.HealthCheckRequest{})
	tcancel()
	cancel()
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("blocked call with a deadline: %v", err)
	}

	// A takeover abandons the calls under way at the former owner: one with an idempotency
	// key (to an idempotent kind) goes to the new owner, one without fails UNKNOWN (its
	// outcome is unknown).
	keyed, plain := make(chan error, 1), make(chan error, 1)
	go func() {
		ctx, cancel := tenantCtx("t1", "idempotency-key", "k1")
		defer cancel()
		_, err := c.Check(ctx, &healthpb.HealthCheckRequest{})
		keyed <- err
	}()
	go func() {
		ctx, cancel := tenantCtx("t2")
		defer cancel()
		_, err := c.Check(ctx, &healthpb.HealthCheckRequest{})
		plain <- err
	}()
	eventually(t, 10*time.Second, "both calls at the frozen instance", func() bool { return len(a.calls()) >= 3 })
	for _, tenant := range []string{"t1", "t2"} {
		e.move("aggregate", tenant, func(p *schema.Placement) { p.Phase, p.Target = schema.PhaseTakeover, "aggregate-2" })
	}
	select {
	case err := <-plain:
		if status.Code(err) != codes.Unknown {
			t.Fatalf("abandoned call without a key: %v, want UNKNOWN", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the call was not abandoned at its tenant's takeover")
	}
	e.move("aggregate", "t1", func(p *schema.Placement) {
		p.Phase, p.Shard, p.Target, p.Epoch = schema.PhaseActive, "aggregate-2", "", p.Epoch+1
	})
	select {
	case err := <-keyed:
		if err != nil {
			t.Fatalf("abandoned keyed call: %v, want it answered by the new owner", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the keyed call was not sent to the new owner after the commit")
	}
	if len(b.calls()) != 1 {
		t.Fatalf("the new owner saw %d calls", len(b.calls()))
	}
}

// Edge identity over gRPC: the bearer token in the authorization metadata; a missing or bad one
// is UNAUTHENTICATED, another tenant's PERMISSION_DENIED, and the verified subject reaches the
// instance in x-tm-subject (the token itself does not).
func TestGRPCEdgeAuth(t *testing.T) {
	v, sign := testVerifier(t)
	token := func(tenant string) string { return sign(jwt.MapClaims{"sub": "user-7", "tenant_id": tenant}) }
	e, bs := grpcEnv(t, Config{Auth: v}, schema.KindConfig{Kind: "aggregate"}, 1, "t1")
	a := bs[0]
	c := e.grpcClient()
	for _, tc := range []struct {
		name string
		md   []string
		want codes.Code
	}{
		{"no token", []string{"x-tenant-id", "t1"}, codes.Unauthenticated},
		{"bad token", []string{"authorization", "Bearer nonsense"}, codes.Unauthenticated},
		{"another tenant's token", []string{"x-tenant-id", "t1", "authorization", "Bearer " + token("t2")}, codes.PermissionDenied},
		{"the tenant's token", []string{"authorization", "Bearer " + token("t1")}, codes.OK},
	} {
		ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), tc.md...), 10*time.Second)
		_, err := c.Check(ctx, &healthpb.HealthCheckRequest{})
		cancel()
		if status.Code(err) != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
	calls := a.calls()
	if len(calls) != 1 || strings.Join(calls[0].Get("x-tm-subject"), "") != "user-7" || len(calls[0].Get("authorization")) != 0 ||
		strings.Join(calls[0].Get("x-tenant-id"), "") != "t1" {
		t.Fatalf("the instance saw %v", calls)
	}
}

// The gateway's proof goes with gRPC calls: a shard with its kind's key (shardkit's gate in
// front of a grpc.Server, as shardmain serves it) admits a call through the gateway and refuses
// the same call made straight to it (PERMISSION_DENIED).
func TestGRPCProof(t *testing.T) {
	master := gatesig.NewKey()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	shardURL := "http://" + ln.Addr().String()
	b := &grpcBackend{id: schema.InstanceID{Kind: "aggregate", Shard: "aggregate-1", Instance: "i1"}, stream: make(chan struct{})}
	e := newEnv(t, Config{ShardKey: master}, []schema.KindConfig{{Kind: "aggregate"}}, func(e *env) {
		e.place("aggregate", "t1", "aggregate-1")
		sk := kittest.Shard(t, shardkit.Config{Store: e.st, URL: shardURL, Capacity: 10, ID: b.id,
			Routes: []schema.Route{grpcRoute}, GatewayKey: gatesig.KindKey(master, "aggregate")})
		gs := grpc.NewServer()
		healthpb.RegisterHealthServer(gs, healthServer{b: b})
		srv := &http.Server{Handler: sk.Gate(gs), Protocols: serverProtocols(), ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = srv.Serve(ln) }()
		t.Cleanup(func() { _ = srv.Close(); gs.Stop() })
	})
	c := e.grpcClient()
	ctx, cancel := tenantCtx("t1")
	defer cancel()
	eventually(t, 10*time.Second, "the shard routed", func() bool {
		_, err := c.Check(ctx, &healthpb.HealthCheckRequest{})
		return err == nil
	})
	cc, err := grpc.NewClient("passthrough:///"+strings.TrimPrefix(shardURL, "http://"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	dctx := metadata.AppendToOutgoingContext(ctx, "x-tm-epoch", "1", "x-tm-shard", "aggregate-1", "x-tm-kind", "aggregate")
	if _, err := healthpb.NewHealthClient(cc).Check(dctx, &healthpb.HealthCheckRequest{}); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("a direct call without the gateway's proof: %v, want PERMISSION_DENIED", err)
	}
}
