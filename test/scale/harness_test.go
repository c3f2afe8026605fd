package scale

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/internal/embednats"
	"github.com/tenantmesh/tenantmesh/internal/natsauth"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit/natsconn"
	"github.com/tenantmesh/tenantmesh/shardkit/natsperm"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/test/netfault"
)

// Roles. NATS connections are named "<role>:<name>" (the gateway's and the rebalancer's by
// their binaries: roleOf), and the NATS servers' per-connection counters are summed by role.
// Processes have roles too: procNATS, procShards, roleGateway, roleRebalancer, roleHarness.
const (
	roleShard      = "shard"
	roleGateway    = "gateway"
	roleRebalancer = "rebalancer"
	roleWatcher    = "placement-watcher" // a shard group's placement watcher per kind, shared by its instances
	roleHarness    = "harness"

	procNATS   = "nats"
	procShards = "shard group"
)

// roleOf is the role of a NATS connection by its name: the gateway binary names its
// connection tm-gateway, the rebalancer's rebalancer-<holder>; the rest are "<role>:<name>".
func roleOf(name string) string {
	switch {
	case name == "tm-gateway":
		return roleGateway
	case strings.HasPrefix(name, "rebalancer-"):
		return roleRebalancer
	}
	role, _, _ := strings.Cut(name, ":")
	return cmp.Or(role, "other")
}

const adminToken = "scale-admin-token"

// packages are the binaries a run starts.
var packages = []string{"./gateway/cmd/gateway", "./rebalancer/cmd/rebalance", "./test/netfault/natsnode", "./test/scale/shardgroup"}

// harness owns everything a run starts; t.Cleanup stops it.
type harness struct {
	t   *testing.T
	p   params
	ctx context.Context
	bin string // the built binaries
	dir string // trust chain, credentials, NATS stores, logs

	chain    *natsauth.Chain
	creds    map[string]string // role name -> credentials file
	natsURLs string
	connz    []string // each NATS node's /connz URL
	admin    *schema.Store

	placements *placement.Watcher // the harness's own, every kind: where each tenant is, for plans
	eng        *rebalancer.Engine // stores plans and reads their moves in the shared KV; the rebalancer process applies them
	rebURL     string
	gateways   []string // base URLs

	mu    sync.Mutex
	procs []*member       // every process started, in order
	fleet map[string]bool // instance keys running
}

// member is one process of the platform and its role.
type member struct {
	role string
	*netfault.Proc
}

func newHarness(t *testing.T, p params, ctx context.Context) *harness {
	return &harness{t: t, p: p, ctx: ctx, bin: netfault.BinariesOf(t, packages...), dir: t.TempDir(),
		creds: map[string]string{}, fleet: map[string]bool{}}
}

// credsFor writes role's credentials once and returns the file.
func (h *harness) credsFor(role natsperm.Role) string {
	h.mu.Lock()
	defer h.mu.Unlock()
	if path, ok := h.creds[role.Name]; ok {
		return path
	}
	path, err := h.chain.WriteCreds(filepath.Join(h.dir, "creds"), role)
	if err != nil {
		h.t.Fatal(err)
	}
	h.creds[role.Name] = path
	return path
}

// connect opens a NATS connection of the test's own as role, named for the role statistics.
func (h *harness) connect(role natsperm.Role, name string) *nats.Conn {
	nc, err := natsconn.Connect(natsconn.Options{URL: h.natsURLs, Creds: h.credsFor(role)}, name, nil)
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(nc.Close)
	return nc
}

// proc makes a process of role that runs binary name with args, logging into the run's logs.
func (h *harness) proc(role, name, url, binary string, args ...string) *member {
	m := &member{role: role, Proc: netfault.HostProc(h.t, name, url, filepath.Join(h.dir, "logs"), filepath.Join(h.bin, binary), args...)}
	h.mu.Lock()
	h.procs = append(h.procs, m)
	h.mu.Unlock()
	return m
}

// members are the processes started so far.
func (h *harness) members() []*member {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.procs)
}

