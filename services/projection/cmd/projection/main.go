// Command projection runs one instance of a projection shard: per-tenant views built from the
// ledger events in TM_EVENTS, queried with POST /query/{view_type}.
package main

import (
	"context"

	"github.com/tenantmesh/tenantmesh/services/projection"
	"github.com/tenantmesh/tenantmesh/shardkit/shardmain"
)

func main() {
	shardmain.Exit(projection.Kind, func(*shardmain.Main) (shardmain.Builder, error) {
		return func(ctx context.Context, env shardmain.Env) (shardmain.App, error) {
			return projection.New(ctx, projection.Config{Store: env.Store, Shard: env.ID.Shard, Logger: env.Logger, Registerer: env.Registerer})
		}, nil
	})
}
