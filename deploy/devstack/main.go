// Command devstack is `make run`: the whole platform as one process tree on one machine. It
// starts an embedded nats-server with JetStream (data under .data/), the gateway, the
// rebalancer API and dashboard, and two shards of each service kind as child processes; waits
// until each is ready; seeds a few demo tenants through the gateway; prints the URLs and a
// "try this" block; and on Ctrl-C stops every child (SIGTERM, then SIGKILL after a bound)
// and the server.
//
// For chaos tests it can also run a bigger, supervised stack: --instances N runs N instances
// of every shard (named a, b, c...), --gateways N runs N gateways (the first on --gateway-port,
// the others on free ports), --nats-cluster runs a 3-node embedded NATS cluster (children get
// all three URLs and --replicas 3). A child that dies does not stop the stack: it stays down
// (--on-exit keep, the default: kill -9 a shard and watch the autopilot fail its tenants over),
// is restarted after --restart-delay (--on-exit restart, or --keep-going), or stops the stack
// (--on-exit stop). --state-file writes, on every change, a JSON
// document naming each child's PID and URL and each NATS node's client URL; --control-addr
// serves a small localhost HTTP API:
//
//	GET  /state                  the same document, with which NATS node is JetStream meta leader
//	POST /nats/{n}/stop          stops embedded NATS node n (1-based)
//	POST /nats/{n}/start         starts it again on the same ports and store
//	POST /children/{name}/start  starts a child that died (with --on-exit keep)
package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats"
	"github.com/tenantmesh/tenantmesh/internal/envflag"
	"github.com/tenantmesh/tenantmesh/internal/natsauth"
	"github.com/tenantmesh/tenantmesh/internal/tmlog"
	"github.com/tenantmesh/tenantmesh/shardkit/natsconn"
	"github.com/tenantmesh/tenantmesh/shardkit/natsperm"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

