package test

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats"
)

// buildBinaries builds every binary of the platform into dir.
func buildBinaries(t testing.TB, dir string) {
	t.Helper()
	bins := map[string]string{
		"gateway": "./gateway/cmd/gateway", "rebalance": "./rebalancer/cmd/rebalance", "devstack": "./deploy/devstack",
		"aggregate": "./services/aggregate/cmd/aggregate", "projection": "./services/projection/cmd/projection",
		"runner": "./services/runner/cmd/runner", "grpcall": "./proto/cmd/grpcall",
	}
	args := []string{"build", "-o", dir + string(os.PathSeparator)}
	for _, pkg := range bins {
		args = append(args, pkg)
	}
	cmd := exec.Command("go", args...)
	cmd.Dir = ".."
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
}

// stack is the dev stack running as processes for a test.
type stack struct {
	dir, bin            string
	gateway, rebalancer string // base URLs
	natsURL             string
	natsCreds           string // the admin credentials devstack wrote (it runs NATS secured)
	banner              []string
	logs                *syncBuilder
	cmd                 *exec.Cmd
	exited              chan error
}

// startStack builds the binaries and starts bin/devstack on free ports, returning once it
// printed its banner (every process ready, demo tenants seeded). It is killed at test end.
// A port found free can be taken before the process binds it (devstack picks the cluster's
// ports the same way, and other tests run beside): a start that fails on an address in use
// is tried again on new ports, at most three times.
func startStack(t testing.TB, extra ...string) *stack {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "bin")
	buildBinaries(t, bin)
	for attempt := 1; ; attempt++ {
		s, err := tryStack(t, bin, extra...)
		if err == nil {
			return s
		}
		if attempt == 3 || !strings.Contains(s.logs.String(), "address already in use") {
			t.Fatalf("%v\n%s", err, s.logs.String())
		}
		t.Logf("devstack start %d met a port taken meanwhile; again on new ports", attempt)
	}
}

func tryStack(t testing.TB, bin string, extra ...string) (*stack, error) {
	t.Helper()
	dir := t.TempDir()
	s := &stack{dir: dir, bin: bin, logs: &syncBuilder{b: &strings.Builder{}}, exited: make(chan error, 1)}
	ports, err := embednats.FreePorts("127.0.0.1", 3)
	if err != nil {
		t.Fatal(err)
	}
	s.gateway = fmt.Sprintf("http://127.0.0.1:%d", ports[1])
	s.rebalancer = fmt.Sprintf("http://127.0.0.1:%d", ports[2])
	s.natsURL = fmt.Sprintf("nats://127.0.0.1:%d", ports[0])
	s.natsCreds = filepath.Join(dir, "data", "creds", "rebalancer.creds")
	if !slices.Contains(extra, "--autopilot") {
		// Tests that move tenants themselves run without the autopilot (the dev stack runs it
		// on): its balance and fill would move the same tenants.
		extra = append(extra, "--autopilot", "off")
	}
	args := append([]string{"--bin", s.bin, "--data", filepath.Join(dir, "data"),
		"--nats-port", fmt.Sprint(ports[0]), "--gateway-port", fmt.Sprint(ports[1]), "--rebalancer-port", fmt.Sprint(ports[2]),
		"--shard-base-port", "0", "--log-level", cmp.Or(os.Getenv("TM_STACK_LOG_LEVEL"), "warn"), "--admin-token", stackAdminToken}, extra...)
	s.cmd = exec.Command(filepath.Join(s.bin, "devstack"), args...)
	stdout, err := s.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	s.cmd.Stderr = s.logs
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = s.cmd.Process.Signal(syscall.SIGKILL)
		logs := s.logs.String()
		if t.Failed() {
			t.Logf("dev stack logs (last 8 KiB):\n%s", logs[max(0, len(logs)-8<<10):])
		}
		if dir := os.Getenv("TM_STACK_LOGS"); dir != "" { // all of them, pass or fail, for a closer look
			name := filepath.Join(dir, strings.ReplaceAll(t.Name(), "/", "_")+".log")
			if err := os.WriteFile(name, []byte(logs), 0o644); err == nil {
				t.Logf("dev stack logs written to %s", name)
			}
		}
	})
	banner := make(chan []string, 1)
	go func() {
		var lines []string
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines = append(lines, sc.Text())
			if strings.Contains(sc.Text(), "rebalance status") {
				banner <- lines
			}
		}
		s.exited <- s.cmd.Wait()
	}()
	select {
	case s.banner = <-banner:
		return s, nil
	case err := <-s.exited:
		return s, fmt.Errorf("devstack exited before printing its banner: %v", err)
	case <-time.After(3 * time.Minute):
		_ = s.cmd.Process.Signal(syscall.SIGKILL)
		return s, errors.New("no banner within 3 minutes")
	}
}

