package netfault

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/gatesig"
	"github.com/tenantmesh/tenantmesh/internal/natsauth"
	"github.com/tenantmesh/tenantmesh/shardkit/natsperm"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Kinds are the service kinds a fleet runs.
var Kinds = []string{"aggregate", "projection", "runner"}

// AdminToken is the fleet's admin token (shards' /admin/*, the rebalancer's write API).
const AdminToken = "netfault-admin-token"

// Options shape a fleet. The zero value is 3 NATS nodes, 1 gateway, 2 shards of each kind
// with one instance each, and the rebalancer with its autopilot on.
type Options struct {
	// Bin is the directory of the built binaries (Build). Required.
	Bin string
	// Gateways to run. Default 1.
	Gateways int
	// Shards of each kind. Default 2.
	Shards int
	// Instances of each shard (named a, b, ...). Default 1.
	Instances int
	// NATSStoreSize, if set, puts each NATS node's store on a tmpfs of this many bytes (a disk
	// that fills).
	NATSStoreSize int64
	// RebalancerFlags are more flags for `rebalance serve`.
	RebalancerFlags []string
	// LogLevel of every process. Default warn (TM_FAULT_LOG_LEVEL).
	LogLevel string
}

// Fleet is the platform as processes, one namespace each, on a Net, secured as a deployment
// is: NATS users per role with least privilege, gateway proofs to the shards, and edge JWTs
// at the gateways.
type Fleet struct {
	t    testing.TB
	Net  *Net
	dir  string
	opts Options

	NATS       []*Proc
	Gateways   []*Proc
	Rebalancer *Proc
	Shards     map[string]*Proc // by shard name: aggregate-1, ... (its first instance)
	Instances  []*Proc          // every shard instance

	natsURLs  string
	adminCred string
	idpKey    *ecdsa.PrivateKey
	gateKey   []byte // the gateways' key

	tokMu  sync.Mutex
	tokens map[string]string
}

// Proc is one process of the fleet in its namespace (or, made by HostProc, on the host); it
// can be stopped, frozen and started again, always with the same arguments.
type Proc struct {
	Name string
	Node *Node  // nil: the process runs in the host's namespace
	URL  string // base URL of its HTTP listener (none for a NATS node)
	args []string
	log  string
	env  []string
	// store is a NATS node's store directory.
	store string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
	t    testing.TB
}

// FleetPackages are the packages of the fleet's binaries (Build).
var FleetPackages = []string{"./gateway/cmd/gateway", "./rebalancer/cmd/rebalance", "./services/aggregate/cmd/aggregate",
	"./services/projection/cmd/projection", "./services/runner/cmd/runner", "./test/netfault/natsnode"}

// Build builds the fleet's binaries from the repository at root into dir.
func Build(root, dir string) error { return BuildPackages(root, dir, FleetPackages...) }

// BuildPackages builds the main packages pkgs (paths relative to root, "./...") of the
// repository at root into dir, each binary named after its directory.
func BuildPackages(root, dir string, pkgs ...string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", append([]string{"build", "-o", dir + string(os.PathSeparator)}, pkgs...)...)
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build: %w\n%s", err, out)
	}
	return nil
}

// BuildAt builds the fleet's binaries as they were at commit (git archive of the repository
// at root, with today's natsnode added: older commits have none, and it only wraps their own
// embednats and nats-server) into dir.
func BuildAt(root, commit, dir string) error {
	src, err := os.MkdirTemp("", "netfault-src-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(src)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	archive := exec.CommandContext(ctx, "sh", "-c", "git -C \"$1\" archive --format=tar \"$2\" | tar -x -C \"$3\"", "sh", root, commit, src)
	if out, err := archive.CombinedOutput(); err != nil {
		return fmt.Errorf("git archive %s: %w\n%s", commit, err, out)
	}
	main, err := os.ReadFile(filepath.Join(root, "test", "netfault", "natsnode", "main.go"))
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(src, "test", "netfault", "natsnode"), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(src, "test", "netfault", "natsnode", "main.go"), main, 0o644); err != nil {
		return err
	}
	return Build(src, dir)
}