// stopAll stops every process (NATS last) and, if the test failed, logs the tail of each one's log.
func (h *harness) stopAll() {
	all := h.members()
	var wg sync.WaitGroup
	for _, m := range all {
		if m.role != procNATS {
			wg.Go(func() { m.Stop(10 * time.Second) })
		}
	}
	wg.Wait()
	for _, m := range all {
		if m.role == procNATS {
			wg.Go(func() { m.Stop(10 * time.Second) })
		}
	}
	wg.Wait()
	if h.t.Failed() {
		for _, m := range all {
			h.t.Logf("--- %s log (last 3 KiB) ---\n%s", m.Name, m.Tail(3<<10))
		}
	}
}

// start brings up the NATS nodes as processes and provisions tenantmesh's buckets.
func (h *harness) start() {
	var err error
	if h.chain, err = natsauth.LoadOrCreate(filepath.Join(h.dir, "auth")); err != nil {
		h.t.Fatal(err)
	}
	// The roles' scoped keys, before NATS starts (natsauth, scope.go): the fleet's shards are
	// shards of the built-in kinds without application assets.
	scopes := []natsperm.Role{natsperm.DefaultGateway()}
	for _, k := range kinds {
		scopes = append(scopes, natsperm.Shard(k, "scope", natsperm.Assets{}))
	}
	if _, err := natsperm.AddScopes(h.chain, scopes); err != nil {
		h.t.Fatal(err)
	}
	if err := h.chain.Save(); err != nil { // the NATS nodes read the account from it
		h.t.Fatal(err)
	}
	h.t.Cleanup(h.stopAll)
	ports, err := embednats.FreePorts("", 9)
	if err != nil {
		h.t.Fatal(err)
	}
	var urls []string
	for i := range 3 {
		urls = append(urls, "nats://127.0.0.1:"+strconv.Itoa(ports[i]))
		h.connz = append(h.connz, fmt.Sprintf("http://127.0.0.1:%d/connz", ports[6+i]))
	}
	h.natsURLs = strings.Join(urls, ",")
	var nodes []*member
	for i := range 3 {
		var routes []string
		for j := range 3 {
			if j != i {
				routes = append(routes, "nats://127.0.0.1:"+strconv.Itoa(ports[3+j]))
			}
		}
		name := fmt.Sprintf("nats%d", i+1)
		nodes = append(nodes, h.proc(procNATS, name, "", "natsnode", "--name", name, "--host", "127.0.0.1", "--cluster", "scale",
			"--port", strconv.Itoa(ports[i]), "--cluster-port", strconv.Itoa(ports[3+i]), "--routes", strings.Join(routes, ","),
			"--http-port", strconv.Itoa(ports[6+i]), "--store", filepath.Join(h.dir, "nats", name), "--auth", filepath.Join(h.dir, "auth")))
	}
	var wg sync.WaitGroup
	errs := make(chan error, len(nodes))
	for _, n := range nodes {
		wg.Go(func() { errs <- n.StartAwaitLine("ready", time.Minute) })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			h.t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(h.ctx, 2*time.Minute) // a new cluster elects its JetStream meta leader first
	defer cancel()
	nc := h.connect(natsperm.Rebalancer(), roleHarness+":admin")
	if h.admin, err = schema.OpenRetry(ctx, nc, schema.Options{Replicas: h.p.Replicas}); err != nil {
		h.t.Fatalf("open the store: %v", err)
	}
	if err := h.admin.Provision(ctx); err != nil {
		h.t.Fatal(err)
	}
	for _, k := range kinds {
		if _, err := h.admin.Placements(k).KV(ctx); err != nil {
			h.t.Fatal(err)
		}
	}
	if h.eng, err = rebalancer.New(rebalancer.Config{Store: h.admin, Holder: "scale-harness"}); err != nil {
		h.t.Fatal(err)
	}
}

// load places p.Tenants tenants in each kind, tenant i on shard i mod maxShards, with async
// publishes (a window of 2,000 outstanding, nats.go's stall limit being 4,000).
func (h *harness) load() time.Duration {
	t0 := time.Now()
	js := h.admin.JS().JetStream()
	shards := h.p.maxShards()
	for _, k := range kinds {
		prefix := schema.PlacementSubjectPrefix(k)
		for i := range h.p.Tenants {
			val := fmt.Sprintf(`{"kind":%q,"tenant":%q,"shard":%q,"epoch":1,"phase":"active","updated_at":"2026-11-25T10:00:00Z"}`,
				k, tenantName(i), shardName(k, i%shards))
			if _, err := js.PublishAsync(prefix+tenantName(i), []byte(val)); err != nil {
				h.t.Fatal(err)
			}
			if i%2000 == 1999 {
				h.awaitPublishes(js)
			}
		}
		h.awaitPublishes(js)
	}
	return time.Since(t0)
}

func (h *harness) awaitPublishes(js interface{ PublishAsyncComplete() <-chan struct{} }) {
	select {
	case <-js.PublishAsyncComplete():
	case <-time.After(time.Minute):
		h.t.Fatal("placement publishes not acknowledged within a minute")
	}
}

// startPlacements starts the harness's placement watcher of every kind from a full read and
// writes each kind's compacted snapshot from it, as the rebalancer leader does every
// CompactEvery changes, for the cold starts that follow. The watcher stays: plans read where
// each tenant is from it.
func (h *harness) startPlacements() {
	w, err := placement.New(placement.Config{Store: h.admin, Kinds: kinds, NoSnapshot: true})
	if err != nil {
		h.t.Fatal(err)
	}
	h.placements = w
	h.goRun("placement watcher", w.Run)
	ctx, cancel := context.WithTimeout(h.ctx, 5*time.Minute)
	defer cancel()
	if err := w.WaitReady(ctx); err != nil {
		h.t.Fatal(err)
	}
	for _, k := range kinds {
		if err := w.WriteSnapshot(ctx, k); err != nil {
			h.t.Fatalf("snapshot of %s: %v", k, err)
		}
	}
}

// goRun runs fn until the test ends.
func (h *harness) goRun(what string, fn func(context.Context) error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := fn(ctx); err != nil && ctx.Err() == nil {
			h.t.Errorf("%s: %v", what, err)
		}
	}()
	h.t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(time.Minute):
			h.t.Errorf("%s did not stop within a minute", what)
		}
	})
}