type config struct {
	data, bin, host           string
	natsPort, gatewayPort     int
	rebalancerPort, basePort  int
	shards                    int
	adminToken, logLevel      string
	stopTimeout, readyTimeout time.Duration
	noSeed                    bool

	instances, gateways    int
	kindCounts, moreKinds  string
	natsCluster, keepGoing bool
	onExit, autopilot      string
	rebalancerFlags        string
	natsInsecure, natsTLS  bool
	restartDelay           time.Duration
	leaseTTL               time.Duration
	stateFile, controlAddr string
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var c config
	fs := flag.NewFlagSet("devstack", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: devstack [flags]\n\nStarts tenantmesh on one machine (what `make run` does). Ctrl-C stops it.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	envflag.String(fs, &c.data, "data", ".data", "directory for NATS data and logs")
	envflag.String(fs, &c.bin, "bin", "bin", "directory holding the built binaries")
	envflag.String(fs, &c.host, "host", "127.0.0.1", "address every process listens on")
	envflag.Int(fs, &c.natsPort, "nats-port", 4222, "NATS client port")
	envflag.Int(fs, &c.gatewayPort, "gateway-port", 8080, "gateway port")
	envflag.Int(fs, &c.rebalancerPort, "rebalancer-port", 8090, "rebalancer API and dashboard port")
	envflag.Int(fs, &c.basePort, "shard-base-port", 9100, "first port for shard instances (0: free ports)")
	envflag.Int(fs, &c.shards, "shards", 2, "shards of each kind")
	envflag.String(fs, &c.adminToken, "admin-token", "dev-admin-token", "bearer token for the shards' /admin/* and the rebalancer's write API")
	envflag.String(fs, &c.logLevel, "log-level", "info", "log level of every process")
	envflag.Duration(fs, &c.stopTimeout, "stop-timeout", 20*time.Second, "how long children get to stop before SIGKILL")
	envflag.Duration(fs, &c.readyTimeout, "ready-timeout", 60*time.Second, "how long to wait for every process to be ready")
	envflag.Bool(fs, &c.noSeed, "no-seed", false, "do not create demo tenants")
	envflag.Int(fs, &c.instances, "instances", 1, "instances of every shard (named a, b, c...)")
	envflag.String(fs, &c.kindCounts, "kind-instances", "", "instances per shard of some kinds, overriding --instances: aggregate=3,runner=2")
	envflag.String(fs, &c.moreKinds, "more-kinds", "", "kinds beyond the built-in ones whose shards run outside the stack (your own services, e.g. notes): the gateway's credentials cover their placements")
	envflag.Int(fs, &c.gateways, "gateways", 1, "gateways (the first on --gateway-port, the others on free ports)")
	envflag.Bool(fs, &c.natsCluster, "nats-cluster", false, "run a 3-node embedded NATS cluster (replicas 3) instead of one server; --nats-port is then unused")
	envflag.Bool(fs, &c.natsInsecure, "nats-insecure", false, "run NATS without authentication (every process connects as anyone); by default it trusts a chain kept in <data>/auth and each process gets its role's credentials in <data>/creds")
	envflag.Bool(fs, &c.natsTLS, "nats-tls", false, "serve NATS over TLS with a CA and certificate generated in <data>/auth/tls")
	envflag.String(fs, &c.onExit, "on-exit", "keep", "what a child's death does: keep (the rest runs on; a dead shard's tenants fail over), restart (after --restart-delay) or stop (the whole stack)")
	envflag.Bool(fs, &c.keepGoing, "keep-going", false, "same as --on-exit restart")
	envflag.Duration(fs, &c.restartDelay, "restart-delay", time.Second, "with --on-exit restart, how long to wait before restarting a dead child")
	envflag.String(fs, &c.autopilot, "autopilot", "on", "the rebalancer's autopilot: on (fails over dead shards, fills new ones, balances), dry-run (proposes plans) or off")
	envflag.String(fs, &c.rebalancerFlags, "rebalancer-flags", "", `more flags for "rebalance serve", space-separated (e.g. "--autopilot-sustain 5s --autopilot-cooldown 30s")`)
	envflag.Duration(fs, &c.leaseTTL, "lease-ttl", 10*time.Second, "the rebalancer's leader lease lifetime")
	envflag.String(fs, &c.stateFile, "state-file", "", "write each child's PID and URL and the NATS nodes' URLs to this JSON file on every change")
	envflag.String(fs, &c.controlAddr, "control-addr", "", "serve the control API (GET /state, POST /nats/{n}/stop|start) on this localhost address")
	if err := fs.Parse(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		os.Exit(2)
	}
	if c.keepGoing {
		c.onExit = "restart"
	}
	switch c.onExit {
	case "keep", "restart", "stop":
	default:
		fmt.Fprintf(os.Stderr, "devstack: --on-exit %q: use keep, restart or stop\n", c.onExit)
		os.Exit(2)
	}
	if err := run(ctx, c); err != nil {
		fmt.Fprintln(os.Stderr, "devstack:", err)
		os.Exit(1)
	}
}

// proc is one child process. With --keep-going it is restarted when it dies; mu guards the
// fields that change on a restart.
type proc struct {
	name  string
	args  []string
	ready string // URL answering 200 once the process is ready

	mu       sync.Mutex
	cmd      *exec.Cmd
	done     chan struct{}
	err      error
	restarts int
	again    chan struct{} // closed when the control API starts the dead child again
}

func run(ctx context.Context, c config) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	log, err := tmlog.New(os.Stderr, c.logLevel, "auto")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(c.data, 0o755); err != nil {
		return err
	}
	sec, err := newSecurity(c)
	if err != nil {
		return err
	}
	natsLog, _ := tmlog.New(os.Stderr, "warn", "auto") // the server's banner and notices are noise here
	nodes, err := startNATS(ctx, c, sec, natsLog.With("proc", "nats"))
	if err != nil {
		return err
	}
	defer nodes.stopAll()
	admin, err := sec.conn(nodes.urls(), natsauth.Admin())
	if err != nil {
		return err
	}
	if err := waitJetStream(ctx, admin, 60*time.Second); err != nil {
		return err
	}
	log.Info("NATS ready", "url", admin.URL, "data", filepath.Join(c.data, "nats"), "secured", sec != nil, "tls", c.natsTLS)

	procs, err := c.processes(sec, admin.URL, log)
	if err != nil {
		return err
	}
	sup := &supervisor{c: c, log: log, procs: procs, nodes: nodes}
	var wg sync.WaitGroup
	for _, p := range procs {
		if err := p.start(&wg); err != nil {
			stopAll(procs, c.stopTimeout, log)
			return err
		}
	}
	sup.writeState()
	defer func() {
		sup.stopping.Store(true)
		cancel()
		stopAll(procs, c.stopTimeout, log)
		wg.Wait()
	}()
	if c.onExit != "stop" {
		for _, p := range procs {
			wg.Go(func() { sup.supervise(ctx, p, &wg) })
		}
	}
	if err := waitReady(ctx, procs, c.readyTimeout, c.onExit == "restart"); err != nil {
		return err
	}
	if c.controlAddr != "" {
		if err := sup.serveControl(ctx, &wg); err != nil {
			return err
		}
	}
	gw := fmt.Sprintf("http://%s:%d", c.host, c.gatewayPort)
	if !c.noSeed {
		if err := seed(ctx, gw); err != nil {
			log.Warn("seeding demo tenants failed", "err", err)
		}
	}
	printBanner(os.Stdout, c, admin, gw, moveTargets(ctx, admin, c.shards), extraGateways(procs))
	if c.onExit != "stop" {
		<-ctx.Done()
		log.Info("stopping")
		return nil
	}
	select {
	case <-ctx.Done():
		log.Info("stopping")
	case p := <-exited(procs):
		return fmt.Errorf("%s exited: %v (see its log lines above)", p.name, p.err)
	}
	return nil
}

