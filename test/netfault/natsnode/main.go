// Command natsnode runs one embedded nats-server cluster member as a process of its own, for
// the fault harness (test/netfault): each NATS node lives in its own network namespace there,
// so a partition can cut it from its peers or its clients. It trusts the chain kept in --auth
// (natsauth, as the dev stack's server does), prints "ready" on stdout once it accepts
// connections, and stops on SIGTERM or SIGINT. With --http-port it serves nats-server's /connz
// (per-connection counters, of every account) on --host at that port, for the scale harness
// (test/scale), which reads them by connection name; the handler is nats-server's own, so the
// node needs no monitoring options (BuildAt builds this file against older embednats).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats"
	"github.com/tenantmesh/tenantmesh/internal/natsauth"
	"github.com/tenantmesh/tenantmesh/internal/tmlog"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var cfg embednats.Config
	var routes, auth string
	var httpPort int
	flag.StringVar(&cfg.Name, "name", "", "server name (stable across restarts)")
	flag.StringVar(&cfg.Host, "host", "127.0.0.1", "address to listen on (clients and routes)")
	flag.IntVar(&cfg.Port, "port", 4222, "client port")
	flag.StringVar(&cfg.ClusterName, "cluster", "netfault", "cluster name")
	flag.IntVar(&cfg.ClusterPort, "cluster-port", 6222, "route port")
	flag.StringVar(&routes, "routes", "", "the other members' route URLs, comma-separated")
	flag.StringVar(&cfg.StoreDir, "store", "", "JetStream store directory")
	flag.StringVar(&auth, "auth", "", "directory of the natsauth trust chain (unset: no authentication)")
	flag.IntVar(&httpPort, "http-port", 0, "serve nats-server's /connz on this port (0: none)")
	flag.Parse()
	for _, r := range strings.Split(routes, ",") {
		if r = strings.TrimSpace(r); r != "" {
			cfg.Routes = append(cfg.Routes, r)
		}
	}
	if err := run(ctx, cfg, auth, httpPort); err != nil {
		fmt.Fprintln(os.Stderr, "natsnode:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, cfg embednats.Config, auth string, httpPort int) error {
	log, err := tmlog.New(os.Stderr, "warn", "text")
	if err != nil {
		return err
	}
	if auth != "" {
		if cfg.Auth, err = natsauth.LoadOrCreate(auth); err != nil {
			return err
		}
	}
	cfg.Logger = log.With("node", cfg.Name)
	cfg.ReadyTimeout = 30 * time.Second
	srv, err := embednats.Start(cfg)
	if err != nil {
		return err
	}
	defer srv.Stop()
	if httpPort != 0 {
		stop, err := serveConnz(srv, net.JoinHostPort(cfg.Host, strconv.Itoa(httpPort)))
		if err != nil {
			return err
		}
		defer stop()
	}
	fmt.Println("ready")
	<-ctx.Done()
	return nil
}

// serveConnz serves srv's /connz at addr until stop.
func serveConnz(srv *embednats.Server, addr string) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--http-port: %w", err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /connz", srv.HandleConnz)
	hs := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := hs.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			fmt.Fprintln(os.Stderr, "natsnode: /connz:", err)
		}
	}()
	return func() { _ = hs.Close(); <-done }, nil
}