// stop sends Ctrl-C and checks that every process stopped.
func (s *stack) stop(t testing.TB) {
	t.Helper()
	_ = s.cmd.Process.Signal(os.Interrupt)
	select {
	case err := <-s.exited:
		if err != nil {
			t.Fatalf("devstack exit after Ctrl-C: %v\n%s", err, s.logs.String())
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("devstack did not stop within 60s of Ctrl-C\n%s", s.logs.String())
	}
	if pids, _ := exec.Command("pgrep", "-f", s.bin).Output(); len(strings.TrimSpace(string(pids))) > 0 {
		t.Fatalf("processes left running after Ctrl-C: %s", pids)
	}
}

// kill kills devstack as a crash or kill -9 would, without a word to its children, and checks
// that they stop anyway (the kernel sends them SIGTERM when devstack dies) within 60 s.
func (s *stack) kill(t testing.TB) {
	t.Helper()
	before, _ := exec.Command("pgrep", "-f", s.bin).Output()
	if len(strings.Fields(string(before))) < 2 {
		t.Fatalf("before the kill, pgrep finds %q running from %s: want devstack and its children", before, s.bin)
	}
	_ = s.cmd.Process.Signal(syscall.SIGKILL)
	<-s.exited
	killed := time.Now()
	deadline := killed.Add(60 * time.Second)
	for {
		left, _ := exec.Command("pgrep", "-f", s.bin).Output()
		if len(strings.TrimSpace(string(left))) == 0 {
			t.Logf("devstack killed: its %d children stopped within %s", len(strings.Fields(string(before)))-1, time.Since(killed).Round(100*time.Millisecond))
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("processes left running 60s after devstack was killed: %s", left)
		}
		time.Sleep(100 * time.Millisecond) // other processes' exits: nothing to wait on but polling
	}
}

// TestDevStackTryThis is `make run` from a fresh start: it starts the dev stack, runs every
// command of the "try this" block it prints, and stops it with Ctrl-C.
func TestDevStackTryThis(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the whole platform")
	}
	s := startStack(t)
	lines, dir, logs := s.banner, s.dir, s.logs

	// Run the "try this" block as a person would, in one shell: the curl commands, the export,
	// and the rebalance commands, with the plan id printed by `plan` fed to `apply`.
	var script []string
	try := false
	for i := 0; i < len(lines); i++ {
		l := strings.TrimSpace(lines[i])
		if l == "Try this:" {
			try = true
			continue
		}
		if !try || l == "" {
			continue
		}
		for strings.HasSuffix(l, `\`) && i+1 < len(lines) {
			i++
			l = strings.TrimSuffix(l, `\`) + " " + strings.TrimSpace(lines[i])
		}
		switch {
		case strings.HasPrefix(l, "curl "):
			l = strings.Replace(l, "curl -s", "curl -sS --fail-with-body", 1)
		case strings.Contains(l, "rebalance plan "):
			l += ` | tee /dev/stderr | sed -n 's/^plan \(p[^ ]*\) stored.*/\1/p' > plan.id`
		case strings.Contains(l, "<plan id printed above>"):
			l = strings.Replace(l, "<plan id printed above>", "$(cat plan.id)", 1)
		}
		script = append(script, l)
	}
	if len(script) < 8 {
		t.Fatalf("the banner's try-this block has %d commands:\n%s", len(script), strings.Join(lines, "\n"))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	sh := exec.CommandContext(ctx, "bash", "-euo", "pipefail", "-c", strings.Join(script, "\n"))
	sh.Dir = dir
	sh.Env = append(os.Environ(), "TM_LOG_LEVEL=warn")
	out, err := sh.CombinedOutput()
	if err != nil {
		t.Fatalf("try-this failed: %v\n%s\n--- script ---\n%s\n--- stack logs ---\n%s", err, out, strings.Join(script, "\n"), logs.String())
	}
	for _, want := range []*regexp.Regexp{
		regexp.MustCompile(`"event": "deposited"`), regexp.MustCompile(`"balance": 1250`), regexp.MustCompile(`"view": "accounts"`),
		regexp.MustCompile(`"status": "pending"`), regexp.MustCompile(`3 moves: 3 done`),
		// The gRPC calls, one per kind (grpcall prints protojson, whose spacing varies).
		regexp.MustCompile(`served by aggregate\.[^\n]*\n\{[^}]*"event":\s*"deposited"`), regexp.MustCompile(`"items_json":\s*"\[`),
		regexp.MustCompile(`served by runner\.[^\n]*\n\{[^}]*"status":\s*"pending"`),
	} {
		if !want.Match(out) {
			t.Errorf("try-this output lacks %s:\n%s", want, out)
		}
	}

	// Ctrl-C stops every process cleanly.
	s.stop(t)
}
