package shardkit_test

import (
	"context"
	"net/http"
	"os/signal"
	"syscall"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// A shard service wires shardkit in a few lines: hooks, the gate on its tenant routes, the
// admin routes on the same router, and Run until SIGTERM.
func Example() {
	var st *schema.Store // schema.Open(ctx, nc, schema.Options{})
	sk, err := shardkit.New(shardkit.Config{
		Store:  st,
		ID:     schema.InstanceID{Kind: "aggregate", Shard: "aggregate-1", Instance: "host-a"},
		URL:    "http://10.0.0.5:8081",
		Routes: []schema.Route{{Method: "POST", Prefix: "/commands"}, {Method: "GET", Prefix: "/aggregates"}},
		Hooks: shardkit.Hooks{
			Warm:    func(ctx context.Context, tenant string, fence uint64) error { return nil }, // load snapshot, replay to fence
			Applied: func(tenant string) uint64 { return 0 },                                     // last applied event sequence
			Release: func(ctx context.Context, tenant string) error { return nil },               // drop cached state
		},
		ShutdownGrace: 2 * time.Second,
	})
	if err != nil {
		return
	}
	r := chi.NewRouter()
	sk.Mount(r) // /admin/*, /healthz, /readyz, /metrics: outside the gate
	r.Group(func(r chi.Router) {
		r.Use(sk.Gate)
		r.Post("/commands/{id}", func(w http.ResponseWriter, r *http.Request) {
			_ = shardkit.Tenant(r) // owned by this shard at the request's epoch
		})
	})
	srv := &http.Server{Addr: ":8081", Handler: r, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.ListenAndServe() }()

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	_ = sk.Run(ctx) // after SIGTERM: not ready, drain, unregister; then stop the server
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = srv.Shutdown(sctx)
}