// processes lists the children: gateway, rebalancer, and shards of each kind whose binary
// has been built.
func (c config) processes(sec *security, natsURL string, log *slog.Logger) ([]*proc, error) {
	common := []string{"--log-level", c.logLevel, "--log-format", "text"}
	if c.natsCluster {
		common = append(common, "--replicas", "3")
	}
	as := func(role natsperm.Role) []string {
		o, err := sec.conn(natsURL, role)
		if err != nil {
			log.Error("no credentials; the process will be refused", "role", role.Name, "err", err)
		}
		return append(args(o), common...)
	}
	gk, err := newGateKeys(filepath.Join(c.data, "auth"))
	if err != nil {
		return nil, err
	}
	if os.Getenv("TM_RUNNER_WEBHOOK_ALLOW") == "" { // runner.EnvWebhookAllow
		// The stack's runners may post webhooks to receivers on this host (try-this, the
		// end-to-end tests); a deployment's reach public addresses only.
		_ = os.Setenv("TM_RUNNER_WEBHOOK_ALLOW", "public,127.0.0.0/8,::1")
	}
	addr := func(port int) string { return fmt.Sprintf("%s:%d", c.host, port) }
	url := func(port int, path string) string { return fmt.Sprintf("http://%s:%d%s", c.host, port, path) }
	var out []*proc
	if p := c.binary("gateway"); p != "" {
		ports := []int{c.gatewayPort}
		if c.gateways > 1 {
			free, _ := embednats.FreePorts(c.host, c.gateways-1)
			ports = append(ports, free...)
		}
		for i, port := range ports {
			name := "gateway"
			if i > 0 {
				name = fmt.Sprintf("gateway-%d", i+1)
			}
			// The dev stack has no identity provider: it says so (docs/security.md).
			out = append(out, &proc{name: name, args: append([]string{p, "--addr", addr(port), "--admin-token", c.adminToken, "--trust-tenant-header"}, append(gk.gateway(), as(c.gatewayRole())...)...),
				ready: url(port, "/readyz")})
		}
	}
	if p := c.binary("rebalance"); p != "" {
		// The autopilot on (a new deployment starts in dry-run), with the dev stack's short
		// windows so its fill and balance show within a minute.
		out = append(out, &proc{name: "rebalancer", args: append([]string{p, "serve", "--addr", addr(c.rebalancerPort),
			"--holder", "devstack-rebalancer", "--sweep-every", "5s", "--lease-ttl", c.leaseTTL.String(), "--admin-token", c.adminToken,
			"--autopilot", c.autopilot, "--autopilot-sustain", "20s", "--autopilot-cooldown", "2m"}, append(strings.Fields(c.rebalancerFlags), as(natsperm.Rebalancer())...)...), ready: url(c.rebalancerPort, "/readyz")})
	}
	perKind, err := c.kindInstances()
	if err != nil {
		return nil, err
	}
	next := c.shardPorts(c.shards * (perKind["aggregate"] + perKind["projection"] + perKind["runner"]))
	for _, kind := range []string{"aggregate", "projection", "runner"} {
		instances := perKind[kind]
		bin := c.binary(kind)
		if bin == "" {
			log.Warn("no binary; skipping its shards", "kind", kind, "bin", filepath.Join(c.bin, kind))
			continue
		}
		for i := 1; i <= c.shards; i++ {
			shard := fmt.Sprintf("%s-%d", kind, i)
			for j := range instances {
				inst := string(rune('a' + j))
				name := shard
				if instances > 1 {
					name += "." + inst
				}
				port := next()
				keyArgs, err := gk.shard(kind)
				if err != nil {
					return nil, err
				}
				out = append(out, &proc{name: name, args: append(append([]string{bin, "--shard", shard, "--instance", inst,
					"--addr", addr(port), "--admin-token", c.adminToken}, keyArgs...), as(natsperm.Shard(kind, shard, natsperm.KindAssets(kind)))...), ready: url(port, "/readyz")})
			}
		}
	}
	return out, nil
}

