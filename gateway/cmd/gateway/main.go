// Command gateway is tenantmesh's data plane: it routes every tenant request to the shard that
// owns the tenant (see package gateway). Flags have TM_* environment variables.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"syscall"
	"time"

	"github.com/tenantmesh/tenantmesh/gateway"
	"github.com/tenantmesh/tenantmesh/gateway/edgeauth"
	"github.com/tenantmesh/tenantmesh/internal/certfile"
	"github.com/tenantmesh/tenantmesh/internal/envflag"
	"github.com/tenantmesh/tenantmesh/internal/gatesig"
	"github.com/tenantmesh/tenantmesh/internal/tmlog"
	"github.com/tenantmesh/tenantmesh/internal/tracing"
	"github.com/tenantmesh/tenantmesh/shardkit/natsconn"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

func main() {
	spareProc()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "gateway:", err)
		os.Exit(1)
	}
}

// errNoEdgeIdentity refuses to start a gateway that would believe x-tenant-id from anyone
// without being told to.
var errNoEdgeIdentity = errors.New("no tenant identity at the edge: every client could name any tenant in x-tenant-id. " +
	"Set --jwt-jwks-url or --jwt-key-file (with --jwt-issuer and --jwt-audience) to check a bearer JWT, or " +
	"--trust-tenant-header if something in front of the gateway sets x-tenant-id itself (a development stack, " +
	"an authenticating proxy)")

// spareProc runs Go code on one processor (P) more than the runtime's default, unless
// GOMAXPROCS is set. The gateway reads and writes its sockets with raw system calls
// (gateway/sock_linux.go), so a thread the kernel deschedules inside one keeps its P instead of
// handing it to another thread; the spare P serves other connections meanwhile. Measured
// against the default on 2 cores: docs/decisions.md, "The gateway's sockets are read and
// written raw". Setting GOMAXPROCS also stops the runtime from following a changed CPU limit.
func spareProc() {
	if os.Getenv("GOMAXPROCS") == "" {
		runtime.GOMAXPROCS(runtime.GOMAXPROCS(0) + 1)
	}
}

