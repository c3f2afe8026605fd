// Command render runs one instance of the render service: a cache-warm renderer (POST /render)
// with a page pool of --capacity tenants and LRU disposal, placed by the gateway's affinity
// policy. Run each instance as its own shard (--shard render-a --instance a).
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
	"github.com/tenantmesh/tenantmesh/services/render"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var m svcmain.Main
	if err := m.ParseFlags(render.Kind, os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "render:", err)
		os.Exit(2)
	}
	err := m.Run(ctx, func(ctx context.Context, env svcmain.Env) (svcmain.App, error) {
		if _, err := env.Store.EnsureKind(ctx, render.KindConfig()); err != nil {
			return nil, err
		}
		return render.New(render.Config{Capacity: m.Capacity, Logger: env.Logger}), nil
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "render:", err)
		os.Exit(1)
	}
}
