package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/embednats"
	"github.com/tenantmesh/tenantmesh/shardkit/natsconn"
)

// natsNodes are the embedded NATS servers: one, or three with --nats-cluster. A node can be
// stopped and started again through the control API.
type natsNodes struct {
	mu      sync.Mutex
	cfgs    []embednats.Config
	servers []*embednats.Server // nil while a node is stopped
}

// startNATS starts the embedded server, or the 3-node cluster and waits for its JetStream
// meta leader.
func startNATS(ctx context.Context, c config, sec *security, log *slog.Logger) (*natsNodes, error) {
	if !c.natsCluster {
		cfg := embednats.Config{Name: "devstack", Host: c.host, Port: c.natsPort,
			StoreDir: filepath.Join(c.data, "nats"), Logger: log}
		if err := sec.server(&cfg); err != nil {
			return nil, err
		}
		srv, err := embednats.Start(cfg)
		if err != nil {
			return nil, fmt.Errorf("start NATS on port %d (is another stack running? --nats-port changes it): %w", c.natsPort, err)
		}
		return &natsNodes{cfgs: []embednats.Config{srv.Config()}, servers: []*embednats.Server{srv}}, nil
	}
	cfgs, err := embednats.ClusterConfigs("devstack", 3, filepath.Join(c.data, "nats-cluster"))
	if err != nil {
		return nil, err
	}
	n := &natsNodes{cfgs: cfgs, servers: make([]*embednats.Server, len(cfgs))}
	errs := make(chan error, len(cfgs))
	for i := range cfgs {
		if err := sec.server(&n.cfgs[i]); err != nil {
			return nil, err
		}
		n.cfgs[i].Logger = log.With("node", cfgs[i].Name)
		n.cfgs[i].ReadyTimeout = 30 * time.Second
		go func() {
			s, err := embednats.Start(n.cfgs[i])
			n.mu.Lock()
			n.servers[i] = s
			n.mu.Unlock()
			errs <- err
		}()
	}
	var first error
	for range cfgs {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	if first != nil {
		n.stopAll()
		return nil, fmt.Errorf("start NATS cluster: %w", first)
	}
	return n, nil
}

// waitJetStream polls the JetStream API until it answers (a meta leader is elected).
func waitJetStream(ctx context.Context, admin natsconn.Options, timeout time.Duration) error {
	nc, err := natsconn.Connect(admin, "devstack", nil, nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	deadline := time.Now().Add(timeout)
	for {
		actx, cancel := context.WithTimeout(ctx, time.Second)
		_, err := js.AccountInfo(actx)
		cancel()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			return fmt.Errorf("NATS cluster JetStream not ready within %s: %w", timeout, err)
		}
		time.Sleep(200 * time.Millisecond) // polling the API; no event to await
	}
}

// urls is the comma-separated client URL list every child gets.
func (n *natsNodes) urls() string {
	var u []string
	for _, c := range n.cfgs {
		u = append(u, "nats://"+net.JoinHostPort(hostOr(c.Host), strconv.Itoa(c.Port)))
	}
	return strings.Join(u, ",")
}

func hostOr(h string) string {
	if h == "" {
		return "127.0.0.1"
	}
	return h
}

func (n *natsNodes) stopAll() {
	n.mu.Lock()
	defer n.mu.Unlock()
	for i, s := range n.servers {
		if s != nil {
			s.Stop()
			n.servers[i] = nil
		}
	}
}

// stop stops node i (0-based).
func (n *natsNodes) stop(i int) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if i < 0 || i >= len(n.servers) {
		return fmt.Errorf("no NATS node %d", i+1)
	}
	if n.servers[i] == nil {
		return fmt.Errorf("NATS node %d is already stopped", i+1)
	}
	n.servers[i].Stop()
	n.servers[i] = nil
	return nil
}

// start starts node i (0-based) again on its ports and store.
func (n *natsNodes) start(i int) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if i < 0 || i >= len(n.servers) {
		return fmt.Errorf("no NATS node %d", i+1)
	}
	if n.servers[i] != nil {
		return fmt.Errorf("NATS node %d is already running", i+1)
	}
	s, err := embednats.Start(n.cfgs[i])
	if err != nil {
		return err
	}
	n.servers[i] = s
	return nil
}

// nodeState is one NATS node in the state document.
type nodeState struct {
	Name    string `json:"name"`
	URL     string `json:"url"`
	Running bool   `json:"running"`
	// Leader: this node is the JetStream meta leader.
	Leader bool `json:"leader"`
}

// childState is one child process in the state document.
type childState struct {
	PID      int    `json:"pid"`
	URL      string `json:"url"` // its readiness URL
	Running  bool   `json:"running"`
	Restarts int    `json:"restarts"`
}

// state is the document --state-file holds and GET /state answers.
type state struct {
	Control  string                `json:"control,omitempty"`
	NATS     []nodeState           `json:"nats"`
	Children map[string]childState `json:"children"`
}

func (n *natsNodes) state() []nodeState {
	n.mu.Lock()
	defer n.mu.Unlock()
	out := make([]nodeState, len(n.cfgs))
	for i, c := range n.cfgs {
		out[i] = nodeState{Name: c.Name, URL: "nats://" + net.JoinHostPort(hostOr(c.Host), strconv.Itoa(c.Port))}
		if s := n.servers[i]; s != nil {
			out[i].Running = true
			out[i].Leader = s.JetStreamIsLeader()
		}
	}
	return out
}