// gatewayRole is the gateway's: the built-in kinds and --more-kinds.
func (c config) gatewayRole() natsperm.Role {
	var more []string
	for _, k := range strings.Split(c.moreKinds, ",") {
		if k = strings.TrimSpace(k); k != "" {
			more = append(more, k)
		}
	}
	return natsperm.DefaultGateway(more...)
}

// kindInstances is how many instances each shard of each kind runs: --instances, or the kind's
// entry in --kind-instances.
func (c config) kindInstances() (map[string]int, error) {
	m := map[string]int{}
	for _, k := range []string{"aggregate", "projection", "runner"} {
		m[k] = max(c.instances, 1)
	}
	for _, kv := range strings.Split(c.kindCounts, ",") {
		if kv = strings.TrimSpace(kv); kv == "" {
			continue
		}
		k, v, _ := strings.Cut(kv, "=")
		n, err := strconv.Atoi(v)
		if _, known := m[k]; !known || err != nil || n < 1 || n > 26 {
			return nil, fmt.Errorf("--kind-instances %q: write kind=N (aggregate, projection or runner; 1 to 26)", kv)
		}
		m[k] = n
	}
	return m, nil
}

// shardPorts hands out n ports: consecutive from --shard-base-port, or free ones picked now
// when it is 0 (for tests running beside others).
func (c config) shardPorts(n int) func() int {
	var ports []int
	if c.basePort == 0 {
		ports, _ = embednats.FreePorts(c.host, n)
	}
	i := 0
	return func() int {
		defer func() { i++ }()
		if i < len(ports) {
			return ports[i]
		}
		return c.basePort + i
	}
}

func (c config) binary(name string) string {
	p := filepath.Join(c.bin, name)
	if fi, err := os.Stat(p); err == nil && !fi.IsDir() {
		return p
	}
	return ""
}

func (p *proc) start(wg *sync.WaitGroup) error {
	cmd := exec.Command(p.args[0], p.args[1:]...)
	cmd.Env = append(os.Environ(), "TM_LOG_FORMAT=text")
	cmd.SysProcAttr = childAttr()
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", p.name, err)
	}
	done := make(chan struct{})
	p.mu.Lock()
	p.cmd, p.done, p.err = cmd, done, nil
	p.mu.Unlock()
	wg.Go(func() { prefixLines(os.Stderr, p.name, out) })
	wg.Go(func() {
		err := cmd.Wait()
		p.mu.Lock()
		p.err = err
		p.mu.Unlock()
		close(done)
	})
	return nil
}

// current returns the running command and its done channel.
func (p *proc) current() (*exec.Cmd, chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd, p.done
}

// restarted is closed once the control API starts p again (--on-exit keep).
func (p *proc) restarted() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.again == nil {
		p.again = make(chan struct{})
	}
	return p.again
}

var outMu sync.Mutex

// prefixLines copies r to w line by line, each prefixed with the process name.
func prefixLines(w io.Writer, name string, r io.Reader) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	prefix := fmt.Sprintf("%-13s| ", name)
	for sc.Scan() {
		outMu.Lock()
		fmt.Fprintln(w, prefix+sc.Text())
		outMu.Unlock()
	}
}

