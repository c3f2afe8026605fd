// Command benchenv prepares the gateway benchmark: it runs an embedded nats-server, registers
// the benchmark backends as instances of one shard each (kind "aggregate"), routes "/" to them,
// places the tenants round-robin over the shards, writes the same tenant map for HAProxy and
// nginx plus the tenant list for wrk, prints READY, and heartbeats the instances until stopped.
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats"
	"github.com/tenantmesh/tenantmesh/internal/natsauth"
	"github.com/tenantmesh/tenantmesh/shardkit/natsconn"
	"github.com/tenantmesh/tenantmesh/shardkit/natsperm"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

func main() {
	var (
		backends = flag.String("backends", "127.0.0.1:9101,127.0.0.1:9102,127.0.0.1:9103,127.0.0.1:9104", "backend addresses")
		tenants  = flag.Int("tenants", 10000, "tenants to place")
		port     = flag.Int("nats-port", 4333, "NATS client port")
		dir      = flag.String("dir", ".", "where to write haproxy.map, nginx.map, tenants.txt and the NATS store")
		grpcBe   = flag.String("grpc-backends", "", "gRPC backend addresses (h2c), one more instance of each shard, on the route POST /bench.v1.Bench (gateway/bench/grpc.sh)")
	)
	flag.Parse()
	var gb []string
	if *grpcBe != "" {
		gb = strings.Split(*grpcBe, ",")
	}
	if err := run(strings.Split(*backends, ","), gb, *tenants, *port, *dir); err != nil {
		log.Fatal(err)
	}
}

func run(backends, grpcBackends []string, tenants, port int, dir string) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// Secured as a deployment is: the gateways under test connect with dir/creds/gateway.creds.
	chain, err := natsauth.LoadOrCreate(filepath.Join(dir, "auth"))
	if err != nil {
		return err
	}
	if _, err := natsperm.AddScopes(chain, natsperm.Scopes()); err != nil {
		return err
	}
	admin, err := chain.WriteCreds(filepath.Join(dir, "creds"), natsperm.Rebalancer())
	if err != nil {
		return err
	}
	if _, err := chain.WriteCreds(filepath.Join(dir, "creds"), natsperm.DefaultGateway()); err != nil {
		return err
	}
	srv, err := embednats.Start(embednats.Config{Port: port, StoreDir: filepath.Join(dir, "nats"), Auth: chain})
	if err != nil {
		return err
	}
	defer srv.Stop()
	nc, err := natsconn.Connect(natsconn.Options{URL: srv.URL(), Creds: admin}, "benchenv", nil)
	if err != nil {
		return err
	}
	defer nc.Close()
	octx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	st, err := schema.Open(octx, nc, schema.Options{})
	if err != nil {
		return err
	}
	var insts []schema.Instance
	route := schema.Route{Method: "*", Prefix: "/", Kind: "aggregate"}
	for i, b := range backends {
		in := schema.Instance{InstanceID: schema.InstanceID{Kind: "aggregate", Shard: fmt.Sprintf("aggregate-%d", i+1), Instance: "i1"},
			URL: "http://" + b, Capacity: tenants}
		if in, err = st.Directory().Register(octx, in); err != nil {
			return err
		}
		insts = append(insts, in)
		if _, err := st.Routes().AddInstance(octx, route, in.InstanceID); err != nil {
			return err
		}
	}
	grpcRoute := schema.Route{Method: "POST", Prefix: "/bench.v1.Bench", Kind: "aggregate"}
	for i, b := range grpcBackends {
		in := schema.Instance{InstanceID: schema.InstanceID{Kind: "aggregate", Shard: fmt.Sprintf("aggregate-%d", i+1), Instance: "g1"},
			URL: "http://" + b, Capacity: tenants}
		if in, err = st.Directory().Register(octx, in); err != nil {
			return err
		}
		insts = append(insts, in)
		if _, err := st.Routes().AddInstance(octx, grpcRoute, in.InstanceID); err != nil {
			return err
		}
	}
	files := map[string]*bufio.Writer{}
	for _, name := range []string{"haproxy.map", "nginx.map", "haproxy-epoch.map", "nginx-epoch.map", "tenants.txt"} {
		f, err := os.Create(filepath.Join(dir, name))
		if err != nil {
			return err
		}
		defer f.Close()
		w := bufio.NewWriter(f)
		defer w.Flush()
		files[name] = w
	}
	// Placements are written concurrently (bounded) to keep the setup short.
	sem := make(chan struct{}, 64)
	type placed struct {
		tenant string
		epoch  uint64
		err    error
	}
	epochs := make(chan placed, tenants)
	for i := range tenants {
		tenant := fmt.Sprintf("tenant-%05d", i)
		shard := i % len(backends)
		fmt.Fprintf(files["haproxy.map"], "%s aggregate-%d\n", tenant, shard+1)
		fmt.Fprintf(files["nginx.map"], "%s aggregate-%d;\n", tenant, shard+1)
		fmt.Fprintf(files["tenants.txt"], "%s\n", tenant)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem }()
			p, _, err := st.Placements("aggregate").Ensure(ctx, schema.Placement{Tenant: tenant, Shard: fmt.Sprintf("aggregate-%d", shard+1)})
			epochs <- placed{tenant, p.Epoch, err}
		}()
	}
	// The peers' epoch maps, in the order the placements were written (any order routes).
	for range tenants {
		pl := <-epochs
		if pl.err != nil {
			return pl.err
		}
		fmt.Fprintf(files["haproxy-epoch.map"], "%s %d\n", pl.tenant, pl.epoch)
		fmt.Fprintf(files["nginx-epoch.map"], "%s %d;\n", pl.tenant, pl.epoch)
	}
	for _, w := range files {
		if err := w.Flush(); err != nil {
			return err
		}
	}
	fmt.Println("READY", srv.URL())
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
			for _, in := range insts {
				hctx, hcancel := context.WithTimeout(ctx, 2*time.Second)
				_, _ = st.Directory().Heartbeat(hctx, in)
				hcancel()
			}
		case <-ctx.Done():
			return nil
		}
	}
}
