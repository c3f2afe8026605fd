package main

import (
	"context"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// openStore opens the schema store, retrying until NATS answers or ctx ends: a gateway may start
// before NATS does.
func openStore(ctx context.Context, nc *nats.Conn, log *slog.Logger) (*schema.Store, error) {
	wait := 250 * time.Millisecond
	for {
		octx, cancel := context.WithTimeout(ctx, 10*time.Second)
		st, err := schema.Open(octx, nc, schema.Options{Logger: log})
		cancel()
		if err == nil {
			return st, nil
		}
		log.Warn("NATS not ready; retrying", "err", err, "in", wait)
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		wait = min(2*wait, 5*time.Second)
	}
}
