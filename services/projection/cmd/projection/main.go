// Command projection runs one instance of a projection shard: per-tenant views built from the
// ledger events in TM_EVENTS, queried with POST /query/{view_type}.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/tenantmesh/tenantmesh/services/internal/svcmain"
	"github.com/tenantmesh/tenantmesh/services/projection"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var m svcmain.Main
	if err := m.ParseFlags(projection.Kind, os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "projection:", err)
		os.Exit(2)
	}
	err := m.Run(ctx, func(ctx context.Context, env svcmain.Env) (svcmain.App, error) {
		return projection.New(ctx, projection.Config{Store: env.Store, Shard: env.ID.Shard, Logger: env.Logger, Registerer: env.Registerer})
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "projection:", err)
		os.Exit(1)
	}
}
