package main

import (
	"bufio"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/natsperm"
)

// buildGateway builds this binary into a temporary directory.
func buildGateway(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "gateway")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// TestAttackNoEdgeIdentity (item 6): a gateway started without --jwt-* used to believe
// x-tenant-id from anyone, and said nothing. As a process on a real NATS server: without edge
// identity it refuses to start, naming the flags; with --trust-tenant-header it starts, says
// loudly that identities are not checked, and reports it in tm_gateway_edge_identity.
func TestAttackNoEdgeIdentity(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	_, url := kittest.Store(t) // provisions the buckets the gateway waits for
	creds := natstest.CredsFile(t, natsperm.DefaultGateway())
	bin := buildGateway(t)
	env := append(os.Environ(), "TM_NATS_URL="+url, "TM_NATS_CREDS="+creds)

	t.Run("refused without edge identity", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, bin, "--addr", "127.0.0.1:0")
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		if ctx.Err() != nil {
			t.Fatalf("the gateway started without edge identity and ran until killed:\n%s", out)
		}
		if err == nil || !strings.Contains(string(out), "--trust-tenant-header") || !strings.Contains(string(out), "--jwt-jwks-url") {
			t.Fatalf("exit %v, output:\n%s\nwant a refusal naming --jwt-jwks-url and --trust-tenant-header", err, out)
		}
	})

	t.Run("said loudly with --trust-tenant-header", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		cmd := exec.CommandContext(ctx, bin, "--addr", "127.0.0.1:0", "--trust-tenant-header", "--log-format", "text")
		cmd.Env = env
		cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
		stderr, err := cmd.StderrPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cancel(); _ = cmd.Wait() })
		lines := make(chan string, 64)
		go func() {
			defer close(lines)
			sc := bufio.NewScanner(stderr)
			for sc.Scan() {
				lines <- sc.Text()
			}
			_, _ = io.Copy(io.Discard, stderr)
		}()
		deadline := time.After(30 * time.Second)
		for {
			select {
			case l, ok := <-lines:
				if !ok {
					t.Fatal("the gateway exited before saying identities are not checked")
				}
				if strings.Contains(l, "TENANT IDENTITY IS NOT CHECKED") {
					if !strings.Contains(l, "WRN") && !strings.Contains(l, "WARN") {
						t.Fatalf("said at the wrong level: %s", l)
					}
					return
				}
			case <-deadline:
				t.Fatal("the gateway did not say within 30 s that tenant identities are not checked")
			}
		}
	})
}
