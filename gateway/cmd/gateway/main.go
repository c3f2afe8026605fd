// Command gateway is tenantmesh's data plane: it routes every tenant request to the shard that
// owns the tenant (see package gateway). Flags have TM_* environment variables.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/tenantmesh/tenantmesh/gateway"
	"github.com/tenantmesh/tenantmesh/internal/envflag"
	"github.com/tenantmesh/tenantmesh/internal/natsconn"
	"github.com/tenantmesh/tenantmesh/internal/tmlog"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "gateway:", err)
		os.Exit(1)
	}
}

func run() error {
	fs := flag.NewFlagSet("gateway", flag.ExitOnError)
	var (
		nats                                      natsconn.Options
		addr, id, logLevel, logFormat             string
		retries, maxHeader, idlePerHost, replicas int
		pprof, stdTransport, lean                 bool
		maxBody, replayBody                       int
		readHeader, shutdown, connect             time.Duration
	)
	nats.AddFlags(fs)
	envflag.String(fs, &addr, "addr", ":8080", "listen address")
	envflag.String(fs, &id, "gateway-id", "", "gateway id in audit events (default hostname-pid)")
	envflag.String(fs, &logLevel, "log-level", "info", "log level: debug, info, warn, error")
	envflag.String(fs, &logFormat, "log-format", "auto", "log format: auto, text, json")
	envflag.Int(fs, &replicas, "replicas", 1, "replicas for buckets and streams this process creates (3 in a cluster)")
	envflag.Int(fs, &retries, "retries", 2, "further attempts after a 421 or an unreachable instance (0: none)")
	envflag.Int(fs, &maxHeader, "max-header-bytes", 64<<10, "largest request header block")
	envflag.Int(fs, &maxBody, "max-body-bytes", 32<<20, "largest request body (-1: unbounded)")
	envflag.Int(fs, &replayBody, "max-replay-body", 1<<20, "largest body buffered for retries and holds")
	envflag.Int(fs, &idlePerHost, "max-idle-conns-per-host", 256, "idle upstream connections kept per instance")
	envflag.Duration(fs, &readHeader, "read-header-timeout", 5*time.Second, "time allowed to read request headers")
	envflag.Duration(fs, &shutdown, "shutdown-timeout", 30*time.Second, "time allowed for in-flight requests at shutdown")
	envflag.Duration(fs, &connect, "connect-timeout", time.Second, "time allowed to connect to an instance")
	envflag.Bool(fs, &stdTransport, "std-transport", false, "send to instances with net/http.Transport instead of the synchronous HTTP/1.1 client")
	envflag.Bool(fs, &lean, "lean-proxy", false, "experimental: proxy plain HTTP/1.1 exchanges without httputil.ReverseProxy")
	envflag.Bool(fs, &pprof, "pprof", false, "serve /debug/pprof/ to requests without x-tenant-id")
	if err := envflag.Check(fs); err != nil {
		return err
	}
	_ = fs.Parse(os.Args[1:])
	if retries <= 0 {
		retries = -1 // Config's zero means the default
	}
	log, err := tmlog.New(os.Stderr, logLevel, logFormat)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	nc, err := natsconn.Connect(nats, "tm-gateway", log)
	if err != nil {
		return err
	}
	defer nc.Close()
	store, err := schema.OpenRetry(ctx, nc, schema.Options{Replicas: replicas, Logger: log, Attach: true})
	if err != nil {
		return err
	}
	g, err := gateway.New(gateway.Config{
		Store: store, ID: id, Addr: addr, Logger: log, Retries: retries,
		MaxHeaderBytes: maxHeader, MaxBodyBytes: int64(maxBody), MaxReplayBody: int64(replayBody),
		MaxIdleConnsPerHost: idlePerHost, ReadHeaderTimeout: readHeader, ShutdownTimeout: shutdown,
		ConnectTimeout: connect, Pprof: pprof, StdTransport: stdTransport, Lean: lean,
	})
	if err != nil {
		return err
	}
	return g.Run(ctx)
}
