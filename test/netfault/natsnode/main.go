// Command natsnode runs one embedded nats-server cluster member as a process of its own, for
// the fault harness (test/netfault): each NATS node lives in its own network namespace there,
// so a partition can cut it from its peers or its clients. It trusts the chain kept in --auth
// (natsauth, as the dev stack's server does), prints "ready" on stdout once it accepts
// connections, and stops on SIGTERM or SIGINT.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
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
	flag.StringVar(&cfg.Name, "name", "", "server name (stable across restarts)")
	flag.StringVar(&cfg.Host, "host", "127.0.0.1", "address to listen on (clients and routes)")
	flag.IntVar(&cfg.Port, "port", 4222, "client port")
	flag.StringVar(&cfg.ClusterName, "cluster", "netfault", "cluster name")
	flag.IntVar(&cfg.ClusterPort, "cluster-port", 6222, "route port")
	flag.StringVar(&routes, "routes", "", "the other members' route URLs, comma-separated")
	flag.StringVar(&cfg.StoreDir, "store", "", "JetStream store directory")
	flag.StringVar(&auth, "auth", "", "directory of the natsauth trust chain (unset: no authentication)")
	flag.Parse()
	for _, r := range strings.Split(routes, ",") {
		if r = strings.TrimSpace(r); r != "" {
			cfg.Routes = append(cfg.Routes, r)
		}
	}
	if err := run(ctx, cfg, auth); err != nil {
		fmt.Fprintln(os.Stderr, "natsnode:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, cfg embednats.Config, auth string) error {
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
	fmt.Println("ready")
	<-ctx.Done()
	srv.Stop()
	return nil
}
