// Command rebalance plans, applies and rolls back tenant moves, shows the directory and the
// audit journal, and with `rebalance serve` runs the rebalancer service (docs/design.md's
// `rebalancer serve`). See `rebalance help`.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/tenantmesh/tenantmesh/rebalancer/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := (&cli.Main{}).Exit(ctx, os.Args[1:])
	stop()
	os.Exit(code)
}
