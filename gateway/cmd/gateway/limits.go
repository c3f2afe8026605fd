package main

import (
	"flag"
	"strings"
	"time"

	"github.com/tenantmesh/tenantmesh/gateway"
	"github.com/tenantmesh/tenantmesh/internal/envflag"
)

// addLimitFlags binds the gateway's hardening bounds (docs/security.md) to flags: each phase's
// deadline, the connection caps and the assignment limits. The returned func fills in what
// needs converting, after parsing.
func addLimitFlags(fs *flag.FlagSet, cfg *gateway.Config) (after func()) {
	var minRate, perClient, perKind int
	var fwdAuthz string
	envflag.String(fs, &fwdAuthz, "forward-authorization", "", "with --jwt-*: kinds whose instances receive the client's Authorization field (comma-separated; others never see the user's token)")
	envflag.Duration(fs, &cfg.IdleTimeout, "idle-timeout", 2*time.Minute, "close a client connection idle this long")
	envflag.Duration(fs, &cfg.BodyReadTimeout, "body-read-timeout", 10*time.Second, "longest wait for more of a request body (408 beyond)")
	envflag.Int(fs, &minRate, "min-body-rate", 1024, "bytes a second a request body must average after --body-read-timeout (-1: no rate)")
	envflag.Duration(fs, &cfg.WriteTimeout, "write-timeout", 30*time.Second, "longest a client may take to accept a write of its answer")
	envflag.Duration(fs, &cfg.TunnelIdleTimeout, "tunnel-idle-timeout", 10*time.Minute, "close an upgraded connection (WebSocket) silent both ways this long")
	envflag.Int(fs, &cfg.MaxConns, "max-conns", 10000, "client connections open at once (-1: no bound)")
	envflag.Int(fs, &cfg.MaxStreams, "max-streams", 250, "concurrent streams (requests, gRPC calls) of one HTTP/2 client connection")
	envflag.Int(fs, &cfg.MaxConnsPerIP, "max-conns-per-ip", 1000, "client connections open at once from one address (-1: no bound; raise it behind a load balancer that hides client addresses)")
	envflag.Int(fs, &perClient, "assign-rate-per-client", 5, "new tenants a second one client address may have assigned, in bursts of ten times it (-1: no bound)")
	envflag.Int(fs, &perKind, "assign-rate-per-kind", 100, "new tenants a second this gateway assigns per kind, in bursts of ten times it (-1: no bound)")
	envflag.Int(fs, &cfg.Assign.MaxPlacements, "max-placements-per-kind", 1_000_000, "placements a kind may hold for the gateway to assign one more (-1: no cap)")
	return func() {
		for _, k := range strings.Split(fwdAuthz, ",") {
			if k = strings.TrimSpace(k); k != "" {
				cfg.ForwardAuthorization = append(cfg.ForwardAuthorization, k)
			}
		}
		cfg.MinBodyRate = int64(minRate)
		cfg.Assign.PerClient, cfg.Assign.PerClientBurst = float64(perClient), 10*max(perClient, 1)
		cfg.Assign.PerKind, cfg.Assign.PerKindBurst = float64(perKind), 10*max(perKind, 1)
	}
}
