// Command render runs one instance of the render service: a cache-warm renderer (POST /render)
// with a page pool of --capacity tenants and LRU disposal, placed by the gateway's affinity
// policy. Run each instance as its own shard (--shard render-a --instance a).
package main

import (
	"context"

	"github.com/tenantmesh/tenantmesh/services/internal/svcmain"
	"github.com/tenantmesh/tenantmesh/services/render"
)

func main() {
	svcmain.Exit(render.Kind, func(m *svcmain.Main) (svcmain.Builder, error) {
		return func(ctx context.Context, env svcmain.Env) (svcmain.App, error) {
			if _, err := env.Store.EnsureKind(ctx, render.KindConfig()); err != nil {
				return nil, err
			}
			return render.New(render.Config{Capacity: m.Capacity, Logger: env.Logger}), nil
		}, nil
	})
}