// run parses args and runs the gateway until ctx ends; logs go to stderr.
func run(ctx context.Context, args []string, stderr io.Writer) error {
	fs := flag.NewFlagSet("gateway", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		nats                                      natsconn.Options
		addr, id, logLevel, logFormat             string
		retries, maxHeader, idlePerHost, replicas int
		pprof                                     bool
		adminToken, registrationToken             string
		tlsCert, tlsKey, upstreamCA               string
		jwt                                       edgeauth.Config
		jwtMethods                                string
		maxBody, replayBody                       int
		readHeader, shutdown, connect             time.Duration
		trustTenant                               bool
		shardKeyFile                              string
	)
	cfg := gateway.Config{}
	nats.AddFlags(fs)
	envflag.String(fs, &addr, "addr", ":8080", "listen address")
	envflag.String(fs, &id, "gateway-id", "", "gateway id in audit events (default hostname-pid)")
	envflag.String(fs, &logLevel, "log-level", "info", "log level: debug, info, warn, error")
	envflag.String(fs, &logFormat, "log-format", "auto", "log format: auto, text, json")
	envflag.Int(fs, &replicas, "replicas", 1, "replicas for buckets and streams this process creates (3 in a cluster)")
	envflag.Int(fs, &retries, "retries", 2, "further attempts after a 421 or an unreachable instance (0: none)")
	envflag.Int(fs, &maxHeader, "max-header-bytes", 64<<10, "largest request header block")
	envflag.Int(fs, &maxBody, "max-body-bytes", 32<<20, "largest request body (-1: unbounded)")
	envflag.Int(fs, &replayBody, "max-replay-body", 1<<20, "largest body buffered for retries and holds")
	envflag.Int(fs, &idlePerHost, "max-idle-conns-per-host", 256, "idle upstream connections kept per instance")
	envflag.Duration(fs, &readHeader, "read-header-timeout", 5*time.Second, "time allowed to read request headers")
	envflag.Duration(fs, &shutdown, "shutdown-timeout", 30*time.Second, "time allowed for in-flight requests at shutdown")
	envflag.Duration(fs, &connect, "connect-timeout", time.Second, "time allowed to connect to an instance")
	envflag.Bool(fs, &pprof, "pprof", false, "serve /debug/pprof/ to requests without x-tenant-id (needs the admin token)")
	envflag.Secret(fs, &adminToken, "admin-token", "bearer token for /admin/* and /debug/pprof/ (unset: they are refused)")
	envflag.Secret(fs, &registrationToken, "registration-token", "bearer token affinity servers register with at /prerender-servers (the admin token works too; neither set: registration is refused)")
	envflag.String(fs, &tlsCert, "tls-cert", "", "serve HTTPS with this certificate (PEM; a renewed file is picked up without a restart)")
	envflag.String(fs, &tlsKey, "tls-key", "", "key (PEM) of --tls-cert")
	envflag.String(fs, &upstreamCA, "upstream-ca", "", "PEM CAs that sign the certificates of instances registered with https:// URLs (default: the system's)")
	envflag.String(fs, &jwt.JWKSURL, "jwt-jwks-url", "", "check a bearer JWT on every tenant request, with keys from this JWK Set URL (cached, refreshed)")
	envflag.String(fs, &jwt.KeyFile, "jwt-key-file", "", "check a bearer JWT on every tenant request, with this PEM public key or JWK Set file")
	envflag.String(fs, &jwt.Issuer, "jwt-issuer", "", "with --jwt-*: the iss tokens must carry")
	envflag.String(fs, &jwt.Audience, "jwt-audience", "", "with --jwt-*: an aud tokens must carry")
	envflag.String(fs, &jwt.TenantClaim, "jwt-tenant-claim", "tenant_id", "with --jwt-*: the claim naming the tenant; it must equal x-tenant-id, or fills it")
	envflag.Duration(fs, &jwt.Leeway, "jwt-leeway", 30*time.Second, "with --jwt-*: clock skew allowed on exp and nbf")
	envflag.Int(fs, &jwt.CacheSize, "jwt-cache-size", 10000, "with --jwt-*: verified tokens remembered (about 1 KB each); more active users than this verify signatures more often")
	envflag.String(fs, &jwtMethods, "jwt-algorithms", "RS256,RS384,RS512,PS256,ES256,ES384,EdDSA", "with --jwt-*: accepted signing algorithms (public-key ones only)")
	envflag.Bool(fs, &trustTenant, "trust-tenant-header", false, "believe x-tenant-id as the client sends it, without --jwt-* (only when something in front of the gateway sets it: a development stack, an authenticating proxy); without either the gateway refuses to start")
	envflag.String(fs, &shardKeyFile, "shard-key-file", "", "file with the gateways' key (rebalance auth init writes gate.key): every request to an instance carries a proof its shard checks with --gateway-key-file")
	limits := addLimitFlags(fs, &cfg)
	if err := envflag.Check(fs); err != nil {
		return err
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	limits()
	if retries <= 0 {
		retries = -1 // Config's zero means the default
	}
	edge := jwt.JWKSURL != "" || jwt.KeyFile != ""
	if !edge && !trustTenant {
		return errNoEdgeIdentity
	}
	log, err := tmlog.New(stderr, logLevel, logFormat)
	if err != nil {
		return err
	}
	flush, err := tracing.Main(ctx, "tenantmesh-gateway")
	if err != nil {
		return err
	}
	defer flush()

	cfg.ID, cfg.Addr, cfg.Logger, cfg.Retries = id, addr, log, retries
	cfg.MaxHeaderBytes, cfg.MaxBodyBytes, cfg.MaxReplayBody = maxHeader, int64(maxBody), int64(replayBody)
	cfg.MaxIdleConnsPerHost, cfg.ReadHeaderTimeout, cfg.ShutdownTimeout = idlePerHost, readHeader, shutdown
	cfg.ConnectTimeout, cfg.Pprof = connect, pprof
	cfg.AdminToken, cfg.RegistrationToken = adminToken, registrationToken
	if (tlsCert == "") != (tlsKey == "") {
		return errors.New("--tls-cert and --tls-key go together")
	}
	if tlsCert != "" {
		rl, err := certfile.New(tlsCert, tlsKey, log)
		if err != nil {
			return fmt.Errorf("--tls-cert/--tls-key: %w", err)
		}
		cfg.TLS = rl.ServerConfig()
	}
	if shardKeyFile != "" {
		if cfg.ShardKey, err = gatesig.ReadKeyFile(shardKeyFile); err != nil {
			return fmt.Errorf("--shard-key-file: %w", err)
		}
	} else {
		log.Warn("requests to shards carry no gateway proof (--shard-key-file): shards that check one refuse them, and shards that do not believe anyone who reaches their port")
	}
	if upstreamCA != "" {
		if cfg.UpstreamCAs, err = certfile.Pool(upstreamCA); err != nil {
			return fmt.Errorf("--upstream-ca: %w", err)
		}
	}
	if edge {
		jwt.Methods = strings.Split(jwtMethods, ",")
		jwt.Logger = log
		if cfg.Auth, err = edgeauth.New(ctx, jwt); err != nil {
			return err
		}
		log.Info("tenant requests need a bearer JWT", "jwks", jwt.JWKSURL, "key_file", jwt.KeyFile, "tenant_claim", jwt.TenantClaim)
	}
	nc, err := natsconn.Connect(nats, "tm-gateway", log)
	if err != nil {
		return err
	}
	defer nc.Close()
	store, err := schema.OpenRetry(ctx, nc, schema.Options{Replicas: replicas, Logger: log, Attach: true})
	if err != nil {
		return err
	}
	cfg.Store = store
	g, err := gateway.New(cfg)
	if err != nil {
		return err
	}
	return g.Run(ctx)
}
