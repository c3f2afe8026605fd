// Command aggregate runs one instance of an aggregate shard: the tenant-scoped ledger command
// API (POST /commands, GET /aggregates/account/{id}, GET /ledger/totals) on JetStream.
package main

import (
	"context"

	"github.com/tenantmesh/tenantmesh/services/aggregate"
	"github.com/tenantmesh/tenantmesh/shardkit/shardmain"
)

func main() {
	shardmain.Exit("aggregate", func(*shardmain.Main) (shardmain.Builder, error) {
		return func(ctx context.Context, env shardmain.Env) (shardmain.App, error) {
			return aggregate.New(ctx, aggregate.Config{Store: env.Store, Logger: env.Logger, Registerer: env.Registerer})
		}, nil
	})
}
