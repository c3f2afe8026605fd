package gateway

import (
	"flag"
	"strings"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/envflag"
)

// AddFlags binds the fields of c a command line sets to fs, each also read from its TM_*
// variable (internal/envflag): the listen address, the retries, the bounds on requests and
// connections (docs/security.md: each phase's deadline, the connection caps, the assignment
// limits) and the admin and registration tokens. The returned func fills in, once fs is
// parsed, the fields that need converting. The gateway binary (gateway/cmd/gateway) adds the
// flags of what it makes Config's other fields from: NATS, TLS files, the JWT check.
func (c *Config) AddFlags(fs *flag.FlagSet) (parsed func()) {
	var retries, maxBody, replayBody, minRate, perClient, perKind int
	var fwdAuthz string
	envflag.String(fs, &c.Addr, "addr", ":8080", "listen address")
	envflag.String(fs, &c.ID, "gateway-id", "", "gateway id in audit events (default hostname-pid)")
	envflag.Int(fs, &retries, "retries", 2, "further attempts after a 421 or an unreachable instance (0: none)")
	envflag.Int(fs, &c.MaxHeaderBytes, "max-header-bytes", 64<<10, "largest request header block")
	envflag.Int(fs, &maxBody, "max-body-bytes", 32<<20, "largest request body (-1: unbounded)")
	envflag.Int(fs, &replayBody, "max-replay-body", 1<<20, "largest body buffered for retries and holds")
	envflag.Int(fs, &c.MaxIdleConnsPerHost, "max-idle-conns-per-host", 256, "idle upstream connections kept per instance")
	envflag.Duration(fs, &c.ReadHeaderTimeout, "read-header-timeout", 5*time.Second, "time allowed to read request headers")
	envflag.Duration(fs, &c.ShutdownTimeout, "shutdown-timeout", 30*time.Second, "time allowed for in-flight requests at shutdown")
	envflag.Duration(fs, &c.ConnectTimeout, "connect-timeout", time.Second, "time allowed to connect to an instance")
	envflag.Bool(fs, &c.Pprof, "pprof", false, "serve /debug/pprof/ to requests without x-tenant-id (needs the admin token)")
	envflag.Secret(fs, &c.AdminToken, "admin-token", "bearer token for /admin/* and /debug/pprof/ (unset: they are refused)")
	envflag.Secret(fs, &c.RegistrationToken, "registration-token", "bearer token affinity servers register with at /prerender-servers (the admin token works too; neither set: registration is refused)")
	envflag.String(fs, &fwdAuthz, "forward-authorization", "", "with --jwt-*: kinds whose instances receive the client's Authorization field (comma-separated; others never see the user's token)")
	envflag.Duration(fs, &c.IdleTimeout, "idle-timeout", 2*time.Minute, "close a client connection idle this long")
	envflag.Duration(fs, &c.BodyReadTimeout, "body-read-timeout", 10*time.Second, "longest wait for more of a request body (408 beyond)")
	envflag.Int(fs, &minRate, "min-body-rate", 1024, "bytes a second a request body must average after --body-read-timeout (-1: no rate)")
	envflag.Duration(fs, &c.WriteTimeout, "write-timeout", 30*time.Second, "longest a client may take to accept a write of its answer")
	envflag.Duration(fs, &c.TunnelIdleTimeout, "tunnel-idle-timeout", 10*time.Minute, "close an upgraded connection (WebSocket) silent both ways this long")
	envflag.Int(fs, &c.MaxConns, "max-conns", 10000, "client connections open at once (-1: no bound)")
	envflag.Int(fs, &c.MaxStreams, "max-streams", 250, "concurrent streams (requests, gRPC calls) of one HTTP/2 client connection")
	envflag.Int(fs, &c.MaxConnsPerIP, "max-conns-per-ip", 1000, "client connections open at once from one address (-1: no bound; raise it behind a load balancer that hides client addresses)")
	envflag.Int(fs, &perClient, "assign-rate-per-client", 5, "new tenants a second one client address may have assigned, in bursts of ten times it (-1: no bound)")
	envflag.Int(fs, &perKind, "assign-rate-per-kind", 100, "new tenants a second this gateway assigns per kind, in bursts of ten times it (-1: no bound)")
	envflag.Int(fs, &c.Assign.MaxPlacements, "max-placements-per-kind", 1_000_000, "placements a kind may hold for the gateway to assign one more (-1: no cap)")
	return func() {
		c.Retries = retries
		if retries <= 0 {
			c.Retries = -1 // Config's zero means the default
		}
		c.MaxBodyBytes, c.MaxReplayBody, c.MinBodyRate = int64(maxBody), int64(replayBody), int64(minRate)
		for _, k := range strings.Split(fwdAuthz, ",") {
			if k = strings.TrimSpace(k); k != "" {
				c.ForwardAuthorization = append(c.ForwardAuthorization, k)
			}
		}
		c.Assign.PerClient, c.Assign.PerClientBurst = float64(perClient), 10*max(perClient, 1)
		c.Assign.PerKind, c.Assign.PerKindBurst = float64(perKind), 10*max(perKind, 1)
	}
}
