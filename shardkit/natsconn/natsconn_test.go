package natsconn_test

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats"
	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/natsauth"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit/natsconn"
)

func gateway() natsauth.Role {
	return natsauth.Role{Name: "gateway", Pub: []string{"$JS.API.INFO"}, Sub: []string{"_INBOX_gateway.>"}}
}

func TestCredentialsConnectWithTheirInbox(t *testing.T) {
	srv := natstest.Server(t)
	nc, err := natsconn.Connect(natsconn.Options{URL: srv.URL(), Creds: natstest.CredsFile(t, gateway())}, "test", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if !nc.IsConnected() {
		t.Fatal("not connected")
	}
	if in := nc.NewInbox(); !strings.HasPrefix(in, "_INBOX_gateway.") {
		t.Errorf("inbox %q: want the role's _INBOX_gateway prefix, the only one it may read", in)
	}
	// A request works: the reply comes on the role's inbox.
	if _, err := nc.Request("$JS.API.INFO", nil, 2*time.Second); err != nil {
		t.Errorf("request on the role's inbox: %v", err)
	}
}

// Credentials the server does not trust, or none, fail at once naming the setting: no
// reconnect loop that hides the cause.
func TestRefusedCredentialsFailFast(t *testing.T) {
	srv := natstest.Server(t)
	other, err := natsauth.New()
	if err != nil {
		t.Fatal(err)
	}
	foreign, err := other.WriteCreds(t.TempDir(), gateway())
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		o    natsconn.Options
		want string
	}{
		{"untrusted creds", natsconn.Options{URL: srv.URL(), Creds: foreign}, "--nats-creds " + foreign},
		{"no credentials", natsconn.Options{URL: srv.URL()}, "needs credentials: set --nats-creds"},
		{"wrong password", natsconn.Options{URL: srv.URL(), User: "u", Password: "p"}, "--nats-user/--nats-password"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			start := time.Now()
			nc, err := natsconn.Connect(c.o, "test", nil)
			if err == nil {
				nc.Close()
				t.Fatal("connected")
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Errorf("error %q does not name %q", err, c.want)
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("took %s to fail", d)
			}
		})
	}
}

func TestBadOptionsAreNamed(t *testing.T) {
	cases := []struct {
		o    natsconn.Options
		want string
	}{
		{natsconn.Options{URL: "nats://127.0.0.1:1", Creds: "/nonexistent.creds"}, "--nats-creds (TM_NATS_CREDS)"},
		{natsconn.Options{URL: "nats://127.0.0.1:1", Creds: "a", Token: "b"}, "not several"},
		{natsconn.Options{URL: "nats://127.0.0.1:1", User: "a"}, "go together"},
		{natsconn.Options{URL: "nats://127.0.0.1:1", TLSCert: "a"}, "go together"},
	}
	for _, c := range cases {
		if _, err := natsconn.Connect(c.o, "test", nil); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: error %v, want it to say %q", c.o, err, c.want)
		}
	}
	bad := filepath.Join(t.TempDir(), "bad.creds")
	if err := os.WriteFile(bad, []byte("not a creds file"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := natsconn.Connect(natsconn.Options{URL: "nats://127.0.0.1:1", Creds: bad}, "test", nil); err == nil ||
		!strings.Contains(err.Error(), "--nats-creds "+bad) {
		t.Errorf("a file that is no creds file: %v", err)
	}
}

func TestTLS(t *testing.T) {
	files, err := natsauth.LoadOrCreateTLS(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	tc, err := files.ServerConfig()
	if err != nil {
		t.Fatal(err)
	}
	srv := natstest.Restart(t, embednats.Config{StoreDir: t.TempDir(), TLS: tc})
	o := natsconn.Options{URL: srv.URL(), Creds: natstest.CredsFile(t, gateway())}

	// Not signed by a CA we trust: fail naming --nats-tls-ca.
	if nc, err := natsconn.Connect(o, "test", nil); err == nil {
		nc.Close()
		t.Fatal("connected to a server whose certificate is not trusted")
	} else if !strings.Contains(err.Error(), "--nats-tls-ca") {
		t.Errorf("error %q does not name --nats-tls-ca", err)
	}

	o.TLSCA = files.CA
	nc, err := natsconn.Connect(o, "test", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if !nc.TLSRequired() {
		t.Error("connection is not TLS")
	}
}

// A server that is not up yet is waited for in the background.
func TestServerLaterIsRetried(t *testing.T) {
	ports, err := embednats.FreePorts("", 1)
	if err != nil {
		t.Fatal(err)
	}
	cfg := embednats.Config{Port: ports[0], StoreDir: t.TempDir()}
	url := "nats://127.0.0.1:" + strconv.Itoa(ports[0])
	nc, err := natsconn.Connect(natsconn.Options{URL: url, Creds: natstest.CredsFile(t, gateway())}, "test", nil)
	if err != nil {
		t.Fatalf("connect before the server is up: %v", err)
	}
	defer nc.Close()
	natstest.Restart(t, cfg)
	// nats.go has no event for a first connect after a retry: poll the status.
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("connected after the server started", nc.IsConnected))
}
