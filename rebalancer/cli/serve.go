package cli

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/internal/envflag"
	"github.com/tenantmesh/tenantmesh/internal/tmlog"
	"github.com/tenantmesh/tenantmesh/internal/tracing"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/autopilot"
	"github.com/tenantmesh/tenantmesh/rebalancer/server"
	"github.com/tenantmesh/tenantmesh/rebalancer/sweeper"
	"github.com/tenantmesh/tenantmesh/shardkit/natsconn"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// ServeCommand is `rebalance serve` (docs/design.md's `rebalancer serve`): the rebalancer service.
// It has the Main shape (ParseFlags, Start/Run, Close) so tests can run it in-process.
type ServeCommand struct {
	m *Main

	Addr, Holder             string
	NATS                     natsconn.Options
	LogLevel, LogFormat      string
	Webhook, AdminToken      string
	ReadToken                string
	Replicas, WebhookRetries int
	LeaseTTL, SweepEvery     time.Duration
	OfflineAfter, Degraded   time.Duration
	WebhookTimeout           time.Duration
	Warm, Handoff, Drain     time.Duration
	PauseBudget              time.Duration
	ErrorRate                float64
	NoCompact                bool

	// The autopilot and presence (see rebalancer/autopilot and rebalancer.Presence).
	Autopilot                  string
	AutoMaxMoves               int
	AutoMaxGiB                 float64
	AutoWindow, AutoCooldown   time.Duration
	AutoSustain, AutoStartup   time.Duration
	AutoSettle                 time.Duration
	AutoTolerance, AutoTrigger float64
	AutoWindows                string
	SuspectAfter, DeadAfter    time.Duration

	nc        *nats.Conn
	closeOnce sync.Once
	listening chan string
}

const serveAbout = `Runs the rebalancer service: the HTTP API and event stream for the dashboard (every process)
and, in the one process holding the leader lease, plan applies, the sweeper (instances without
a heartbeat for --offline-after are marked offline, alerted to --alert-webhook and removed from
routes; a full stale-route cleanup on becoming leader) and compacted placement snapshots.
Other processes serve the API read-only and answer apply with 409 naming the leader.
Requests that change state (create, apply or roll back a plan; set a kind) need
Authorization: Bearer <--admin-token>; without a token they are refused. Reads, the event
stream and the dashboard are open.`

const serveExamples = `  TM_ADMIN_TOKEN=$(openssl rand -hex 32) rebalance serve
  rebalance serve --addr :8090 --alert-webhook https://hooks.example.com/tm --offline-after 2m
  TM_NATS_URL=nats://n1:4222,nats://n2:4222 rebalance serve --holder rebalancer-a --replicas 3
`