// freePort is a free port on 127.0.0.1 for a process to listen on.
func (h *harness) freePort() int {
	ports, err := embednats.FreePorts("", 1)
	if err != nil {
		h.t.Fatal(err)
	}
	return ports[0]
}

// natsFlags are the NATS flags of a gateway or the rebalancer, connecting as role.
func (h *harness) natsFlags(role natsperm.Role) []string {
	return []string{"--nats-url", h.natsURLs, "--nats-creds", h.credsFor(role), "--replicas", strconv.Itoa(h.p.Replicas),
		"--log-level", "warn", "--log-format", "text"}
}

// startRebalancer runs `rebalance serve` (leader lease, sweeper, compaction, API; autopilot
// off) and waits until it leads.
func (h *harness) startRebalancer() {
	addr := "127.0.0.1:" + strconv.Itoa(h.freePort())
	h.rebURL = "http://" + addr
	args := []string{"serve", "--addr", addr, "--holder", "r1", "--admin-token", adminToken, "--autopilot", "off"}
	switch {
	case h.p.PauseBudget < 0:
		args = append(args, "--pause-budget", "0") // the plan's concurrency throughout
	case h.p.PauseBudget > 0:
		args = append(args, "--pause-budget", h.p.PauseBudget.String())
	}
	m := h.proc(roleRebalancer, "rebalancer", h.rebURL, "rebalance", append(args, h.natsFlags(natsperm.Rebalancer())...)...)
	if err := m.Start(); err != nil {
		h.t.Fatal(err)
	}
	if err := m.AwaitReady(2 * time.Minute); err != nil {
		h.t.Fatal(err)
	}
	deadline := time.Now().Add(time.Minute)
	for !h.rebalancerLeads() {
		if time.Now().After(deadline) {
			h.t.Fatalf("the rebalancer did not take the lease within a minute:\n%s", m.Tail(3<<10))
		}
		time.Sleep(100 * time.Millisecond) // polling the lease; the API offers no event for it
	}
}

