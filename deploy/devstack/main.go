// Command devstack is `make run`: the whole platform as one process tree on one machine. It
// starts an embedded nats-server with JetStream (data under .data/), the gateway, the
// rebalancer API and dashboard, and two shards of each service kind as child processes; waits
// until each is ready; seeds a few demo tenants through the gateway; prints the URLs and a
// "try this" block; and on Ctrl-C stops every child (SIGTERM, then SIGKILL after a bound)
// and the server.
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

	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/internal/embednats"
	"github.com/tenantmesh/tenantmesh/internal/envflag"
	"github.com/tenantmesh/tenantmesh/internal/tmlog"
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
	envflag.String(fs, &c.adminToken, "admin-token", "dev-admin-token", "bearer token for /admin/* on every process")
	envflag.String(fs, &c.logLevel, "log-level", "info", "log level of every process")
	envflag.Duration(fs, &c.stopTimeout, "stop-timeout", 20*time.Second, "how long children get to stop before SIGKILL")
	envflag.Duration(fs, &c.readyTimeout, "ready-timeout", 60*time.Second, "how long to wait for every process to be ready")
	envflag.Bool(fs, &c.noSeed, "no-seed", false, "do not create demo tenants")
	if err := fs.Parse(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		os.Exit(2)
	}
	if err := run(ctx, c); err != nil {
		fmt.Fprintln(os.Stderr, "devstack:", err)
		os.Exit(1)
	}
}

// proc is one child process.
type proc struct {
	name  string
	args  []string
	ready string // URL answering 200 once the process is ready
	cmd   *exec.Cmd
	done  chan struct{}
	err   error
}