// ParseFlags reads the flags (defaults from TM_* variables; the listen address from
// TM_REBALANCER_ADDR).
func (c *ServeCommand) ParseFlags(args []string) error {
	host, _ := os.Hostname()
	fs := c.m.newFlags("serve", "[flags]", serveAbout, serveExamples)
	addr := os.Getenv("TM_REBALANCER_ADDR")
	if addr == "" {
		addr = ":8090"
	}
	fs.StringVar(&c.Addr, "addr", addr, "HTTP listen address (env TM_REBALANCER_ADDR)")
	c.NATS.AddFlags(fs)
	envflag.String(fs, &c.Holder, "holder", sanitizeName("rebalancer-"+host), "this process's name in the leader lease (stable across restarts, unique per process)")
	envflag.String(fs, &c.LogLevel, "log-level", "info", "debug, info, warn or error")
	envflag.String(fs, &c.LogFormat, "log-format", "auto", "auto (text on a terminal, JSON otherwise), text or json")
	envflag.String(fs, &c.Webhook, "alert-webhook", "", "URL that receives AGENT_OFFLINE alerts as JSON POSTs (unset: no alerts)")
	envflag.Secret(fs, &c.AdminToken, "admin-token", "bearer token the API's write routes need: POST /api/plans, .../apply, .../rollback, PUT /api/kinds/{kind} (unset: they are refused with 403)")
	envflag.Secret(fs, &c.ReadToken, "read-token", "bearer token the API's reads need (plans, instances, tenants, audit, the event stream; the admin token works too; unset: clients on this host only)")
	envflag.Int(fs, &c.Replicas, "replicas", 1, "replicas for buckets and streams this process creates (3 in a cluster)")
	envflag.Int(fs, &c.WebhookRetries, "alert-retries", 3, "retries of a failed alert POST")
	envflag.Duration(fs, &c.WebhookTimeout, "alert-timeout", 5*time.Second, "bound on one alert POST")
	envflag.Duration(fs, &c.LeaseTTL, "lease-ttl", 10*time.Second, "leader lease lifetime; a dead leader is replaced within it")
	envflag.Duration(fs, &c.SweepEvery, "sweep-every", 15*time.Second, "how often the leader sweeps the directory")
	envflag.Duration(fs, &c.OfflineAfter, "offline-after", 2*time.Minute, "no heartbeat for this long: offline (the multi-host design)")
	envflag.Duration(fs, &c.Degraded, "degraded-after", 3*time.Second, "no heartbeat for this long: degraded")
	fs.Float64Var(&c.ErrorRate, "degraded-error-rate", 0.5, "an instance reporting this error rate is degraded (negative: never)")
	envflag.Duration(fs, &c.Warm, "warm-timeout", 2*time.Minute, "abort a move whose target is not ready within this")
	envflag.Duration(fs, &c.Handoff, "handoff-timeout", 10*time.Second, "abort a move whose handoff cannot commit within this")
	envflag.Duration(fs, &c.Drain, "move-drain-timeout", 30*time.Second, "after commit, how long to wait for the former owner to drain")
	envflag.Duration(fs, &c.PauseBudget, "pause-budget", rebalancer.DefaultPauseBudget, "run fewer moves at once while handoff pauses exceed this (0: always the plan's concurrency)")
	envflag.Bool(fs, &c.NoCompact, "no-compact", false, "do not write compacted placement snapshots")
	envflag.String(fs, &c.Autopilot, "autopilot", string(autopilot.DryRun), "off (decide nothing, failover included), dry-run (store plans as proposals, apply none) or on")
	envflag.Int(fs, &c.AutoMaxMoves, "autopilot-max-moves", 60, "the autopilot's moves per --autopilot-window (failover counts, never stops)")
	fs.Float64Var(&c.AutoMaxGiB, "autopilot-max-gib", 10, "GiB the autopilot's moves may carry per --autopilot-window")
	envflag.Duration(fs, &c.AutoWindow, "autopilot-window", time.Hour, "the window the autopilot's move and byte budgets count over")
	envflag.Duration(fs, &c.AutoCooldown, "autopilot-cooldown", 30*time.Minute, "no tenant is moved by the autopilot twice within this (failover excepted)")
	fs.Float64Var(&c.AutoTolerance, "autopilot-tolerance", 0.1, "a balance plan aims at max/mean utilisation <= 1+this")
	fs.Float64Var(&c.AutoTrigger, "autopilot-trigger", 0.25, "a kind is balanced when max/mean utilisation stays above 1+this for --autopilot-sustain (hysteresis: above the tolerance)")
	envflag.Duration(fs, &c.AutoSustain, "autopilot-sustain", 5*time.Minute, "how long imbalance, or an empty shard, must hold before the autopilot plans")
	envflag.Duration(fs, &c.AutoSettle, "autopilot-settle", 0, "how long a kind may stay above its tolerance (under the trigger) before the autopilot balances it back within (0: 4 x --autopilot-sustain)")
	envflag.Duration(fs, &c.AutoStartup, "autopilot-startup", 10*time.Second, "a new leader waits this long before the autopilot decides anything (instances starting beside it register)")
	envflag.String(fs, &c.AutoWindows, "autopilot-windows", "", `maintenance windows (UTC) when balance and fill may run, ";"-separated: "Mon-Fri 22:00-06:00; Sat 00:00-24:00" (unset: any time)`)
	envflag.Duration(fs, &c.SuspectAfter, "suspect-after", 1500*time.Millisecond, "probe an instance whose load reports stopped this long")
	envflag.Duration(fs, &c.DeadAfter, "dead-after", 4*time.Second, "an instance silent this long that does not answer probes is dead (frozen or cut off)")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usagef("serve takes no arguments")
	}
	return schema.CheckName("holder", c.Holder)
}

// Listening receives the HTTP address once the service listens.
func (c *ServeCommand) Listening() <-chan string {
	if c.listening == nil {
		c.listening = make(chan string, 1)
	}
	return c.listening
}