// rebalancerLeads asks the rebalancer's /readyz whether it holds the leader lease.
func (h *harness) rebalancerLeads() bool {
	var ready struct{ Leader bool }
	code, body := h.call(http.MethodGet, h.rebURL+"/readyz")
	return code == http.StatusOK && json.Unmarshal(body, &ready) == nil && ready.Leader
}

// coldStart is one gateway's start: time until its /readyz answers 200, and its resident
// memory then.
type coldStart struct {
	Ready time.Duration
	RSS   int64
}

// startGateway runs a gateway process and measures its cold start.
func (h *harness) startGateway(i int) coldStart {
	addr := "127.0.0.1:" + strconv.Itoa(h.freePort())
	url := "http://" + addr
	m := h.proc(roleGateway, fmt.Sprintf("gateway%d", i+1), url, "gateway", append([]string{"--addr", addr,
		"--gateway-id", fmt.Sprintf("gw%d", i), "--admin-token", adminToken, "--trust-tenant-header", "--shutdown-timeout", "5s"},
		h.natsFlags(natsperm.DefaultGateway())...)...)
	t0 := time.Now()
	if err := m.Start(); err != nil {
		h.t.Fatal(err)
	}
	hc := &http.Client{Timeout: time.Second}
	for {
		if resp, err := hc.Get(url + "/readyz"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		if m.Exited() || time.Since(t0) > 5*time.Minute {
			h.t.Fatalf("gateway %d not ready within 5 minutes:\n%s", i+1, m.Tail(3<<10))
		}
		time.Sleep(10 * time.Millisecond) // polling another process's readiness, finely: this is the figure
	}
	cs := coldStart{Ready: time.Since(t0)}
	u, err := readUsage(m.PID())
	if err != nil {
		h.t.Fatal(err)
	}
	cs.RSS = u.RSS
	h.gateways = append(h.gateways, url)
	return cs
}

// growFleet starts shard groups until the fleet has n instances: shards
// 0..shardsPerKind(n)-1 of every kind, PerShard instances each, at most p.Group instances per
// group, two groups starting at a time.
func (h *harness) growFleet(n int) int {
	shards := h.p.shardsPerKind(n)
	var todo []string
	for s := range shards {
		for _, k := range kinds {
			h.credsFor(natsperm.Shard(k, shardName(k, s), natsperm.Assets{}))
			for i := range h.p.PerShard {
				key := schema.InstanceID{Kind: k, Shard: shardName(k, s), Instance: fmt.Sprintf("i%d", i)}.Key()
				if !h.fleet[key] {
					todo = append(todo, key)
				}
			}
		}
	}
	for _, k := range kinds {
		h.credsFor(natsperm.Shard(k, "watcher", natsperm.Assets{}))
	}
	var groups []*member
	size := 0 // the added instances in as few groups of at most p.Group as hold them, of even sizes
	if len(todo) > 0 {
		n := (len(todo) + h.p.Group - 1) / h.p.Group
		size = (len(todo) + n - 1) / n
	}
	for len(todo) > 0 {
		part := todo[:min(size, len(todo))]
		todo = todo[len(part):]
		name := fmt.Sprintf("shards%d", len(h.groupsRunning())+1) // h.proc counts it from here on
		groups = append(groups, h.proc(procShards, name, "", "shardgroup", "--name", name, "--nats-url", h.natsURLs,
			"--creds-dir", filepath.Join(h.dir, "creds"), "--instances", strings.Join(part, ","),
			"--heartbeat", h.p.Heartbeat.String(), "--replicas", strconv.Itoa(h.p.Replicas), "--parallel", "4",
			"--admin-token", adminToken))
		for _, key := range part {
			h.fleet[key] = true
		}
	}
	sem := make(chan struct{}, 2)
	errs := make(chan error, len(groups))
	var wg sync.WaitGroup
	started := time.Now()
	for _, g := range groups {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			err := g.StartAwaitLine("ready", 10*time.Minute)
			if err == nil {
				h.t.Logf("%s ready after %s", g.Name, time.Since(started).Round(time.Millisecond))
			}
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			h.t.Fatal(err)
		}
	}
	return len(h.fleet)
}

