// Package netfault is the fault harness of tenantmesh's partition tests: every process of a
// fleet (each NATS node, shard instance, gateway and the rebalancer) runs in a network
// namespace of its own, with its own address on a bridge, so that an nftables rule can cut
// exactly one link (both directions, or one only), while the test itself, on the bridge's
// address in the host's namespace, still reaches every process over HTTP. It needs root,
// ip(8) and nft(8); New skips the test with the reason when it cannot have them (or fails
// it under TM_REQUIRE_TOOLS=1, as make test and CI set). tc netem is not used: it does not
// work on this project's machines.
//
// Everything a Net makes is named with a prefix unique to the test run (namespaces, veths,
// the bridge) and removed in t.Cleanup, failed test or not; a run that was killed before its
// cleanup is swept by the next New (its owner PID, kept in the state directory, is gone).
package netfault

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// stateDir keeps one file per live Net (its prefix, holding its owner's PID and bridge), so
// that a later run can remove what a killed one left.
const stateDir = "/run/tenantmesh-netfault"

// Net is a bridge in the host's namespace and the namespaces attached to it.
type Net struct {
	t      testing.TB
	prefix string // e.g. tf3a9c1: every name starts with it
	bridge string
	subnet string // "10.201.37." : hosts are subnet+N
	hostIP string // the bridge's address, the test's own

	mu     sync.Mutex
	nodes  []*Node
	mounts []string
}

// Node is one namespace with one address.
type Node struct {
	Name string // the role's name, e.g. nats1, aggregate-1
	NS   string // the namespace
	IP   string
	net  *Net
}

// Requirements says why namespaces cannot be made here, or nil.
func Requirements() error {
	if os.Geteuid() != 0 {
		return errors.New("network namespaces need root")
	}
	for _, tool := range []string{"ip", "nft"} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%s(8) is not installed (make tools installs nftables)", tool)
		}
	}
	return nil
}

// New makes a bridge on a fresh /24 for t, or skips t with the reason it cannot (fails it
// under TM_REQUIRE_TOOLS). Everything is removed when t ends.
func New(t testing.TB) *Net {
	t.Helper()
	if err := Requirements(); err != nil {
		if os.Getenv("TM_REQUIRE_TOOLS") != "" {
			t.Fatalf("fault harness: %v (TM_REQUIRE_TOOLS is set: make test and CI need it)", err)
		}
		t.Skipf("fault harness: %v (set TM_REQUIRE_TOOLS=1 to make this a failure, as make test does)", err)
	}
	sweep(t)
	var b [3]byte
	_, _ = rand.Read(b[:])
	n := &Net{t: t, prefix: "tf" + hex.EncodeToString(b[:])[:5]}
	n.bridge = n.prefix
	if err := os.MkdirAll(stateDir, 0o755); err != nil {
		t.Fatal(err)
	}
	subnet, err := freeSubnet()
	if err != nil {
		t.Fatal(err)
	}
	n.subnet, n.hostIP = subnet, subnet+"1"
	if err := os.WriteFile(filepath.Join(stateDir, n.prefix), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.remove)
	n.must("ip", "link", "add", n.bridge, "type", "bridge")
	n.must("ip", "addr", "add", n.hostIP+"/24", "dev", n.bridge)
	n.must("ip", "link", "set", n.bridge, "up")
	return n
}

// HostIP is the test's own address on the bridge: every node reaches it.
func (n *Net) HostIP() string { return n.hostIP }

// Subnet is the bridge's network in CIDR notation.
func (n *Net) Subnet() string { return n.subnet + "0/24" }

// Node makes a namespace named after role, with the next address, its loopback up and an
// empty nftables table (tmfault) whose input and output chains the faults fill.
func (n *Net) Node(role string) *Node {
	n.t.Helper()
	n.mu.Lock()
	idx := len(n.nodes) + 10
	n.mu.Unlock()
	if idx > 250 {
		n.t.Fatal("netfault: at most 240 nodes on one net")
	}
	node := &Node{Name: role, NS: fmt.Sprintf("%s-%d", n.prefix, idx), IP: n.subnet + strconv.Itoa(idx), net: n}
	veth := fmt.Sprintf("%s-%d", n.prefix, idx) // the host end; 10 characters at most
	n.must("ip", "netns", "add", node.NS)
	n.mu.Lock()
	n.nodes = append(n.nodes, node)
	n.mu.Unlock()
	n.must("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", node.NS)
	n.must("ip", "link", "set", veth, "master", n.bridge, "up")
	n.must("ip", "-n", node.NS, "addr", "add", node.IP+"/24", "dev", "eth0")
	n.must("ip", "-n", node.NS, "link", "set", "eth0", "up")
	n.must("ip", "-n", node.NS, "link", "set", "lo", "up")
	node.nft(`add table inet tmfault
add chain inet tmfault input { type filter hook input priority 0; policy accept; }
add chain inet tmfault output { type filter hook output priority 0; policy accept; }`)
	return node
}

// Command is name with args run inside the node's namespace (ip netns exec execs it in
// place, so the command's PID is the program's own). It dies with the test process.
func (node *Node) Command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command("ip", append([]string{"netns", "exec", node.NS, name}, args...)...)
	cmd.SysProcAttr = childAttr()
	return cmd
}

