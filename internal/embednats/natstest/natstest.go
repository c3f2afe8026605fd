// Package natstest gives tests a real embedded nats-server with JetStream: one per test, or a
// 3-node cluster, each shut down when the test ends.
package natstest

import (
	"context"
	"log/slog"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/embednats"
)

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

// Connect opens a client connection that retries forever and is closed at test end.
func Connect(t testing.TB, url string, opts ...nats.Option) *nats.Conn {
	t.Helper()
	opts = append([]nats.Option{
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
