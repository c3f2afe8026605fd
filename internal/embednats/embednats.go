// Package embednats starts an in-process nats-server with JetStream.
//
// It is the one place tenantmesh embeds a NATS server: the dev stack (`make run`) uses it as the
// platform's default store, and tests use it through the natstest subpackage. Everything else
// talks to NATS only through nats.go.
package embednats

import (
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/tenantmesh/tenantmesh/internal/natsauth"
)

// Config describes one embedded server. The zero value starts a standalone server on a random
// loopback port with JetStream storing under a temporary directory chosen by nats-server.
type Config struct {
	// Name is the server name; required to be stable across restarts in a cluster. Default: random.
	Name string
	// Host to listen on. Default: 127.0.0.1.
	Host string
	// Port for clients. 0 or -1 picks a free port.
	Port int
	// StoreDir is where JetStream keeps its data. Default: a directory chosen by nats-server.
	StoreDir string
	// MaxMemory bounds JetStream memory storage in bytes. Default: 256 MiB.
	MaxMemory int64
	// MaxStore bounds JetStream file storage in bytes. Default: 4 GiB.
	MaxStore int64
	// ClusterName, ClusterPort and Routes join the server to a cluster. Routes are nats-route
	// URLs (nats://host:port) of the other members. Leave ClusterPort 0 for a standalone server.
	ClusterName string
	ClusterPort int
	Routes      []string
	// ReadyTimeout bounds the wait for the server to accept connections. Default: 10s.
	ReadyTimeout time.Duration
	// Logger receives the server's log lines. If nil, they are discarded.
	Logger *slog.Logger
	// Debug enables nats-server debug logs (sent at slog debug level).
	Debug bool
	// Auth makes the server trust this chain: clients must bring credentials it signed
	// (natsauth). Nil runs without authentication, which only an explicit insecure mode wants.
	Auth *natsauth.Chain
	// TLS makes clients connect with TLS (the routes between members stay plain on loopback).
	TLS *tls.Config
}

// ErrNotReady is returned when the server does not accept connections within ReadyTimeout.
var ErrNotReady = errors.New("embednats: server not ready for connections")

// Server is a running embedded nats-server.
type Server struct {
	*server.Server
	cfg Config
}

// Start starts a server and waits until it accepts connections.
func Start(cfg Config) (*Server, error) {
	opts, err := cfg.options()
	if err != nil {
		return nil, err
	}
	s, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("embednats: new server: %w", err)
	}
	if cfg.Logger != nil {
		s.SetLoggerV2(&logAdapter{l: cfg.Logger.With("component", "nats-server")}, cfg.Debug, false, false)
	}
	go s.Start()
	timeout := cfg.ReadyTimeout
	if timeout <= 0 {
		timeout = 10 * time.Second
	}
	if !s.ReadyForConnections(timeout) {
		s.Shutdown()
		return nil, fmt.Errorf("%w after %s", ErrNotReady, timeout)
	}
	return &Server{Server: s, cfg: cfg}, nil
}

// Config returns the configuration the server was started with, with ports resolved, so the
// same server can be restarted on the same address and store.
func (s *Server) Config() Config {
	c := s.cfg
	if addr, ok := s.Addr().(*net.TCPAddr); ok {
		c.Port = addr.Port
	}
	if ca := s.ClusterAddr(); ca != nil {
		c.ClusterPort = ca.Port
	}
	c.Name = s.Name()
	return c
}

// URL is the client URL of the server.
func (s *Server) URL() string { return s.ClientURL() }

// Stop shuts the server down and waits until it has stopped.
func (s *Server) Stop() {
	s.Shutdown()
	s.WaitForShutdown()
}