// groupsRunning are the shard groups started so far.
func (h *harness) groupsRunning() []*member {
	var out []*member
	for _, m := range h.members() {
		if m.role == procShards {
			out = append(out, m)
		}
	}
	return out
}

// call sends a request to a process's API with the admin token and returns the answer.
func (h *harness) call(method, url string) (int, []byte) {
	req, _ := http.NewRequestWithContext(h.ctx, method, url, nil)
	req.Header.Set("Authorization", "Bearer "+adminToken)
	resp, err := tmtest.HTTP.Do(req)
	if err != nil {
		return 0, []byte(err.Error())
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return resp.StatusCode, body
}

// connzOf reads one NATS node's connections (with subscriptions' details if subs).
func (h *harness) connzOf(url string, subs bool) *natsserver.Connz {
	q := "?limit=1000000"
	if subs {
		q += "&subs=detail"
	}
	req, _ := http.NewRequestWithContext(h.ctx, http.MethodGet, url+q, nil)
	resp, err := tmtest.HTTP.Do(req)
	if err != nil {
		h.t.Fatalf("read %s: %v", url, err)
	}
	defer resp.Body.Close()
	var cz natsserver.Connz
	if resp.StatusCode != http.StatusOK {
		h.t.Fatalf("read %s: %s", url, resp.Status)
	}
	if err := json.NewDecoder(resp.Body).Decode(&cz); err != nil {
		h.t.Fatalf("read %s: %v", url, err)
	}
	return &cz
}

// roleStats are one role's NATS counters, summed over its connections on every server.
type roleStats struct {
	Conns             int
	InMsgs, OutMsgs   int64 // InMsgs: what the role's connections sent; OutMsgs: what they received
	InBytes, OutBytes int64
}

// natsStats sums every server's per-connection counters by role (roleOf the connection's name).
func (h *harness) natsStats() map[string]roleStats {
	out := map[string]roleStats{}
	for _, url := range h.connz {
		for _, c := range h.connzOf(url, false).Conns {
			role := roleOf(c.Name)
			r := out[role]
			r.Conns++
			r.InMsgs += c.InMsgs
			r.OutMsgs += c.OutMsgs
			r.InBytes += c.InBytes
			r.OutBytes += c.OutBytes
			out[role] = r
		}
	}
	return out
}

// logTopSubs logs role's 8 busiest subscriptions (messages delivered since each was made,
// summed by subject over the role's connections and the servers): what a role receives, by
// what it asked for.
func (h *harness) logTopSubs(role string) {
	bySubject := map[string]uint64{}
	for _, url := range h.connz {
		for _, c := range h.connzOf(url, true).Conns {
			if roleOf(c.Name) != role {
				continue
			}
			for _, sd := range c.SubsDetail {
				bySubject[sd.Subject] += uint64(sd.Msgs)
			}
		}
	}
	subjects := slices.Collect(maps.Keys(bySubject))
	slices.SortFunc(subjects, func(a, b string) int { return cmp.Compare(bySubject[b], bySubject[a]) })
	for _, subj := range subjects[:min(8, len(subjects))] {
		h.t.Logf("%s receives on %s: %d messages", role, subj, bySubject[subj])
	}
}

// rates is what each role received and sent per second between two natsStats.
type rates struct {
	Conns                                    int
	RecvMsgs, RecvBytes, SentMsgs, SentBytes float64 // per second, all connections of the role
}

func diffStats(a, b map[string]roleStats, d time.Duration) map[string]rates {
	out := map[string]rates{}
	s := d.Seconds()
	for role, y := range b {
		x := a[role]
		out[role] = rates{Conns: y.Conns, RecvMsgs: float64(y.OutMsgs-x.OutMsgs) / s, RecvBytes: float64(y.OutBytes-x.OutBytes) / s,
			SentMsgs: float64(y.InMsgs-x.InMsgs) / s, SentBytes: float64(y.InBytes-x.InBytes) / s}
	}
	return out
}
