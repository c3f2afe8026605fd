package shardmain_test

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/natsconn"
	"github.com/tenantmesh/tenantmesh/shardkit/natsperm"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/shardmain"
	"github.com/tenantmesh/tenantmesh/shardkit/tmgrpc"
)

// grpcEcho serves grpc.health.v1.Health as a shard's gRPC service: Check answers for the
// tenant the gate admitted (its name in the trailer), Watch streams until the tenant leaves.
type grpcEcho struct {
	echo
	healthpb.UnimplementedHealthServer
	sk chan *shardkit.Shard
}

func (g *grpcEcho) Handler(sk *shardkit.Shard) http.Handler {
	g.sk <- sk
	return g.echo.Handler(sk)
}

func (g *grpcEcho) RegisterGRPC(s grpc.ServiceRegistrar) { healthpb.RegisterHealthServer(s, g) }

func (g *grpcEcho) Check(ctx context.Context, _ *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	_ = grpc.SetTrailer(ctx, metadata.Pairs("tenant", tmgrpc.Tenant(ctx)))
	return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
}

func (g *grpcEcho) Watch(_ *healthpb.HealthCheckRequest, s grpc.ServerStreamingServer[healthpb.HealthCheckResponse]) error {
	if err := s.Send(&healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}); err != nil {
		return err
	}
	select {
	case <-shardkit.Leaving(s.Context()):
		return tmgrpc.Moved()
	case <-s.Context().Done():
		return s.Context().Err()
	}
}

// TestRunGRPC: a shard serves an App's gRPC services on its HTTP port (h2c), publishes a route
// per service, admits the tenants it owns (tenant from the x-tenant-id metadata), answers the
// gate's refusals as gRPC statuses naming the owner, and ends a server stream when its tenant
// drains.
func TestRunGRPC(t *testing.T) {
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
		LogLevel: "error", LogFormat: "json", Stderr: io.Discard, Heartbeat: 100 * time.Millisecond, DrainTimeout: 5 * time.Second}
	app := &grpcEcho{echo: echo{ran: make(chan struct{})}, sk: make(chan *shardkit.Shard, 1)}
	ready := m.Listening()
	rctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- m.Run(rctx, func(context.Context, shardmain.Env) (shardmain.App, error) { return app, nil })
	}()
	defer func() { stop(); <-done }()
	var url string
	select {
	case url = <-ready:
	case err := <-done:
		t.Fatalf("stopped before serving: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("not serving within 20s")
	}
	sk := <-app.sk
	routes, err := st.Routes().List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, r := range routes {
		found = found || r.Prefix == "/grpc.health.v1.Health" && r.Method == "POST" && r.Kind == "echo"
	}
	if !found {
		t.Errorf("no route for the gRPC service in %+v", routes)
	}

	cc, err := grpc.NewClient("passthrough:///"+strings.TrimPrefix(url, "http://"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	c := healthpb.NewHealthClient(cc)
	call := func(tenant string) (metadata.MD, metadata.MD, error) {
		ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "x-tenant-id", tenant), 10*time.Second)
		defer cancel()
		var hdr, tr metadata.MD
		_, err := c.Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Header(&hdr), grpc.Trailer(&tr))
		return hdr, tr, err
	}
	if hdr, tr, err := call("acme"); err != nil || tr.Get("tenant")[0] != "acme" || hdr.Get("x-served-by")[0] != "echo.echo-1.a" {
		t.Fatalf("acme: %v, headers %v, trailers %v", err, hdr, tr)
	}
	// A trailers-only answer: grpc-go gives its metadata as the trailer.
	_, tr, err := call("globex")
	if status.Code(err) != codes.Unavailable || strings.Join(tr.Get("x-tm-owner"), ",") != "echo-2" || strings.Join(tr.Get("x-tm-refused"), ",") != "not_owner" {
		t.Fatalf("globex (echo-2's): %v, metadata %v", err, tr)
	}
	if _, _, err := call("bad tenant"); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("invalid tenant: %v", err)
	}

	// A server stream ends UNAVAILABLE when its tenant drains here.
	sctx, scancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "x-tenant-id", "acme"), 10*time.Second)
	defer scancel()
	ws, err := c.Watch(sctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ws.Recv(); err != nil {
		t.Fatal(err)
	}
	drained := make(chan error, 1)
	go func() { _, err := sk.Drain(ctx, "acme"); drained <- err }()
	if _, err := ws.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("stream at the drain: %v, want UNAVAILABLE", err)
	}
	if err := <-drained; err != nil {
		t.Fatalf("drain: %v", err)
	}
}