// Run parses args and serves until ctx ends.
func (c *ServeCommand) Run(ctx context.Context, args []string) error {
	if err := c.ParseFlags(args); err != nil {
		return err
	}
	defer c.Close()
	flush, err := tracing.Main(ctx, "tenantmesh-rebalancer")
	if err != nil {
		return err
	}
	defer flush()
	return c.Serve(ctx)
}

// Serve runs the service with the parsed flags until ctx ends, then shuts down cleanly.
func (c *ServeCommand) Serve(ctx context.Context) error {
	log, err := tmlog.New(c.m.Stderr, c.LogLevel, c.LogFormat)
	if err != nil {
		return usagef("%v", err)
	}
	log = log.With("holder", c.Holder)
	c.nc, err = natsconn.Connect(c.NATS, "rebalancer-"+c.Holder, log)
	if err != nil {
		return err
	}
	// The rebalancer provisions what gateways and shards wait for. On a new cluster placing
	// replicated streams can take a while: keep trying for two minutes.
	octx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	st, err := schema.OpenRetry(octx, c.nc, schema.Options{Replicas: c.Replicas, Logger: log})
	if err == nil {
		err = st.Provision(octx)
	}
	cancel()
	if err != nil {
		return fmt.Errorf("open tenantmesh state at %s: %w", c.NATS.Redacted(), err)
	}
	health := rebalancer.Health{Thresholds: schema.Thresholds{DegradedAfter: c.Degraded, OfflineAfter: c.OfflineAfter}, DegradedErrorRate: c.ErrorRate}
	ap, err := c.autopilotConfig()
	if err != nil {
		return err
	}
	srv, err := server.New(server.Config{Store: st, Holder: c.Holder, LeaseTTL: c.LeaseTTL, Health: health,
		WarmTimeout: c.Warm, HandoffTimeout: c.Handoff, DrainTimeout: c.Drain, PauseBudget: pauseBudget(c.PauseBudget), NoCompact: c.NoCompact, AdminToken: c.AdminToken, ReadToken: c.ReadToken, Logger: log,
		Sweep:     sweeper.Config{Interval: c.SweepEvery, Webhook: c.Webhook, WebhookTimeout: c.WebhookTimeout, WebhookRetries: c.WebhookRetries},
		Presence:  rebalancer.PresenceConfig{SuspectAfter: c.SuspectAfter, DeadAfter: c.DeadAfter},
		Autopilot: ap})
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", c.Addr)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", c.Addr, err)
	}
	if c.listening != nil {
		c.listening <- ln.Addr().String()
	}
	err = srv.Serve(ctx, ln)
	if errors.Is(err, context.Canceled) {
		err = nil
	}
	log.Info("stopped")
	return err
}

// autopilotConfig is the autopilot's configuration from the flags.
func (c *ServeCommand) autopilotConfig() (autopilot.Config, error) {
	mode, err := autopilot.ParseMode(c.Autopilot)
	if err != nil {
		return autopilot.Config{}, usagef("--autopilot: %v", err)
	}
	windows, err := autopilot.ParseWindows(c.AutoWindows)
	if err != nil {
		return autopilot.Config{}, usagef("--autopilot-windows: %v", err)
	}
	if c.AutoMaxGiB <= 0 || c.AutoMaxMoves <= 0 || c.AutoTolerance <= 0 || c.AutoTrigger < c.AutoTolerance {
		return autopilot.Config{}, usagef("the autopilot's budgets and tolerance must be > 0, and --autopilot-trigger at least --autopilot-tolerance")
	}
	return autopilot.Config{Mode: mode, MaxMoves: c.AutoMaxMoves, MaxBytes: uint64(c.AutoMaxGiB * (1 << 30)), Window: c.AutoWindow,
		Cooldown: c.AutoCooldown, Tolerance: c.AutoTolerance, Trigger: c.AutoTrigger, Sustain: c.AutoSustain, Settle: c.AutoSettle, Startup: c.AutoStartup,
		Windows: windows}, nil
}

// Close closes the NATS connection; it is idempotent.
func (c *ServeCommand) Close() error {
	c.closeOnce.Do(func() {
		if c.nc != nil {
			dctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			_ = c.nc.FlushWithContext(dctx)
			cancel()
			c.nc.Close()
		}
	})
	return nil
}

func sanitizeName(s string) string {
	var out []rune
	for _, r := range s {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' {
			out = append(out, r)
		}
	}
	if len(out) > 64 {
		out = out[:64]
	}
	return string(out)
}
