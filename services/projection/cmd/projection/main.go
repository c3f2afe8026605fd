// Command projection runs one instance of a projection shard: per-tenant views built from the
// ledger events in TM_EVENTS, queried with POST /query/{view_type}. With
// TM_PROJECTION_ALL_TENANTS=1 it is a multi-tenant shard: it consumes every tenant's events,
// labelled tm-tenants=all so that the rebalancer moves no tenant to or from it.
package main

import (
	"context"
	"os"

	"github.com/tenantmesh/tenantmesh/services/projection"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/shardmain"
)

func main() {
	shardmain.Exit(projection.Kind, func(m *shardmain.Main) (shardmain.Builder, error) {
		all := os.Getenv("TM_PROJECTION_ALL_TENANTS") == "1"
		if all {
			label := schema.LabelTenants + "=" + schema.TenantsAll
			if m.Labels != "" {
				label = m.Labels + "," + label
			}
			m.Labels = label
		}
		return func(ctx context.Context, env shardmain.Env) (shardmain.App, error) {
			return projection.New(ctx, projection.Config{Store: env.Store, Shard: env.ID.Shard, AllTenants: all, Logger: env.Logger, Registerer: env.Registerer})
		}, nil
	})
}