// waitReady waits until every child answers its ready URL. A child that exits fails the
// wait, unless keepGoing (the supervisor restarts it).
func waitReady(ctx context.Context, procs []*proc, timeout time.Duration, keepGoing bool) error {
	deadline := time.Now().Add(timeout)
	hc := &http.Client{Timeout: time.Second}
	for _, p := range procs {
		for {
			_, done := p.current()
			select {
			case <-done:
				if !keepGoing {
					return fmt.Errorf("%s exited before it was ready: %v", p.name, p.err)
				}
			case <-ctx.Done():
				return ctx.Err()
			default:
			}
			resp, err := hc.Get(p.ready)
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					break
				}
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("%s not ready at %s within %s", p.name, p.ready, timeout)
			}
			time.Sleep(100 * time.Millisecond) // polling another process's readiness
		}
	}
	return nil
}

func exited(procs []*proc) <-chan *proc {
	ch := make(chan *proc, len(procs))
	for _, p := range procs {
		_, done := p.current()
		go func() {
			<-done
			ch <- p
		}()
	}
	return ch
}

// stopAll stops every child: the rebalancer, then the others at once (shards first, the
// gateway last so it can route requests while shards drain), with SIGTERM, then SIGKILL to
// those still running after timeout.
func stopAll(procs []*proc, timeout time.Duration, log *slog.Logger) {
	// The rebalancer first, and alone: its autopilot would take the shards' clean exits for
	// deaths and fail their tenants over while the stack stops.
	var rb, rest []*proc
	for _, p := range procs {
		if p.name == "rebalancer" {
			rb = append(rb, p)
		} else {
			rest = append(rest, p)
		}
	}
	stopProcs(rb, timeout, log)
	stopProcs(rest, timeout, log)
}

// stopProcs sends SIGTERM to procs (in reverse order) and waits for them, killing those still
// running after timeout.
func stopProcs(procs []*proc, timeout time.Duration, log *slog.Logger) {
	for i := len(procs) - 1; i >= 0; i-- {
		if cmd, done := procs[i].current(); cmd != nil && cmd.Process != nil && done != nil {
			_ = cmd.Process.Signal(syscall.SIGTERM)
		}
	}
	deadline := time.After(timeout)
	for _, p := range procs {
		cmd, done := p.current()
		if done == nil {
			continue
		}
		select {
		case <-done:
		case <-deadline:
			log.Warn("child did not stop in time; killing it", "proc", p.name)
			_ = cmd.Process.Kill()
			<-done
		}
	}
}

// seed opens a demo account for a few tenants through the gateway (idempotent), and makes a
// query and a job for each, so every tenant is placed in all three kinds. A call answered 503
// with Retry-After (a new cluster still electing leaders) or not answered is sent again, with
// the same idempotency key, for up to 30 s.
func seed(ctx context.Context, gw string) error {
	hc := &http.Client{Timeout: 5 * time.Second}
	for _, tenant := range []string{"acme", "globex", "initech"} {
		for _, call := range []struct{ path, body string }{
			{"/commands", `{"aggregate_type":"account","aggregate_id":"main","command":"open","payload":{"owner":"` + tenant + `"},"idempotency_key":"demo-open"}`},
			{"/commands", `{"aggregate_type":"account","aggregate_id":"main","command":"deposit","payload":{"amount":1000},"idempotency_key":"demo-deposit"}`},
			{"/query/accounts", `{"limit":1}`},
			{"/jobs", `{"type":"log","payload":{"message":"welcome ` + tenant + `"},"idempotency_key":"demo-welcome"}`},
		} {
			if err := seedCall(ctx, hc, gw, tenant, call.path, call.body); err != nil {
				return err
			}
		}
	}
	return nil
}

func seedCall(ctx context.Context, hc *http.Client, gw, tenant, path, body string) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		req, _ := http.NewRequestWithContext(ctx, "POST", gw+path, strings.NewReader(body))
		req.Header.Set("x-tenant-id", tenant)
		req.Header.Set("content-type", "application/json")
		resp, err := hc.Do(req)
		var last error
		if err != nil {
			last = err
		} else {
			b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
			resp.Body.Close()
			switch {
			case resp.StatusCode < 300:
				return nil
			case resp.StatusCode == http.StatusServiceUnavailable && resp.Header.Get("Retry-After") != "":
				last = fmt.Errorf("seed %s %s: %d %s", tenant, path, resp.StatusCode, bytes.TrimSpace(b))
			default:
				return fmt.Errorf("seed %s %s: %d %s", tenant, path, resp.StatusCode, bytes.TrimSpace(b))
			}
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			return last
		}
		select {
		case <-time.After(250 * time.Millisecond):
		case <-ctx.Done():
			return last
		}
	}
}

