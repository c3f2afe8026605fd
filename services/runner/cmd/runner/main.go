// Command runner runs one instance of a runner shard: per-tenant job queues (POST /jobs,
// GET /jobs/{id}, GET /jobs?status=), effects through an outbox, and sagas, on JetStream.
// Besides the TM_* flags of every shard binary it reads TM_RUNNER_MAX_CONCURRENT,
// TM_RUNNER_JOBS_PER_MINUTE, TM_RUNNER_TENANT_JOBS_PER_MINUTE, TM_RUNNER_MAX_QUEUED,
// TM_RUNNER_RETENTION (how long finished runs are kept, default 168h),
// TM_RUNNER_WEBHOOK_ALLOW (the destinations webhooks may reach, comma-separated: "public",
// IPs, CIDR prefixes, host names; default public addresses only) and, for the email effect,
// TM_SMTP_ADDR and TM_SMTP_FROM.
package main

import (
	"context"
	"os"

	"github.com/tenantmesh/tenantmesh/services/runner"
	"github.com/tenantmesh/tenantmesh/shardkit/shardmain"
)

func main() {
	shardmain.Exit("runner", func(*shardmain.Main) (shardmain.Builder, error) {
		cfg, err := runner.ConfigFromEnv(os.Getenv)
		if err != nil {
			return nil, err
		}
		return func(ctx context.Context, env shardmain.Env) (shardmain.App, error) {
			cfg.Store, cfg.ID, cfg.Logger, cfg.Registerer = env.Store, env.ID, env.Logger, env.Registerer
			return runner.New(ctx, cfg)
		}, nil
	})
}
