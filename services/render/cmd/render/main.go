// Command render runs one instance of the render service: a cache-warm renderer (POST /render)
// with a page pool of --capacity tenants and LRU disposal, placed by the gateway's affinity
// policy. Run each instance as its own shard (--shard render-a --instance a).
package main

import (
	"context"

	"github.com/tenantmesh/tenantmesh/services/render"
	"github.com/tenantmesh/tenantmesh/shardkit/shardmain"
)

func main() {
	shardmain.Exit(render.Kind, func(m *shardmain.Main) (shardmain.Builder, error) {
		return func(ctx context.Context, env shardmain.Env) (shardmain.App, error) {
			if _, err := env.Store.Kinds().Ensure(ctx, render.KindConfig()); err != nil {
				return nil, err
			}
			return render.New(render.Config{Capacity: m.Capacity, Logger: env.Logger}), nil
		}, nil
	})
}