// moveTargets names, for each kind, a shard other than acme's current one ("kind=shard,...").
func moveTargets(ctx context.Context, admin natsconn.Options, shards int) string {
	nc, err := natsconn.Dial(admin, "devstack", 2*time.Second)
	if err != nil {
		return "aggregate=aggregate-2,projection=projection-2,runner=runner-2"
	}
	defer nc.Close()
	octx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	st, err := schema.Open(octx, nc, schema.Options{})
	var parts []string
	for _, kind := range []string{"aggregate", "projection", "runner"} {
		to := kind + "-2"
		if err == nil {
			if p, perr := st.Placements(kind).Get(octx, "acme"); perr == nil {
				n, _ := strconv.Atoi(strings.TrimPrefix(p.Shard, kind+"-"))
				to = fmt.Sprintf("%s-%d", kind, n%max(shards, 1)+1)
			}
		}
		parts = append(parts, kind+"="+to)
	}
	return strings.Join(parts, ",")
}

func printBanner(w io.Writer, c config, admin natsconn.Options, gw, targets string, more []string) {
	natsURL := admin.URL
	export := "TM_NATS_URL=" + natsURL
	if admin.Creds != "" {
		export += " TM_NATS_CREDS=" + admin.Creds
	}
	if admin.TLSCA != "" {
		export += " TM_NATS_TLS_CA=" + admin.TLSCA
	}
	dash := "http://" + c.host + ":" + strconv.Itoa(c.rebalancerPort)
	gws := gw
	for _, g := range more {
		gws += "\n  gateway      " + g
	}
	fmt.Fprintf(w, `
tenantmesh is running. Ctrl-C stops everything.

  gateway      %s
  dashboard    %s
  NATS         %s   (data in %s/)
  admin token  %s

Try this:
  curl -s -X POST %s/commands -H 'x-tenant-id: acme' -H 'content-type: application/json' \
    -d '{"aggregate_type":"account","aggregate_id":"main","command":"deposit","payload":{"amount":250},"idempotency_key":"try-1"}'
  curl -s %s/aggregates/account/main -H 'x-tenant-id: acme'
  curl -s -X POST %s/query/accounts -H 'x-tenant-id: acme' -d '{"limit":10}'
  curl -s -X POST %s/jobs -H 'x-tenant-id: acme' -d '{"type":"log","payload":{"message":"hello"}}'
  %s/grpcall -H x-tenant-id=acme %s aggregate.gateway.v1.CommandService/SubmitCommand \
    '{"aggregate_type":"account","aggregate_id":"main","command":"deposit","payload_json":"{\"amount\":50}","idempotency_key":"try-grpc-1"}'
  %s/grpcall -H x-tenant-id=acme %s projection.v1.QueryService/Query '{"view":"accounts","query_json":"{\"limit\":10}"}'
  %s/grpcall -H x-tenant-id=acme %s runner.v1.JobService/CreateJob '{"type":"log","payload_json":"{\"message\":\"hello\"}"}'
  export %s TM_REBALANCER_URL=%s TM_ADMIN_TOKEN=%s
  %s/rebalance instances
  %s/rebalance plan move acme --to %s
  %s/rebalance apply <plan id printed above> --yes
  %s/rebalance status

Watch a failover (the autopilot is %s): kill a shard; its tenants come back on another
shard within seconds, and it is filled again once you start it:
  kill -9 $(pgrep -f 'aggregate --shard aggregate-1 ')
  curl -s %s/aggregates/account/main -H 'x-tenant-id: acme' -i | grep -i x-served-by
  %s/rebalance autopilot
`, gws, dash, natsURL, c.data, c.adminToken, gw, gw, gw, gw, c.bin, gw, c.bin, gw, c.bin, gw, export, dash, c.adminToken, c.bin, c.bin, targets, c.bin, c.bin,
		c.autopilot, gw, c.bin)
}
