// Command gateway is tenantmesh's data plane: it routes every tenant request to the shard that
// owns the tenant (see package gateway). Flags have TM_* environment variables.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
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
	var o options
	if err := o.parse(args, stderr); err != nil {
		return err
	}
	log, err := tmlog.New(stderr, o.logLevel, o.logFormat)
	if err != nil {
		return err
	}
	flush, err := tracing.Main(ctx, "tenantmesh-gateway")
	if err != nil {
		return err
	}
	defer flush()
	cfg, err := o.config(ctx, log)
	if err != nil {
		return err
	}
	nc, err := natsconn.Connect(o.nats, "tm-gateway", log)
	if err != nil {
		return err
	}
	defer nc.Close()
	if cfg.Store, err = schema.OpenRetry(ctx, nc, schema.Options{Replicas: o.replicas, Logger: log, Attach: true}); err != nil {
		return err
	}
	g, err := gateway.New(cfg)
	if err != nil {
		return err
	}
	return g.Run(ctx)
}

// options are the gateway binary's flags: gateway.Config's own (Config.AddFlags), and what the
// binary makes Config's other fields from.
type options struct {
	cfg                      gateway.Config
	nats                     natsconn.Options
	logLevel, logFormat      string
	replicas                 int
	tlsCert, tlsKey          string
	upstreamCA, shardKeyFile string
	jwt                      edgeauth.Config
	jwtMethods               string
	trustTenant, edge        bool
}

// parse reads args (defaults from TM_* variables) into o.
func (o *options) parse(args []string, stderr io.Writer) error {
	fs := flag.NewFlagSet("gateway", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o.nats.AddFlags(fs)
	parsed := o.cfg.AddFlags(fs)
	envflag.String(fs, &o.logLevel, "log-level", "info", "log level: debug, info, warn, error")
	envflag.String(fs, &o.logFormat, "log-format", "auto", "log format: auto, text, json")
	envflag.Int(fs, &o.replicas, "replicas", 1, "replicas for buckets and streams this process creates (3 in a cluster)")
	envflag.String(fs, &o.tlsCert, "tls-cert", "", "serve HTTPS with this certificate (PEM; a renewed file is picked up without a restart)")
	envflag.String(fs, &o.tlsKey, "tls-key", "", "key (PEM) of --tls-cert")
	envflag.String(fs, &o.upstreamCA, "upstream-ca", "", "PEM CAs that sign the certificates of instances registered with https:// URLs (default: the system's)")
	envflag.String(fs, &o.jwt.JWKSURL, "jwt-jwks-url", "", "check a bearer JWT on every tenant request, with keys from this JWK Set URL (cached, refreshed)")
	envflag.String(fs, &o.jwt.KeyFile, "jwt-key-file", "", "check a bearer JWT on every tenant request, with this PEM public key or JWK Set file")
	envflag.String(fs, &o.jwt.Issuer, "jwt-issuer", "", "with --jwt-*: the iss tokens must carry")
	envflag.String(fs, &o.jwt.Audience, "jwt-audience", "", "with --jwt-*: an aud tokens must carry")
	envflag.String(fs, &o.jwt.TenantClaim, "jwt-tenant-claim", "tenant_id", "with --jwt-*: the claim naming the tenant; it must equal x-tenant-id, or fills it")
	envflag.Duration(fs, &o.jwt.Leeway, "jwt-leeway", 30*time.Second, "with --jwt-*: clock skew allowed on exp and nbf")
	envflag.Int(fs, &o.jwt.CacheSize, "jwt-cache-size", 10000, "with --jwt-*: verified tokens remembered (about 1 KB each); more active users than this verify signatures more often")
	envflag.String(fs, &o.jwtMethods, "jwt-algorithms", "RS256,RS384,RS512,PS256,ES256,ES384,EdDSA", "with --jwt-*: accepted signing algorithms (public-key ones only)")
	envflag.Bool(fs, &o.trustTenant, "trust-tenant-header", false, "believe x-tenant-id as the client sends it, without --jwt-* (only when something in front of the gateway sets it: a development stack, an authenticating proxy); without either the gateway refuses to start")
	envflag.String(fs, &o.shardKeyFile, "shard-key-file", "", "file with the gateways' key (rebalance auth init writes gate.key): every request to an instance carries a proof its shard checks with --gateway-key-file")
	if err := envflag.Check(fs); err != nil {
		return err
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	parsed()
	o.edge = o.jwt.JWKSURL != "" || o.jwt.KeyFile != ""
	if !o.edge && !o.trustTenant {
		return errNoEdgeIdentity
	}
	if (o.tlsCert == "") != (o.tlsKey == "") {
		return errors.New("--tls-cert and --tls-key go together")
	}
	return nil
}

// config is the gateway's Config but for its Store: the flags' fields, and what the files and
// the JWT check the flags name make.
func (o *options) config(ctx context.Context, log *slog.Logger) (gateway.Config, error) {
	cfg := o.cfg
	cfg.Logger = log
	var err error
	if o.tlsCert != "" {
		rl, err := certfile.New(o.tlsCert, o.tlsKey, log)
		if err != nil {
			return cfg, fmt.Errorf("--tls-cert/--tls-key: %w", err)
		}
		cfg.TLS = rl.ServerConfig()
	}
	if o.shardKeyFile != "" {
		if cfg.ShardKey, err = gatesig.ReadKeyFile(o.shardKeyFile); err != nil {
			return cfg, fmt.Errorf("--shard-key-file: %w", err)
		}
	} else {
		log.Warn("requests to shards carry no gateway proof (--shard-key-file): shards that check one refuse them, and shards that do not believe anyone who reaches their port")
	}
	if o.upstreamCA != "" {
		if cfg.UpstreamCAs, err = certfile.Pool(o.upstreamCA); err != nil {
			return cfg, fmt.Errorf("--upstream-ca: %w", err)
		}
	}
	if o.edge {
		o.jwt.Methods, o.jwt.Logger = strings.Split(o.jwtMethods, ","), log
		if cfg.Auth, err = edgeauth.New(ctx, o.jwt); err != nil {
			return cfg, err
		}
		log.Info("tenant requests need a bearer JWT", "jwks", o.jwt.JWKSURL, "key_file", o.jwt.KeyFile, "tenant_claim", o.jwt.TenantClaim)
	}
	return cfg, nil
}
