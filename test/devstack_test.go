package test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats"
)

// buildBinaries builds every binary of the platform into dir.
func buildBinaries(t *testing.T, dir string) {
	t.Helper()
	bins := map[string]string{
		"gateway": "./gateway/cmd/gateway", "rebalance": "./rebalancer/cmd/rebalance", "devstack": "./deploy/devstack",
		"aggregate": "./services/aggregate/cmd/aggregate", "projection": "./services/projection/cmd/projection",
		"runner": "./services/runner/cmd/runner",
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

// TestDevStackTryThis is `make run` from a fresh start: it starts the dev stack, runs every
// command of the "try this" block it prints, and stops it with Ctrl-C.
func TestDevStackTryThis(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the whole platform")
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "bin")
	buildBinaries(t, bin)
	ports, err := embednats.FreePorts("127.0.0.1", 3)
	if err != nil {
		t.Fatal(err)
	}
	base, err := embednats.FreePorts("127.0.0.1", 1)
	if err != nil {
		t.Fatal(err)
	}
	stack := exec.Command(filepath.Join(bin, "devstack"), "--bin", bin, "--data", filepath.Join(dir, "data"),
		"--nats-port", fmt.Sprint(ports[0]), "--gateway-port", fmt.Sprint(ports[1]), "--rebalancer-port", fmt.Sprint(ports[2]),
		"--shard-base-port", fmt.Sprint(base[0]+100), "--log-level", "warn")
	stdout, err := stack.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	logs := &syncBuilder{b: &strings.Builder{}}
	stack.Stderr = logs
	if err := stack.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	t.Cleanup(func() {
		_ = stack.Process.Signal(syscall.SIGKILL)
	})

	// Read the banner up to its last line.
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
		exited <- stack.Wait()
	}()
	var lines []string
	select {
	case lines = <-banner:
	case err := <-exited:
		t.Fatalf("devstack exited before printing its banner: %v\n%s", err, logs.String())
	case <-time.After(3 * time.Minute):
		t.Fatalf("no banner within 3 minutes\n%s", logs.String())
	}

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
	} {
		if !want.Match(out) {
			t.Errorf("try-this output lacks %s:\n%s", want, out)
		}
	}

	// Ctrl-C stops every process cleanly.
	_ = stack.Process.Signal(os.Interrupt)
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("devstack exit after Ctrl-C: %v\n%s", err, logs.String())
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("devstack did not stop within 60s of Ctrl-C\n%s", logs.String())
	}
	if pids, _ := exec.Command("pgrep", "-f", bin).Output(); len(strings.TrimSpace(string(pids))) > 0 {
		t.Fatalf("processes left running after Ctrl-C: %s", pids)
	}
}
