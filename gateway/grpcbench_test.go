package gateway

import (
	"testing"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// BenchmarkGRPCUnary: unary calls through the gateway's HTTP/2 engine to a grpc-go instance,
// 32 at once (client, gateway and instance in one process: allocs/op is the comparable part).
func BenchmarkGRPCUnary(b *testing.B) {
	var gb *grpcBackend
	e := newEnv(b, Config{}, []schema.KindConfig{{Kind: "aggregate"}}, func(e *env) {
		gb = newGRPCBackend(b, "aggregate", "aggregate-1", "a")
		e.registerGRPC(gb, grpcRoute)
		e.place("aggregate", "t1", "aggregate-1")
	})
	c := e.grpcClient()
	ctx, cancel := tenantCtx("t1")
	defer cancel()
	if _, err := c.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.SetParallelism(16)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := c.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
				b.Error(err)
				return
			}
		}
	})
}
