// Package natstest gives tests a real embedded nats-server with JetStream: one per test, or a
// 3-node cluster, each shut down when the test ends.
//
// The servers run secured, as the product does: they trust one natsauth chain made per test
// binary, Connect comes in as the rebalancer (the role that may do everything), ConnectAs and
// CredsFile as any role.
package natstest

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/embednats"
	"github.com/tenantmesh/tenantmesh/internal/natsauth"
)

// chain is made once per test binary, with the scoped keys of KeepScopes's roles in its
// account before any server trusts it, as a deployment makes its own.
var chain = sync.OnceValues(func() (*natsauth.Chain, error) {
	c, err := natsauth.New()
	if err != nil {
		return nil, err
	}
	for _, r := range scopes {
		if _, err := c.AddScope(r); err != nil {
			return nil, err
		}
	}
	return c, nil
})

var scopes []natsauth.Role

// KeepScopes makes the test binary's chain keep roles' templates as scoped keys (natsauth's
// AddScope), so that their users' credentials carry no permissions of their own, as in a
// deployment (shardkit/kittest keeps the built-in roles'). Call it from an init: the chain is
// made by the first test that needs it.
func KeepScopes(roles ...natsauth.Role) { scopes = append(scopes, roles...) }

// Auth is the trust chain every natstest server trusts.
func Auth(t testing.TB) *natsauth.Chain {
	t.Helper()
	c, err := chain()
	if err != nil {
		t.Fatalf("natstest: trust chain: %v", err)
	}
	return c
}

// Creds mints role's credentials file contents.
func Creds(t testing.TB, role natsauth.Role) []byte {
	t.Helper()
	b, err := Auth(t).Creds(role)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// UserClaims decodes the user of a credentials file, and returns its JWT's length with it.
func UserClaims(t testing.TB, creds []byte) (*jwt.UserClaims, int) {
	t.Helper()
	tok, err := jwt.ParseDecoratedJWT(creds)
	if err != nil {
		t.Fatal(err)
	}
	uc, err := jwt.DecodeUserClaims(tok)
	if err != nil {
		t.Fatal(err)
	}
	return uc, len(tok)
}

// CredsFile writes role's credentials under t.TempDir() and returns the path, for processes.
func CredsFile(t testing.TB, role natsauth.Role) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), role.Name+".creds")
	if err := os.WriteFile(path, Creds(t, role), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// As is the nats.go option that authenticates as role, with role's inbox prefix.
func As(t testing.TB, role natsauth.Role) nats.Option {
	t.Helper()
	b := Creds(t, role)
	tok, err := jwt.ParseDecoratedJWT(b)
	if err != nil {
		t.Fatal(err)
	}
	kp, err := jwt.ParseDecoratedNKey(b)
	if err != nil {
		t.Fatal(err)
	}
	seed, _ := kp.Seed()
	return func(o *nats.Options) error {
		if err := nats.UserJWTAndSeed(tok, string(seed))(o); err != nil {
			return err
		}
		return nats.CustomInboxPrefix(role.Inbox())(o)
	}
}

// Logger returns a logger for server logs: discarded unless TM_TEST_NATS_LOG is set.
func Logger() *slog.Logger {
	if os.Getenv("TM_TEST_NATS_LOG") == "" {
		return nil
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

// Server starts a standalone JetStream server storing under t.TempDir().
func Server(t testing.TB) *embednats.Server {
	t.Helper()
	return Restart(t, embednats.Config{StoreDir: t.TempDir()})
}

// Restart starts a server from cfg (for example the Config() of a stopped server, to restart it
// on the same port and store) and stops it when the test ends.
func Restart(t testing.TB, cfg embednats.Config) *embednats.Server {
	t.Helper()
	if cfg.Auth == nil {
		cfg.Auth = Auth(t)
	}
	if cfg.Logger == nil {
		cfg.Logger = Logger()
	}
	s, err := embednats.Start(cfg)
	if err != nil {
		t.Fatalf("start nats-server: %v", err)
	}
	t.Cleanup(s.Stop)
	return s
}

// Cluster is a running 3-node JetStream cluster.
type Cluster struct {
	Servers []*embednats.Server
	Configs []embednats.Config
}

// URLs is a comma-separated list of all members' client URLs.
func (c *Cluster) URLs() string {
	var u string
	for i, cfg := range c.Configs {
		if i > 0 {
			u += ","
		}
		u += "nats://127.0.0.1:" + strconv.Itoa(cfg.Port)
	}
	return u
}

// NewCluster starts a 3-node cluster and waits until JetStream has a meta leader.
func NewCluster(t testing.TB) *Cluster {
	t.Helper()
	cfgs, err := embednats.ClusterConfigs("tmtest", 3, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	auth := Auth(t)
	for i := range cfgs {
		cfgs[i].Auth = auth
	}
	c := &Cluster{Configs: cfgs, Servers: make([]*embednats.Server, len(cfgs))}
	errs := make(chan error, len(cfgs))
	for i, cfg := range cfgs {
		go func() {
			cfg.Logger = Logger()
			cfg.ReadyTimeout = 20 * time.Second
			s, err := embednats.Start(cfg)
			c.Servers[i] = s
			errs <- err
		}()
	}
	for range cfgs {
		if err := <-errs; err != nil {
			t.Fatalf("start cluster member: %v", err)
		}
	}
	t.Cleanup(func() {
		for _, s := range c.Servers {
			if s != nil {
				s.Stop()
			}
		}
	})
	c.WaitJetStream(t)
	return c
}

// WaitJetStream waits until the cluster's JetStream API answers (a meta leader is elected).
func (c *Cluster) WaitJetStream(t testing.TB) {
	t.Helper()
	nc := Connect(t, c.URLs())
	defer nc.Close()
	js, _ := jetstream.New(nc)
	deadline := time.Now().Add(20 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := js.AccountInfo(ctx)
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("cluster JetStream not ready: %v", err)
		}
		time.Sleep(100 * time.Millisecond) // polling the API; no event to await
	}
}

// Connect opens a client connection as the rebalancer (allowed everything) that retries
// forever and is closed at test end.
func Connect(t testing.TB, url string, opts ...nats.Option) *nats.Conn {
	t.Helper()
	return ConnectAs(t, url, natsauth.Admin(), opts...)
}

// ConnectAs is Connect as role.
func ConnectAs(t testing.TB, url string, role natsauth.Role, opts ...nats.Option) *nats.Conn {
	t.Helper()
	opts = append([]nats.Option{
		As(t, role),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(50 * time.Millisecond),
		nats.Timeout(2 * time.Second),
	}, opts...)
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		t.Fatalf("connect %s: %v", url, err)
	}
	t.Cleanup(nc.Close)
	return nc
}
