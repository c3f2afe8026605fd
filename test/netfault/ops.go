package netfault

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Tenants names n tenants of a scenario.
func Tenants(scenario string, n int) []string {
	var out []string
	for i := range n {
		out = append(out, fmt.Sprintf("%s-%d", strings.ToLower(scenario), i))
	}
	return out
}

// builds are the binaries built in this test process, by package list.
var builds = struct {
	sync.Mutex
	dirs map[string]*build
}{dirs: map[string]*build{}}

type build struct {
	once sync.Once
	dir  string
	err  error
}

// Binaries builds the fleet's binaries (FleetPackages) from the working tree once per test
// process and returns their directory; RemoveBinaries (in TestMain) removes it.
func Binaries(t testing.TB) string {
	t.Helper()
	return BinariesOf(t, FleetPackages...)
}

// BinariesOf is Binaries for the main packages pkgs (paths from the repository's root,
// "./..."): each list is built once per test process.
func BinariesOf(t testing.TB, pkgs ...string) string {
	t.Helper()
	builds.Lock()
	b := builds.dirs[strings.Join(pkgs, " ")]
	if b == nil {
		b = &build{}
		builds.dirs[strings.Join(pkgs, " ")] = b
	}
	builds.Unlock()
	b.once.Do(func() {
		b.dir, b.err = os.MkdirTemp("", "netfault-bin-")
		if b.err == nil {
			root, _ := filepath.Abs(RepoRoot())
			b.err = BuildPackages(root, b.dir, pkgs...)
		}
	})
	if b.err != nil {
		t.Fatal(b.err)
	}
	return b.dir
}

// RemoveBinaries removes what Binaries and BinariesOf built.
func RemoveBinaries() {
	builds.Lock()
	defer builds.Unlock()
	for _, b := range builds.dirs {
		if b.dir != "" {
			_ = os.RemoveAll(b.dir)
		}
	}
}

// RepoRoot is the repository's root, found from the working directory (a test runs in its
// package's directory).
func RepoRoot() string {
	dir, _ := os.Getwd()
	for d := dir; d != filepath.Dir(d); d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
			return d
		}
	}
	return dir
}

// Move plans a move of tenant to targets (kind -> shard) through the rebalancer's API, applies
// it (waiting out another apply under way, as an operator would) and waits until it is done.
// It may be called from any goroutine.
func (f *Fleet) Move(tenant string, targets map[string]string) error {
	code, b, err := f.Admin("POST", "/api/plans", map[string]any{"strategy": "move-tenant", "tenant": tenant, "targets": targets})
	var p struct {
		Plan struct{ ID string } `json:"plan"`
	}
	if err != nil || code >= 300 || json.Unmarshal(b, &p) != nil || p.Plan.ID == "" {
		return fmt.Errorf("plan a move of %s: %d %s %v", tenant, code, b, err)
	}
	// One apply at a time per rebalancer: a 409 busy is waited out, as an operator would.
	for deadline := time.Now().Add(2 * time.Minute); ; {
		code, b, err := f.Admin("POST", "/api/plans/"+p.Plan.ID+"/apply", nil)
		if err == nil && code < 300 {
			break
		}
		if err != nil || code != http.StatusConflict || !strings.Contains(string(b), "/problems/busy") || time.Now().After(deadline) {
			return fmt.Errorf("apply %s: %d %s %v", p.Plan.ID, code, b, err)
		}
		time.Sleep(200 * time.Millisecond) // until the other apply is done
	}
	for deadline := time.Now().Add(2 * time.Minute); ; {
		var st struct {
			Plan  struct{ Status string }  `json:"plan"`
			Moves []struct{ State string } `json:"moves"`
		}
		code, b, err := f.Admin("GET", "/api/plans/"+p.Plan.ID, nil)
		if err == nil && code == http.StatusOK && json.Unmarshal(b, &st) == nil {
			switch st.Plan.Status {
			case "done":
				return nil
			case "partial":
				// Consistent if every move is done, aborted (an abort before the commit leaves
				// the tenant on its source: a move whose source or target was replaced under it
				// may abort) or skipped (its tenant changed since the plan was made).
				for _, m := range st.Moves {
					if m.State != "done" && m.State != "aborted" && m.State != "skipped" {
						return fmt.Errorf("plan %s ended partial with a move %s: %s", p.Plan.ID, m.State, b)
					}
				}
				return nil
			case "rolled_back", "failed":
				return fmt.Errorf("plan %s ended %s: %s", p.Plan.ID, st.Plan.Status, b)
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("plan %s not done within 2 minutes: %d %s %v", p.Plan.ID, code, b, err)
		}
		time.Sleep(50 * time.Millisecond) // polling the plan's state
	}
}

// AwaitReplicas waits until every replica of the placement and event streams is current (a
// NATS node that was cut off, restarted or out of disk has caught up).
func (f *Fleet) AwaitReplicas(t testing.TB, within time.Duration) {
	t.Helper()
	js, err := jetstream.New(f.Connect())
	if err != nil {
		t.Fatal(err)
	}
	streams := []string{"KV_tm_placement_aggregate", "TM_EVENTS"}
	deadline := time.Now().Add(within)
	for _, name := range streams {
		for {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			s, err := js.Stream(ctx, name)
			var info *jetstream.StreamInfo
			if err == nil {
				info, err = s.Info(ctx)
			}
			cancel()
			whole := err == nil && info.Cluster != nil && info.Cluster.Leader != "" && len(info.Cluster.Replicas) == 2
			if whole {
				for _, r := range info.Cluster.Replicas {
					whole = whole && r.Current && !r.Offline
				}
			}
			if whole {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("stream %s not whole within %s: %+v %v", name, within, info, err)
			}
			time.Sleep(200 * time.Millisecond) // polling the stream's state
		}
	}
}
