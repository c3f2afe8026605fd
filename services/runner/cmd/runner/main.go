// Command runner runs one instance of a runner shard: per-tenant job queues (POST /jobs,
// GET /jobs/{id}, GET /jobs?status=), effects through an outbox, and sagas, on JetStream.
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
	"github.com/tenantmesh/tenantmesh/services/runner"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var m svcmain.Main
	if err := m.ParseFlags("runner", os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "runner:", err)
		os.Exit(2)
	}
	err := m.Run(ctx, func(ctx context.Context, env svcmain.Env) (svcmain.App, error) {
		return runner.New(ctx, runner.Config{Store: env.Store, ID: env.ID, Logger: env.Logger, Registerer: env.Registerer})
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "runner:", err)
		os.Exit(1)
	}
}