// Start starts a fleet on a new Net and waits until every process is ready. Everything it
// started is stopped when the test ends.
func Start(t testing.TB, o Options) *Fleet {
	t.Helper()
	n := New(t)
	o.Gateways, o.Shards, o.Instances = max(o.Gateways, 1), max(o.Shards, 2), max(o.Instances, 1)
	if o.LogLevel == "" {
		o.LogLevel = os.Getenv("TM_FAULT_LOG_LEVEL")
	}
	if o.LogLevel == "" {
		o.LogLevel = "warn"
	}
	f := &Fleet{t: t, Net: n, dir: t.TempDir(), opts: o, Shards: map[string]*Proc{}, tokens: map[string]string{}}
	t.Cleanup(f.stopAll) // registered after the Net's: runs before it
	chain, err := natsauth.LoadOrCreate(filepath.Join(f.dir, "auth"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := natsperm.AddScopes(chain, natsperm.Scopes()); err != nil { // before NATS starts
		t.Fatal(err)
	}
	if f.gateKey, err = gatesig.LoadOrCreate(filepath.Join(f.dir, "auth", "gate.key")); err != nil {
		t.Fatal(err)
	}
	f.idpKey, err = ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, _ := x509.MarshalPKIXPublicKey(&f.idpKey.PublicKey)
	idp := filepath.Join(f.dir, "auth", "idp.pem")
	if err := os.WriteFile(idp, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	creds := func(role natsperm.Role) string {
		path, err := chain.WriteCreds(filepath.Join(f.dir, "creds"), role)
		if err != nil {
			t.Fatal(err)
		}
		return path
	}
	f.adminCred = creds(natsperm.Rebalancer())
	if err := chain.Save(); err != nil {
		t.Fatal(err)
	}

	// NATS: three nodes routing to each other.
	nodes := []*Node{n.Node("nats1"), n.Node("nats2"), n.Node("nats3")}
	var urls []string
	for _, node := range nodes {
		urls = append(urls, "nats://"+node.IP+":4222")
	}
	f.natsURLs = strings.Join(urls, ",")
	for i, node := range nodes {
		var routes []string
		for j, other := range nodes {
			if j != i {
				routes = append(routes, "nats://"+other.IP+":6222")
			}
		}
		store := filepath.Join(f.dir, "nats", node.Name)
		if o.NATSStoreSize > 0 {
			store = n.Tmpfs(o.NATSStoreSize)
		}
		p := f.proc(node, "", filepath.Join(o.Bin, "natsnode"), "--name", node.Name, "--host", node.IP,
			"--routes", strings.Join(routes, ","), "--store", store, "--auth", filepath.Join(f.dir, "auth"))
		p.store = store
		f.NATS = append(f.NATS, p)
	}
	var wg sync.WaitGroup
	errs := make(chan error, len(f.NATS))
	for _, p := range f.NATS {
		wg.Go(func() { errs <- p.StartAwaitLine("ready", 45*time.Second) })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	f.awaitJetStream(60 * time.Second)

	common := func(creds string) []string {
		return []string{"--nats-url", f.natsURLs, "--nats-creds", creds, "--replicas", "3", "--log-level", o.LogLevel, "--log-format", "text"}
	}
	webhooks := "TM_RUNNER_WEBHOOK_ALLOW=" + n.Subnet()
	for i := range o.Gateways {
		name := "gateway"
		if i > 0 {
			name = fmt.Sprintf("gateway-%d", i+1)
		}
		node := n.Node(name)
		f.Gateways = append(f.Gateways, f.proc(node, "http://"+node.IP+":8080", filepath.Join(o.Bin, "gateway"),
			append([]string{"--addr", node.IP + ":8080", "--gateway-id", name, "--admin-token", AdminToken,
				"--shard-key-file", filepath.Join(f.dir, "auth", "gate.key"),
				"--jwt-key-file", idp, "--jwt-issuer", "netfault-idp", "--jwt-audience", "tenantmesh"},
				common(creds(natsperm.DefaultGateway()))...)...))
	}
	node := n.Node("rebalancer")
	f.Rebalancer = f.proc(node, "http://"+node.IP+":8090", filepath.Join(o.Bin, "rebalance"),
		append(append([]string{"serve", "--addr", node.IP + ":8090", "--holder", "netfault-rebalancer", "--sweep-every", "5s",
			"--admin-token", AdminToken, "--autopilot", "on", "--autopilot-sustain", "20s", "--autopilot-cooldown", "2m"},
			o.RebalancerFlags...), common(f.adminCred)...)...)
	for _, kind := range Kinds {
		keyFile := filepath.Join(f.dir, "auth", "gate", kind+".key")
		if err := os.MkdirAll(filepath.Dir(keyFile), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := gatesig.WriteKeyFile(keyFile, gatesig.KindKey(f.gateKey, kind)); err != nil {
			t.Fatal(err)
		}
		for i := 1; i <= o.Shards; i++ {
			shard := fmt.Sprintf("%s-%d", kind, i)
			cred := creds(natsperm.Shard(kind, shard, natsperm.KindAssets(kind)))
			for j := range o.Instances {
				inst := string(rune('a' + j))
				name := shard
				if o.Instances > 1 {
					name += inst
				}
				node := n.Node(name)
				p := f.proc(node, "http://"+node.IP+":9000", filepath.Join(o.Bin, kind),
					append([]string{"--shard", shard, "--instance", inst, "--addr", node.IP + ":9000", "--admin-token", AdminToken,
						"--gateway-key-file", keyFile}, common(cred)...)...)
				p.env = []string{webhooks}
				if j == 0 {
					f.Shards[shard] = p
				}
				f.Instances = append(f.Instances, p)
			}
		}
	}
	all := append(append([]*Proc{f.Rebalancer}, f.Gateways...), f.shardList()...)
	for _, p := range all {
		if err := p.Start(); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range all {
		if err := p.AwaitReady(90 * time.Second); err != nil {
			t.Fatal(err)
		}
	}
	return f
}

func (f *Fleet) shardList() []*Proc { return f.Instances }

func (f *Fleet) proc(node *Node, url, bin string, args ...string) *Proc {
	return &Proc{Name: node.Name, Node: node, URL: url, args: append([]string{bin}, args...),
		log: filepath.Join(f.dir, "logs", node.Name+".log"), t: f.t}
}

// HostProc is a process named name that runs bin with args in the host's namespace (no Net,
// no root needed), logging to logDir/<name>.log; url is its HTTP listener's base URL, if it
// has one. Start it with Start or StartAwaitLine; it dies with the test process, and the
// caller stops it (Stop).
func HostProc(t testing.TB, name, url, logDir, bin string, args ...string) *Proc {
	return &Proc{Name: name, URL: url, args: append([]string{bin}, args...), log: filepath.Join(logDir, name+".log"), t: t}
}

// NATSURLs is the client URL list of the NATS nodes.
func (f *Fleet) NATSURLs() string { return f.natsURLs }

// Connect connects the test (from the host's namespace) to NATS as the rebalancer's role.
func (f *Fleet) Connect() *nats.Conn {
	f.t.Helper()
	nc, err := nats.Connect(f.natsURLs, nats.UserCredentials(f.adminCred), nats.MaxReconnects(-1),
		nats.ReconnectWait(100*time.Millisecond), nats.Timeout(2*time.Second))
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(nc.Close)
	return nc
}

// Store opens the shared schema on a connection of the test's.
func (f *Fleet) Store() *schema.Store {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := schema.OpenRetry(ctx, f.Connect(), schema.Options{Replicas: 3})
	if err != nil {
		f.t.Fatal(err)
	}
	return st
}

// Token is a bearer token for tenant signed by the fleet's identity provider (an hour long).
func (f *Fleet) Token(tenant string) string {
	f.tokMu.Lock()
	defer f.tokMu.Unlock()
	if tok, ok := f.tokens[tenant]; ok {
		return tok
	}
	tok, err := jwt.NewWithClaims(jwt.SigningMethodES256, jwt.MapClaims{"sub": "netfault", "tenant_id": tenant,
		"iss": "netfault-idp", "aud": "tenantmesh", "exp": time.Now().Add(time.Hour).Unix()}).SignedString(f.idpKey)
	if err != nil {
		panic(err) // an ECDSA key the harness made itself
	}
	f.tokens[tenant] = tok
	return tok
}

// Authorize adds tenant's bearer token to req.
func (f *Fleet) Authorize(req *http.Request, tenant string) {
	req.Header.Set("Authorization", "Bearer "+f.Token(tenant))
}

// Signer signs requests to the shards of kind as a gateway does.
func (f *Fleet) Signer(kind string) *gatesig.Signer {
	return gatesig.NewSigner(gatesig.KindKey(f.gateKey, kind))
}

// awaitJetStream waits until the cluster's JetStream API answers (a meta leader exists).
func (f *Fleet) awaitJetStream(within time.Duration) {
	f.t.Helper()
	nc := f.Connect()
	js, _ := jetstream.New(nc)
	deadline := time.Now().Add(within)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := js.AccountInfo(ctx)
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("JetStream not ready within %s: %v", within, err)
		}
		time.Sleep(200 * time.Millisecond) // polling the API: no event to await
	}
}

// Start starts the process (again).
func (p *Proc) Start() error {
	r, err := p.start()
	if err == nil {
		r.(*drainer).release()
	}
	return err
}

func (p *Proc) start() (io.Reader, error) {
	if err := os.MkdirAll(filepath.Dir(p.log), 0o755); err != nil {
		return nil, err
	}
	logf, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	args := slices.Clone(p.args)
	p.mu.Unlock()
	cmd := p.command(args)
	cmd.Env = append(append(os.Environ(), "TM_LOG_FORMAT=text"), p.env...)
	cmd.Stderr = logf
	out, err := cmd.StdoutPipe()
	if err != nil {
		logf.Close()
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", p.Name, err)
	}
	done := make(chan struct{})
	p.mu.Lock()
	p.cmd, p.done = cmd, done
	p.mu.Unlock()
	pr, pw := io.Pipe()
	go func() { // owned by the process: ends when its stdout closes
		_, _ = io.Copy(io.MultiWriter(logf, pw), out)
		_ = cmd.Wait()
		pw.Close()
		logf.Close()
		close(done)
	}()
	return readerDrain(pr), nil
}

// readerDrain returns a reader of r that, once its reader stops reading, is drained anyway so
// the process never blocks on its stdout.
func readerDrain(r *io.PipeReader) io.Reader {
	return &drainer{r: r}
}

type drainer struct {
	r    *io.PipeReader
	once sync.Once
}

func (d *drainer) Read(b []byte) (int, error) { return d.r.Read(b) }

// release stops reading and drains the rest in the background (until the process exits).
func (d *drainer) release() {
	d.once.Do(func() { go func() { _, _ = io.Copy(io.Discard, d.r) }() })
}

// command is the process's command: in its node's namespace, or on the host.
func (p *Proc) command(args []string) *exec.Cmd {
	if p.Node != nil {
		return p.Node.Command(args[0], args[1:]...)
	}
	cmd := exec.Command(args[0], args[1:]...)
	cmd.SysProcAttr = childAttr()
	return cmd
}

// StartAwaitLine starts the process and waits until it prints line on stdout.
func (p *Proc) StartAwaitLine(line string, within time.Duration) error {
	r, err := p.start()
	if err != nil {
		return err
	}
	d := r.(*drainer)
	found := make(chan bool, 1)
	go func() {
		defer d.release()
		sc := bufio.NewScanner(d)
		for sc.Scan() {
			if strings.TrimSpace(sc.Text()) == line {
				found <- true
				return
			}
		}
		found <- false
	}()
	select {
	case ok := <-found:
		if !ok {
			return fmt.Errorf("%s exited before it was ready:\n%s", p.Name, p.Tail(4<<10))
		}
		return nil
	case <-time.After(within):
		return fmt.Errorf("%s not ready within %s:\n%s", p.Name, within, p.Tail(4<<10))
	}
}

// AwaitReady waits until the process answers 200 at /readyz.
func (p *Proc) AwaitReady(within time.Duration) error {
	hc := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(within)
	for {
		_, done := p.current()
		select {
		case <-done:
			return fmt.Errorf("%s exited before it was ready:\n%s", p.Name, p.Tail(4<<10))
		default:
		}
		resp, err := hc.Get(p.URL + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready at %s within %s:\n%s", p.Name, p.URL, within, p.Tail(4<<10))
		}
		time.Sleep(100 * time.Millisecond) // polling another process's readiness
	}
}

func (p *Proc) current() (*exec.Cmd, chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd, p.done
}

// Exited reports whether the process was started and has exited since.
func (p *Proc) Exited() bool {
	_, done := p.current()
	if done == nil {
		return false
	}
	select {
	case <-done:
		return true
	default:
		return false
	}
}

// PID is the running process's id (0 if it never started).
func (p *Proc) PID() int {
	cmd, _ := p.current()
	if cmd == nil || cmd.Process == nil {
		return 0
	}
	return cmd.Process.Pid
}

// SetBin makes the process run its binary from dir from its next start on (an upgrade or a
// downgrade).
func (p *Proc) SetBin(dir string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.args[0] = filepath.Join(dir, filepath.Base(p.args[0]))
}

// Flag is the value of one of the process's flags ("" if it has none).
func (p *Proc) Flag(name string) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if i := slices.Index(p.args, name); i >= 0 && i+1 < len(p.args) {
		return p.args[i+1]
	}
	return ""
}

// Bin is the directory of the binary the process runs (from its next start on).
func (p *Proc) Bin() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return filepath.Dir(p.args[0])
}

// Restart stops the process (SIGTERM, SIGKILL after 5 s) and starts it again with the same
// arguments, store and address, waiting until it is ready.
func (p *Proc) Restart(within time.Duration) error {
	p.Stop(5 * time.Second)
	if p.store != "" {
		return p.StartAwaitLine("ready", within)
	}
	if err := p.Start(); err != nil {
		return err
	}
	return p.AwaitReady(within)
}

// Signal sends sig to the process.
func (p *Proc) Signal(sig syscall.Signal) error {
	cmd, done := p.current()
	if cmd == nil {
		return errors.New(p.Name + " never started")
	}
	select {
	case <-done:
		return errors.New(p.Name + " is not running")
	default:
	}
	return syscall.Kill(cmd.Process.Pid, sig)
}

// Stop stops the process: SIGTERM, SIGKILL after grace. It returns once it exited.
func (p *Proc) Stop(grace time.Duration) {
	cmd, done := p.current()
	if cmd == nil {
		return
	}
	_ = syscall.Kill(cmd.Process.Pid, syscall.SIGCONT) // a frozen process cannot handle SIGTERM
	_ = syscall.Kill(cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-done:
		return
	case <-time.After(grace):
	}
	_ = syscall.Kill(cmd.Process.Pid, syscall.SIGKILL)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		p.t.Logf("netfault: %s (pid %d) did not exit 10 s after SIGKILL", p.Name, cmd.Process.Pid)
	}
}

// Tail is the last n bytes of the process's log.
func (p *Proc) Tail(n int) string {
	b, _ := os.ReadFile(p.log)
	return string(b[max(0, len(b)-n):])
}

// stopAll stops every process (the shards and gateways first, NATS last), and on failure logs
// the tail of every process's log; TM_FAULT_LOGS=dir keeps them all.
func (f *Fleet) stopAll() {
	var all []*Proc
	if f.Rebalancer != nil {
		all = append(all, f.Rebalancer)
	}
	all = append(all, f.Gateways...)
	all = append(all, f.Instances...)
	var wg sync.WaitGroup
	for _, p := range all {
		wg.Go(func() { p.Stop(5 * time.Second) })
	}
	wg.Wait()
	for _, p := range f.NATS {
		wg.Go(func() { p.Stop(5 * time.Second) })
	}
	wg.Wait()
	all = append(all, f.NATS...)
	if f.t.Failed() {
		for _, p := range all {
			f.t.Logf("--- %s log (last 3 KiB) ---\n%s", p.Name, p.Tail(3<<10))
		}
	}
	if dir := os.Getenv("TM_FAULT_LOGS"); dir != "" {
		for _, p := range all {
			if b, err := os.ReadFile(p.log); err == nil {
				_ = os.WriteFile(filepath.Join(dir, strings.ReplaceAll(f.t.Name(), "/", "_")+"-"+p.Name+".log"), b, 0o644)
			}
		}
	}
}

// FillDisk fills the file system of a NATS node's store (a tmpfs with Options.NATSStoreSize)
// with a file until no byte is left.
func (p *Proc) FillDisk() error {
	if p.store == "" {
		return errors.New(p.Name + " is not a NATS node")
	}
	fh, err := os.Create(filepath.Join(p.store, "filler"))
	if err != nil {
		return err
	}
	defer fh.Close()
	chunk := make([]byte, 1<<20)
	for range 64 << 10 { // 64 GiB at most: a tmpfs ends long before
		if _, err := fh.Write(chunk); err != nil {
			if errors.Is(err, syscall.ENOSPC) {
				return nil
			}
			return err
		}
	}
	return errors.New("the disk of " + p.Name + " did not fill")
}

// FreeDisk removes what FillDisk wrote.
func (p *Proc) FreeDisk() error {
	return os.Remove(filepath.Join(p.store, "filler"))
}
