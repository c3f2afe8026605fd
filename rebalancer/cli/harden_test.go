package cli

import (
	"bytes"
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/internal/embednats"
	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/natsauth"
)

// TestAttackAuthRevoke (item 14): `rebalance auth revoke --role gateway --push URL` cuts a
// leaked gateway credentials file off a running server at once, without a restart; `auth
// rotate` and `auth retire` move every role to a new signing key the same way.
func TestAttackAuthRevoke(t *testing.T) {
	dir := t.TempDir()
	run := func(args ...string) string {
		t.Helper()
		var out, errb bytes.Buffer
		m := &Main{Stdout: &out, Stderr: &errb, Terminal: func(any) bool { return false }}
		if code := m.Exit(context.Background(), append([]string{"auth"}, args...)); code != 0 {
			t.Fatalf("auth %v: %d %s", args, code, errb.String())
		}
		return out.String()
	}
	run("init", "--dir", dir)
	chain, err := natsauth.LoadOrCreate(dir)
	if err != nil {
		t.Fatal(err)
	}
	srv := natstest.Restart(t, embednats.Config{StoreDir: t.TempDir(), Auth: chain})
	connect := func(role string) (*nats.Conn, chan error) {
		t.Helper()
		cut := make(chan error, 4)
		nc, err := nats.Connect(srv.URL(), nats.UserCredentials(filepath.Join(dir, "creds", role+".creds")),
			nats.CustomInboxPrefix("_INBOX_"+role), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond),
			nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}),
			nats.DisconnectErrHandler(func(_ *nats.Conn, err error) { cut <- err }))
		if err != nil {
			t.Fatalf("%s: %v", role, err)
		}
		t.Cleanup(nc.Close)
		return nc, cut
	}
	gw, gwCut := connect("gateway")
	rb, _ := connect("rebalancer")

	run("revoke", "--dir", dir, "--role", "gateway", "--push", srv.URL())
	select {
	case <-gwCut:
	case <-time.After(10 * time.Second):
		t.Fatal("the revoked gateway user is still connected")
	}
	if _, err := gw.Request("$JS.API.INFO", nil, 500*time.Millisecond); err == nil {
		t.Fatal("the revoked gateway user still gets answers")
	}
	if _, err := rb.Request("$JS.API.INFO", nil, 2*time.Second); err != nil {
		t.Fatalf("the rebalancer after the revocation: %v", err)
	}

	// Rotation: the rebalancer's file is minted again with key version 2; retiring version 1
	// disconnects it, and it comes back with the new file.
	run("rotate", "--dir", dir, "--push", srv.URL())
	run("retire", "--dir", dir, "--push", srv.URL())
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := rb.Request("$JS.API.INFO", nil, time.Second); err == nil && rb.Reconnects > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the rebalancer did not come back on its renewed credentials (reconnects %d)", rb.Reconnects)
		}
	}
}