// Cut drops every packet between node and the others, both ways, until Heal.
func (node *Node) Cut(others ...*Node) {
	var b strings.Builder
	for _, o := range others {
		fmt.Fprintf(&b, "add rule inet tmfault input ip saddr %s drop\nadd rule inet tmfault output ip daddr %s drop\n", o.IP, o.IP)
	}
	node.nft(b.String())
}

// DropFrom drops the packets others send to node, and only those: node's own packets to them
// still arrive (asymmetric loss).
func (node *Node) DropFrom(others ...*Node) {
	var b strings.Builder
	for _, o := range others {
		fmt.Fprintf(&b, "add rule inet tmfault input ip saddr %s drop\n", o.IP)
	}
	node.nft(b.String())
}

// Heal removes node's fault rules.
func (node *Node) Heal() {
	node.nft("flush chain inet tmfault input\nflush chain inet tmfault output")
}

// HealAll removes every node's fault rules.
func (n *Net) HealAll() {
	n.mu.Lock()
	nodes := append([]*Node(nil), n.nodes...)
	n.mu.Unlock()
	for _, node := range nodes {
		node.Heal()
	}
}

func (node *Node) nft(script string) {
	node.net.t.Helper()
	cmd := exec.Command("ip", "netns", "exec", node.NS, "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	if out, err := run(cmd); err != nil {
		node.net.t.Fatalf("nft in %s (%s): %v\n%s\n%s", node.NS, node.Name, err, script, out)
	}
}

// Tmpfs mounts a tmpfs of size bytes on a new directory and returns it: a disk that fills.
// It is unmounted and removed when the test ends (after the fleet's processes stopped).
func (n *Net) Tmpfs(size int64) string {
	n.t.Helper()
	dir, err := os.MkdirTemp("", n.prefix+"-tmpfs-")
	if err != nil {
		n.t.Fatal(err)
	}
	n.mu.Lock()
	n.mounts = append(n.mounts, dir)
	n.mu.Unlock()
	n.must("mount", "-t", "tmpfs", "-o", fmt.Sprintf("size=%d", size), "tmpfs", dir)
	return dir
}

func (n *Net) must(name string, args ...string) {
	n.t.Helper()
	if out, err := run(exec.Command(name, args...)); err != nil {
		n.t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
}

// run runs cmd with a deadline (every command the harness runs is a quick one).
func run(cmd *exec.Cmd) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := exec.CommandContext(ctx, cmd.Path, cmd.Args[1:]...)
	c.Stdin = cmd.Stdin
	var out bytes.Buffer
	c.Stdout, c.Stderr = &out, &out
	err := c.Run()
	return out.Bytes(), err
}

// remove deletes the namespaces (their veths go with them), the bridge, the mounts and the
// state file. The processes in the namespaces must be gone first (the fleet's cleanup, which
// runs before this one, kills them).
func (n *Net) remove() {
	n.mu.Lock()
	nodes, mounts := n.nodes, n.mounts
	n.mu.Unlock()
	for _, dir := range mounts {
		if out, err := run(exec.Command("umount", "-l", dir)); err != nil {
			n.t.Logf("netfault: umount %s: %v %s", dir, err, out)
		}
		_ = os.RemoveAll(dir)
	}
	for _, node := range nodes {
		if out, err := run(exec.Command("ip", "netns", "del", node.NS)); err != nil {
			n.t.Logf("netfault: ip netns del %s: %v %s", node.NS, err, out)
		}
	}
	if out, err := run(exec.Command("ip", "link", "del", n.bridge)); err != nil {
		n.t.Logf("netfault: ip link del %s: %v %s", n.bridge, err, out)
	}
	_ = os.Remove(filepath.Join(stateDir, n.prefix))
}

// sweep removes what runs killed before their cleanup left: the namespaces and bridge of
// every prefix in stateDir whose owner process is gone.
func sweep(t testing.TB) {
	entries, _ := os.ReadDir(stateDir)
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(stateDir, e.Name()))
		pid, perr := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || perr != nil || pid <= 0 || processAlive(pid) {
			continue
		}
		prefix := e.Name()
		out, _ := run(exec.Command("ip", "netns", "list"))
		for _, line := range strings.Split(string(out), "\n") {
			if f := strings.Fields(line); len(f) > 0 && strings.HasPrefix(f[0], prefix+"-") {
				_, _ = run(exec.Command("ip", "netns", "del", f[0]))
			}
		}
		_, _ = run(exec.Command("ip", "link", "del", prefix))
		_ = os.Remove(filepath.Join(stateDir, prefix))
		t.Logf("netfault: removed what a killed run (pid %d, %s) left", pid, prefix)
	}
}

// freeSubnet picks a 10.2xx.y.0/24 that no interface of the host's namespace is on.
func freeSubnet() (string, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return "", err
	}
	var b [2]byte
	for range 100 {
		_, _ = rand.Read(b[:])
		subnet := fmt.Sprintf("10.%d.%d.", 200+int(b[0])%50, b[1])
		_, cidr, _ := net.ParseCIDR(subnet + "0/24")
		taken := false
		for _, a := range addrs {
			if ipn, ok := a.(*net.IPNet); ok && (cidr.Contains(ipn.IP) || ipn.Contains(cidr.IP)) {
				taken = true
			}
		}
		if !taken {
			return subnet, nil
		}
	}
	return "", errors.New("netfault: no free 10.2xx.y.0/24 subnet")
}