func (c Config) options() (*server.Options, error) {
	host := c.Host
	if host == "" {
		host = "127.0.0.1"
	}
	port := c.Port
	if port == 0 {
		port = server.RANDOM_PORT
	}
	maxMem, maxStore := c.MaxMemory, c.MaxStore
	if maxMem <= 0 {
		maxMem = 256 << 20
	}
	if maxStore <= 0 {
		maxStore = 4 << 30
	}
	o := &server.Options{
		ServerName:         c.Name,
		Host:               host,
		Port:               port,
		JetStream:          true,
		StoreDir:           c.StoreDir,
		JetStreamMaxMemory: maxMem,
		JetStreamMaxStore:  maxStore,
		// nats-server 2.15 caps every stream at 1,000 consumers unless told otherwise, and each
		// shard instance holds one on tm_members (and held one on tm_tenant_state): at 1,000
		// instances the gateways and the rebalancer could no longer follow them (the scale
		// harness).
		JetStreamLimits: server.JSLimitOpts{DefaultMaxConsumers: -1},
		NoSigs:          true,
		MaxPayload:      8 << 20,
		// A user JWT lists its role's subjects and travels in the CONNECT line: a shard's
		// is several KiB, more than the 4 KiB default.
		MaxControlLine: 64 << 10,
		Debug:          c.Debug,
	}
	if c.Auth != nil {
		if err := c.Auth.Configure(o); err != nil {
			return nil, err
		}
	}
	if c.TLS != nil {
		o.TLSConfig = c.TLS
		o.TLS = true
		o.TLSTimeout = 2
	}
	if c.ClusterPort != 0 {
		if c.ClusterName == "" {
			return nil, errors.New("embednats: ClusterName is required with ClusterPort")
		}
		if c.Name == "" {
			return nil, errors.New("embednats: Name is required for a cluster member")
		}
		o.Cluster = server.ClusterOpts{Name: c.ClusterName, Host: host, Port: c.ClusterPort}
		for _, r := range c.Routes {
			o.Routes = append(o.Routes, server.RoutesFromStr(r)...)
		}
	}
	return o, nil
}

// FreePorts returns n distinct free TCP ports on host, for configuring cluster members (and the
// dev stack's processes) that must know each other's addresses before they start. It picks
// them below the kernel's ephemeral range where it can read it (Linux): a port the kernel hands
// out for listening on :0 comes from the range its outgoing connections use too, and one of
// those took a shard's port between the pick and the shard's own bind (a chaos run, 2026-11-26).
// Another process picking the same port before either binds is still possible, only rarer.
func FreePorts(host string, n int) ([]int, error) {
	if host == "" {
		host = "127.0.0.1"
	}
	ls := make([]net.Listener, 0, n)
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	ports := make([]int, 0, n)
	low, high := belowEphemeral()
	for tries := 0; len(ports) < n && high > low && tries < 100*n; tries++ {
		l, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(low+rand.IntN(high-low))))
		if err != nil {
			continue // taken
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	for len(ports) < n {
		l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
		if err != nil {
			return nil, fmt.Errorf("embednats: reserve port: %w", err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// belowEphemeral is the range [low, high) FreePorts picks from: from 10000 up to the start of
// the kernel's ephemeral range, or empty when that range is unknown.
func belowEphemeral() (low, high int) {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0, 0
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return 0, 0
	}
	start, err := strconv.Atoi(f[0])
	if err != nil || start <= 11000 {
		return 0, 0
	}
	return 10000, start
}

// ClusterConfigs returns configs for an n-node cluster on loopback, each member routing to all
// others, with store directories under baseDir (one subdirectory per member).
func ClusterConfigs(name string, n int, baseDir string) ([]Config, error) {
	ports, err := FreePorts("", 2*n)
	if err != nil {
		return nil, err
	}
	cfgs := make([]Config, n)
	for i := range n {
		var routes []string
		for j := range n {
			if j != i {
				routes = append(routes, "nats://127.0.0.1:"+strconv.Itoa(ports[n+j]))
			}
		}
		cfgs[i] = Config{
			Name:        fmt.Sprintf("%s-%d", name, i+1),
			Port:        ports[i],
			ClusterName: name,
			ClusterPort: ports[n+i],
			Routes:      routes,
			StoreDir:    fmt.Sprintf("%s/n%d", baseDir, i+1),
		}
	}
	return cfgs, nil
}

// logAdapter sends nats-server log lines to slog.
type logAdapter struct{ l *slog.Logger }

func (a *logAdapter) Noticef(format string, v ...any) { a.l.Info(fmt.Sprintf(format, v...)) }
func (a *logAdapter) Warnf(format string, v ...any)   { a.l.Warn(fmt.Sprintf(format, v...)) }
func (a *logAdapter) Fatalf(format string, v ...any)  { a.l.Error(fmt.Sprintf(format, v...)) }
func (a *logAdapter) Errorf(format string, v ...any)  { a.l.Error(fmt.Sprintf(format, v...)) }
func (a *logAdapter) Debugf(format string, v ...any)  { a.l.Debug(fmt.Sprintf(format, v...)) }
func (a *logAdapter) Tracef(format string, v ...any)  { a.l.Debug(fmt.Sprintf(format, v...)) }