// supervisor restarts dead children (--keep-going), writes the state file and serves the
// control API.
type supervisor struct {
	c        config
	log      *slog.Logger
	procs    []*proc
	nodes    *natsNodes
	stopping atomic.Bool
	control  string // the control API's base URL, once listening

	fileMu sync.Mutex
}

// supervise watches p until the stack stops: each time it dies it is restarted (--on-exit
// restart), or left down for the rest to carry on without it (keep; the control API can start
// it again).
func (s *supervisor) supervise(ctx context.Context, p *proc, wg *sync.WaitGroup) {
	for {
		_, done := p.current()
		select {
		case <-ctx.Done():
			return
		case <-done:
		}
		if s.stopping.Load() || ctx.Err() != nil {
			return
		}
		p.mu.Lock()
		err := p.err
		p.mu.Unlock()
		s.writeState()
		if s.c.onExit != "restart" {
			s.log.Warn("child died; the platform keeps running without it (a shard's tenants fail over to the others)", "proc", p.name, "err", err)
			again := p.restarted()
			if _, done := p.current(); !closed(done) {
				continue // started again meanwhile
			}
			select {
			case <-ctx.Done():
				return
			case <-again:
			}
			continue
		}
		s.log.Warn("child died; restarting it", "proc", p.name, "err", err, "after", s.c.restartDelay)
		select {
		case <-ctx.Done():
			return
		case <-time.After(s.c.restartDelay):
		}
		if s.stopping.Load() {
			return
		}
		if err := p.start(wg); err != nil {
			s.log.Error("restart failed", "proc", p.name, "err", err)
			return
		}
		p.mu.Lock()
		p.restarts++
		p.mu.Unlock()
		s.writeState()
	}
}

// startChild starts the dead child name again (--on-exit keep).
func (s *supervisor) startChild(name string, wg *sync.WaitGroup) error {
	for _, p := range s.procs {
		if p.name != name {
			continue
		}
		_, done := p.current()
		select {
		case <-done:
		default:
			return fmt.Errorf("%s is running", name)
		}
		if err := p.start(wg); err != nil {
			return err
		}
		p.mu.Lock()
		p.restarts++
		if p.again != nil {
			close(p.again)
			p.again = nil
		}
		p.mu.Unlock()
		s.log.Info("child started again through the control API", "proc", name)
		return nil
	}
	return fmt.Errorf("no child %q", name)
}

func (s *supervisor) state() state {
	st := state{Control: s.control, NATS: s.nodes.state(), Children: map[string]childState{}}
	for _, p := range s.procs {
		cmd, done := p.current()
		cs := childState{URL: p.ready}
		if cmd != nil && cmd.Process != nil {
			cs.PID = cmd.Process.Pid
		}
		select {
		case <-done:
		default:
			cs.Running = done != nil
		}
		p.mu.Lock()
		cs.Restarts = p.restarts
		p.mu.Unlock()
		st.Children[p.name] = cs
	}
	return st
}

// writeState replaces --state-file (atomically, by rename) with the current state.
func (s *supervisor) writeState() {
	if s.c.stateFile == "" {
		return
	}
	s.fileMu.Lock()
	defer s.fileMu.Unlock()
	b, _ := json.MarshalIndent(s.state(), "", "  ")
	tmp := s.c.stateFile + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err == nil {
		err = os.Rename(tmp, s.c.stateFile)
		if err != nil {
			s.log.Warn("write state file", "err", err)
		}
	}
}

// serveControl serves the control API on --control-addr until ctx ends.
func (s *supervisor) serveControl(ctx context.Context, wg *sync.WaitGroup) error {
	ln, err := net.Listen("tcp", s.c.controlAddr)
	if err != nil {
		return fmt.Errorf("control API: %w", err)
	}
	s.control = "http://" + ln.Addr().String()
	mux := http.NewServeMux()
	mux.HandleFunc("GET /state", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("content-type", "application/json")
		_ = json.NewEncoder(w).Encode(s.state())
	})
	node := func(act func(int) error) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			n, err := strconv.Atoi(r.PathValue("n"))
			if err == nil {
				err = act(n - 1)
			}
			if err != nil {
				http.Error(w, err.Error(), http.StatusConflict)
				return
			}
			s.log.Warn("NATS node changed through the control API", "node", n, "path", r.URL.Path)
			s.writeState()
			w.WriteHeader(http.StatusNoContent)
		}
	}
	mux.HandleFunc("POST /nats/{n}/stop", node(s.nodes.stop))
	mux.HandleFunc("POST /nats/{n}/start", node(s.nodes.start))
	mux.HandleFunc("POST /children/{name}/start", func(w http.ResponseWriter, r *http.Request) {
		if err := s.startChild(r.PathValue("name"), wg); err != nil {
			http.Error(w, err.Error(), http.StatusConflict)
			return
		}
		s.writeState()
		w.WriteHeader(http.StatusNoContent)
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	wg.Go(func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.log.Warn("control API stopped", "err", err)
		}
	})
	wg.Go(func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	})
	s.log.Info("control API", "url", s.control)
	s.writeState()
	return nil
}

// extraGateways lists the base URLs of the gateways after the first.
func extraGateways(procs []*proc) []string {
	var out []string
	for _, p := range procs {
		if strings.HasPrefix(p.name, "gateway-") {
			out = append(out, strings.TrimSuffix(p.ready, "/readyz"))
		}
	}
	return out
}

// closed reports whether ch is closed (nil: never started, counted closed).
func closed(ch chan struct{}) bool {
	if ch == nil {
		return true
	}
	select {
	case <-ch:
		return true
	default:
		return false
	}
}