func run(ctx context.Context, c config) error {
	log, err := tmlog.New(os.Stderr, c.logLevel, "auto")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(c.data, 0o755); err != nil {
		return err
	}
	natsLog, _ := tmlog.New(os.Stderr, "warn", "auto") // the server's banner and notices are noise here
	srv, err := embednats.Start(embednats.Config{Name: "devstack", Host: c.host, Port: c.natsPort,
		StoreDir: filepath.Join(c.data, "nats"), Logger: natsLog.With("proc", "nats")})
	if err != nil {
		return fmt.Errorf("start NATS on port %d (is another stack running? --nats-port changes it): %w", c.natsPort, err)
	}
	defer srv.Stop()
	natsURL := srv.URL()
	log.Info("NATS ready", "url", natsURL, "data", filepath.Join(c.data, "nats"))

	procs := c.processes(natsURL, log)
	var wg sync.WaitGroup
	for _, p := range procs {
		if err := p.start(ctx, &wg); err != nil {
			stopAll(procs, c.stopTimeout, log)
			return err
		}
	}
	defer func() {
		stopAll(procs, c.stopTimeout, log)
		wg.Wait()
	}()
	if err := waitReady(ctx, procs, c.readyTimeout); err != nil {
		return err
	}
	gw := fmt.Sprintf("http://%s:%d", c.host, c.gatewayPort)
	if !c.noSeed {
		if err := seed(ctx, gw); err != nil {
			log.Warn("seeding demo tenants failed", "err", err)
		}
	}
	printBanner(os.Stdout, c, natsURL, gw, moveTargets(ctx, natsURL, c.shards))
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
func (c config) processes(natsURL string, log *slog.Logger) []*proc {
	common := []string{"--nats-url", natsURL, "--log-level", c.logLevel, "--log-format", "text"}
	addr := func(port int) string { return fmt.Sprintf("%s:%d", c.host, port) }
	url := func(port int, path string) string { return fmt.Sprintf("http://%s:%d%s", c.host, port, path) }
	var out []*proc
	if p := c.binary("gateway"); p != "" {
		out = append(out, &proc{name: "gateway", args: append([]string{p, "--addr", addr(c.gatewayPort)}, common...),
			ready: url(c.gatewayPort, "/readyz")})
	}
	if p := c.binary("rebalance"); p != "" {
		out = append(out, &proc{name: "rebalancer", args: append([]string{p, "serve", "--addr", addr(c.rebalancerPort),
			"--holder", "devstack-rebalancer", "--sweep-every", "5s"}, common...), ready: url(c.rebalancerPort, "/readyz")})
	}
	next := c.shardPorts(3 * c.shards)
	for _, kind := range []string{"aggregate", "projection", "runner"} {
		bin := c.binary(kind)
		if bin == "" {
			log.Warn("no binary; skipping its shards", "kind", kind, "bin", filepath.Join(c.bin, kind))
			continue
		}
		for i := 1; i <= c.shards; i++ {
			name := fmt.Sprintf("%s-%d", kind, i)
			port := next()
			out = append(out, &proc{name: name, args: append([]string{bin, "--shard", name, "--instance", "a",
				"--addr", addr(port), "--admin-token", c.adminToken}, common...), ready: url(port, "/readyz")})
		}
	}
	return out
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

func (p *proc) start(ctx context.Context, wg *sync.WaitGroup) error {
	p.cmd = exec.Command(p.args[0], p.args[1:]...)
	p.cmd.Env = append(os.Environ(), "TM_LOG_FORMAT=text")
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // Ctrl-C goes to us; we stop children in order
	out, err := p.cmd.StdoutPipe()
	if err != nil {
		return err
	}
	p.cmd.Stderr = p.cmd.Stdout
	if err := p.cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", p.name, err)
	}
	p.done = make(chan struct{})
	wg.Go(func() { prefixLines(os.Stderr, p.name, out) })
	wg.Go(func() {
		p.err = p.cmd.Wait()
		close(p.done)
	})
	return nil
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

func waitReady(ctx context.Context, procs []*proc, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	hc := &http.Client{Timeout: time.Second}
	for _, p := range procs {
		for {
			select {
			case <-p.done:
				return fmt.Errorf("%s exited before it was ready: %v", p.name, p.err)
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
		go func() {
			<-p.done
			ch <- p
		}()
	}
	return ch
}

// stopAll sends SIGTERM to every child (shards first, the gateway last so it can route
// requests while shards drain), then SIGKILL to those still running after timeout.
func stopAll(procs []*proc, timeout time.Duration, log *slog.Logger) {
	for i := len(procs) - 1; i >= 0; i-- {
		if p := procs[i]; p.cmd != nil && p.cmd.Process != nil && p.done != nil {
			_ = p.cmd.Process.Signal(syscall.SIGTERM)
		}
	}
	deadline := time.After(timeout)
	for _, p := range procs {
		if p.done == nil {
			continue
		}
		select {
		case <-p.done:
		case <-deadline:
			log.Warn("child did not stop in time; killing it", "proc", p.name)
			_ = p.cmd.Process.Kill()
			<-p.done
		}
	}
}

// seed opens a demo account for a few tenants through the gateway (idempotent), and makes a
// query and a job for each, so every tenant is placed in all three kinds.
func seed(ctx context.Context, gw string) error {
	hc := &http.Client{Timeout: 5 * time.Second}
	for _, tenant := range []string{"acme", "globex", "initech"} {
		for _, call := range []struct{ path, body string }{
			{"/commands", `{"aggregate_type":"account","aggregate_id":"main","command":"open","payload":{"owner":"` + tenant + `"},"idempotency_key":"demo-open"}`},
			{"/commands", `{"aggregate_type":"account","aggregate_id":"main","command":"deposit","payload":{"amount":1000},"idempotency_key":"demo-deposit"}`},
			{"/query/accounts", `{"limit":1}`},
			{"/jobs", `{"type":"log","payload":{"message":"welcome ` + tenant + `"}}`},
		} {
			req, _ := http.NewRequestWithContext(ctx, "POST", gw+call.path, strings.NewReader(call.body))
			req.Header.Set("x-tenant-id", tenant)
			req.Header.Set("content-type", "application/json")
			resp, err := hc.Do(req)
			if err != nil {
				return err
			}
			b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
			resp.Body.Close()
			if resp.StatusCode >= 300 {
				return fmt.Errorf("seed %s: %d %s", tenant, resp.StatusCode, bytes.TrimSpace(b))
			}
		}
	}
	return nil
}

// moveTargets names, for each kind, a shard other than acme's current one ("kind=shard,...").
func moveTargets(ctx context.Context, natsURL string, shards int) string {
	nc, err := nats.Connect(natsURL, nats.Timeout(2*time.Second))
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
			if p, perr := st.Placement(octx, kind, "acme"); perr == nil {
				n, _ := strconv.Atoi(strings.TrimPrefix(p.Shard, kind+"-"))
				to = fmt.Sprintf("%s-%d", kind, n%max(shards, 1)+1)
			}
		}
		parts = append(parts, kind+"="+to)
	}
	return strings.Join(parts, ",")
}

func printBanner(w io.Writer, c config, natsURL, gw, targets string) {
	dash := "http://" + c.host + ":" + strconv.Itoa(c.rebalancerPort)
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
  export TM_NATS_URL=%s TM_REBALANCER_URL=%s
  %s/rebalance instances
  %s/rebalance plan move acme --to %s
  %s/rebalance apply <plan id printed above> --yes
  %s/rebalance status
`, gw, dash, natsURL, c.data, c.adminToken, gw, gw, gw, gw, natsURL, dash, c.bin, c.bin, targets, c.bin, c.bin)
}
