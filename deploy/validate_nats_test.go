package deploy

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/tenantmesh/tenantmesh/internal/natsauth"
)

// --- NATS ------------------------------------------------------------------------------------

// checkNATSConfig loads a config with nats-server's own parser and checks it is a node of a
// 3-route JetStream cluster with bounded stores.
func checkNATSConfig(t *testing.T, path string, env map[string]string, wantRoutes []string) {
	t.Helper()
	for k, v := range env {
		t.Setenv(k, v)
	}
	// The config includes the trust chain's auth.conf (rebalance auth init writes it at
	// deploy time): load a copy beside a generated one.
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	inc := regexp.MustCompile(`(?m)^\s*include\s+(\S+)\s*$`).FindStringSubmatch(string(b))
	if inc == nil || filepath.Base(inc[1]) != "auth.conf" {
		t.Fatalf("%s: does not include auth.conf: NATS would let anyone in", path)
	}
	dir := t.TempDir()
	chain, err := natsauth.New()
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "auth.conf"), []byte(chain.ServerConfig()), 0o600); err != nil {
		t.Fatal(err)
	}
	copyPath := filepath.Join(dir, "nats.conf")
	if err := os.WriteFile(copyPath, []byte(strings.Replace(string(b), inc[0], "include auth.conf", 1)), 0o600); err != nil {
		t.Fatal(err)
	}
	opts, err := server.ProcessConfigFile(copyPath)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	if len(opts.TrustedOperators) != 1 || opts.SystemAccount == "" || opts.AccountResolver == nil {
		t.Errorf("%s: trusts %d operators, system account %q: want the tenantmesh chain", path, len(opts.TrustedOperators), opts.SystemAccount)
	}
	if opts.MaxControlLine < 64<<10 {
		t.Errorf("%s: max_control_line %d: a shard's user JWT needs 64KB", path, opts.MaxControlLine)
	}
	if opts.ServerName == "" || strings.HasPrefix(opts.ServerName, "$") {
		t.Errorf("%s: server_name %q did not come from the environment", path, opts.ServerName)
	}
	if !opts.JetStream {
		t.Errorf("%s: JetStream is not enabled", path)
	}
	if opts.StoreDir == "" || opts.JetStreamMaxMemory <= 0 || opts.JetStreamMaxStore <= 0 {
		t.Errorf("%s: JetStream store_dir %q, max_memory_store %d, max_file_store %d: want all set",
			path, opts.StoreDir, opts.JetStreamMaxMemory, opts.JetStreamMaxStore)
	}
	if opts.Cluster.Name == "" || opts.Cluster.Port != 6222 {
		t.Errorf("%s: cluster name %q port %d", path, opts.Cluster.Name, opts.Cluster.Port)
	}
	if opts.Port != 4222 || opts.HTTPPort != 8222 {
		t.Errorf("%s: client port %d, monitoring port %d; want 4222 and 8222", path, opts.Port, opts.HTTPPort)
	}
	var got []string
	for _, r := range opts.Routes {
		got = append(got, r.Host)
	}
	if len(got) != 3 || !slices.Equal(got, wantRoutes) {
		t.Errorf("%s: routes %v, want %v", path, got, wantRoutes)
	}
}

func TestNATSConfig(t *testing.T) {
	compose := loadCompose(t)
	var nodes, routes []string
	for name := range compose.Services {
		if strings.HasPrefix(name, "nats-") {
			nodes = append(nodes, name)
		}
	}
	sort.Strings(nodes)
	if len(nodes) != 3 {
		t.Fatalf("compose has NATS nodes %v, want 3", nodes)
	}
	names := map[string]bool{}
	for _, n := range nodes {
		routes = append(routes, n+":6222")
		svc := compose.Services[n]
		sn := svc.env()["NATS_SERVER_NAME"]
		if sn == "" || names[sn] {
			t.Errorf("compose %s: NATS_SERVER_NAME %q missing or not unique", n, sn)
		}
		names[sn] = true
		mounted := false
		for _, v := range svc.Volumes {
			if src, dst, _ := strings.Cut(v, ":"); filepath.Clean(filepath.Join("compose", src)) == filepath.Join("nats", "nats-cluster.conf") && strings.HasPrefix(dst, "/etc/nats/nats.conf") {
				mounted = true
			}
		}
		if !mounted || !slices.Contains(svc.Command, "/etc/nats/nats.conf") {
			t.Errorf("compose %s: does not run with deploy/nats/nats-cluster.conf", n)
		}
	}
	checkNATSConfig(t, "nats/nats-cluster.conf", map[string]string{"NATS_SERVER_NAME": "nats-1"}, routes)

	// compose and Kubernetes run the same NATS release.
	objs := loadK8s(t)
	if sts, ok := find(objs, "StatefulSet", "nats"); ok {
		img := getStr(getList(sts.o, "spec", "template", "spec", "containers")[0], "image")
		for _, n := range nodes {
			if compose.Services[n].Image != img {
				t.Errorf("compose %s runs %s, Kubernetes %s", n, compose.Services[n].Image, img)
			}
		}
	}
}
