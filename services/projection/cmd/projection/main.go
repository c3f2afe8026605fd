// Command projection runs one instance of a projection shard: per-tenant views built from the
// ledger events in TM_EVENTS, queried with POST /query/{view_type}.
package main

import (
	"context"

	"github.com/tenantmesh/tenantmesh/services/internal/svcmain"
	"github.com/tenantmesh/tenantmesh/services/projection"
)

func main() {
	svcmain.Exit(projection.Kind, func(*svcmain.Main) (svcmain.Builder, error) {
		return func(ctx context.Context, env svcmain.Env) (svcmain.App, error) {
			return projection.New(ctx, projection.Config{Store: env.Store, Shard: env.ID.Shard, Logger: env.Logger, Registerer: env.Registerer})
		}, nil
	})
}
