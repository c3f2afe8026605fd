// Command aggregate runs one instance of an aggregate shard: the tenant-scoped ledger command
// API (POST /commands, GET /aggregates/account/{id}, GET /ledger/totals) on JetStream.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/tenantmesh/tenantmesh/services/aggregate"
	"github.com/tenantmesh/tenantmesh/services/internal/svcmain"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var m svcmain.Main
	if err := m.ParseFlags("aggregate", os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "aggregate:", err)
		os.Exit(2)
	}
	err := m.Run(ctx, func(ctx context.Context, env svcmain.Env) (svcmain.App, error) {
		return aggregate.New(ctx, aggregate.Config{Store: env.Store, Logger: env.Logger, Registerer: env.Registerer})
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "aggregate:", err)
		os.Exit(1)
	}
}
