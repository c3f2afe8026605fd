package test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	aggregatev1 "github.com/tenantmesh/tenantmesh/proto/aggregate/gateway/v1"
	projectionv1 "github.com/tenantmesh/tenantmesh/proto/projection/v1"
)

// grpcLoad is one gRPC client of the gateways beside the HTTP load: a tenant's deposits
// through aggregate.gateway.v1.CommandService/SubmitCommand (each with its idempotency key,
// also in the idempotency-key metadata, so the gateway may resend it), and a server stream,
// projection.v1.QueryService/Watch, kept open and called again whenever it ends UNAVAILABLE
// (the tenant moved, or under chaos its instance or gateway died).
type grpcLoad struct {
	tenant string
	conns  []*grpc.ClientConn // one per gateway
	// chaos: UNAVAILABLE (with the same key, on the next gateway) is retried for up to 45 s,
	// as the HTTP chaos client retries a 503 with Retry-After and a dead gateway; without it
	// every failed call is a failure.
	chaos bool
	// deposit records an acknowledged deposit.
	deposit func(tenant string, amount int64)

	mu       sync.Mutex
	failures []string
	calls    atomic.Int64
	retried  atomic.Int64
	messages atomic.Int64 // stream messages received
	resumed  atomic.Int64 // streams called again after ending UNAVAILABLE
}

func newGRPCLoad(tenant string, gateways []string, chaos bool, deposit func(string, int64)) (*grpcLoad, error) {
	g := &grpcLoad{tenant: tenant, chaos: chaos, deposit: deposit}
	for _, gw := range gateways {
		cc, err := grpc.NewClient("passthrough:///"+strings.TrimPrefix(gw, "http://"), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return nil, err
		}
		g.conns = append(g.conns, cc)
	}
	return g, nil
}

func (g *grpcLoad) close() {
	for _, cc := range g.conns {
		cc.Close()
	}
}

func (g *grpcLoad) fail(s string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.failures = append(g.failures, time.Now().Format("15:04:05.000 ")+s)
}

func (g *grpcLoad) failed() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]string(nil), g.failures...)
}

// run sends deposits and keeps the stream open until stop is closed.
func (g *grpcLoad) run(stop <-chan struct{}) {
	var wg sync.WaitGroup
	wg.Go(func() { g.watch(stop) })
	defer wg.Wait()
	gw := 0
	g.submit(&gw, "open", 0, "grpc-open")
	pause := thinkTime()
	for i := 0; ; i++ {
		select {
		case <-stop:
			return
		default:
		}
		if i > 0 && !think(pause, stop) {
			return
		}
		amount := int64(i%5 + 1)
		if g.submit(&gw, "deposit", amount, fmt.Sprintf("grpc-dep-%d", i)) {
			g.deposit(g.tenant, amount)
		}
	}
}

// submit sends one command, retrying as allowed; it reports whether it was acknowledged.
func (g *grpcLoad) submit(gw *int, command string, amount int64, key string) bool {
	g.calls.Add(1)
	req := &aggregatev1.SubmitCommandRequest{AggregateType: "account", AggregateId: "grpc", Command: command, IdempotencyKey: key}
	if amount > 0 {
		req.PayloadJson = fmt.Sprintf(`{"amount":%d}`, amount)
	}
	deadline := time.Now().Add(45 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(),
			"x-tenant-id", g.tenant, "idempotency-key", key), 20*time.Second)
		var tr metadata.MD
		_, err := aggregatev1.NewCommandServiceClient(g.conns[*gw%len(g.conns)]).SubmitCommand(ctx, req, grpc.Trailer(&tr))
		cancel()
		switch {
		case err == nil:
			return true
		case command == "open" && status.Code(err) == codes.Aborted: // opened before (a resent open)
			return true
		case g.chaos && status.Code(err) == codes.Unavailable && time.Now().Before(deadline):
			g.retried.Add(1)
			if len(tr.Get("grpc-retry-pushback-ms")) == 0 {
				*gw++ // no pushback: the gateway itself went away; the next one
			}
			time.Sleep(50 * time.Millisecond) // a backoff, as the pushback asks
			continue
		}
		g.fail(fmt.Sprintf("%s SubmitCommand %s %s: %v", g.tenant, command, key, err))
		return false
	}
}

// watch keeps a Watch stream of the tenant's accounts view open, calling it again when it ends
// UNAVAILABLE; any other end is a failure.
func (g *grpcLoad) watch(stop <-chan struct{}) {
	ctx, cancel := context.WithCancel(metadata.AppendToOutgoingContext(context.Background(), "x-tenant-id", g.tenant))
	defer cancel()
	go func() {
		<-stop
		cancel()
	}()
	gw := 0
	for first := true; ctx.Err() == nil; first = false {
		if !first {
			g.resumed.Add(1)
		}
		st, err := projectionv1.NewQueryServiceClient(g.conns[gw%len(g.conns)]).Watch(ctx, &projectionv1.QueryRequest{View: "accounts", QueryJson: `{"limit":5}`})
		got := 0
		for err == nil {
			if _, err = st.Recv(); err == nil {
				g.messages.Add(1)
				got++
			}
		}
		if got == 0 && ctx.Err() == nil {
			time.Sleep(50 * time.Millisecond) // ended before its first message: back off a little
		}
		switch {
		case ctx.Err() != nil:
			return
		case status.Code(err) == codes.Unavailable:
			if g.chaos {
				gw++
				time.Sleep(50 * time.Millisecond)
			}
			continue
		case errors.Is(err, context.Canceled):
			return
		}
		g.fail(fmt.Sprintf("%s Watch: %v", g.tenant, err))
		return
	}
}
