package dashboard_test

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"

	"github.com/chromedp/chromedp"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/rebalancer/autopilot"
	"github.com/tenantmesh/tenantmesh/rebalancer/server"
	"github.com/tenantmesh/tenantmesh/rebalancer/sweeper"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// chromium finds a Chromium binary. make tools installs Debian's chromium package (as CI's
// .ci/run does through it); under make test (TM_REQUIRE_TOOLS=1) or in CI a missing one fails
// the test rather than skipping it, so the dashboard's browser checks cannot silently vanish.
// A plain go test on a machine without it skips, naming the install.
func chromium(t *testing.T) string {
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	const msg = "no chromium installed (make tools, or apt-get install chromium)"
	if os.Getenv("CI") != "" || os.Getenv("TM_REQUIRE_TOOLS") != "" {
		t.Fatal(msg + ": make test and CI need it")
	}
	t.Skip(msg + "; set TM_REQUIRE_TOOLS=1 to make this a failure, as make test does")
	return ""
}

func startShard(t *testing.T, st *schema.Store, shard string, hooks shardkit.Hooks) {
	kittest.Shard(t, shardkit.Config{Store: st, ID: schema.InstanceID{Kind: "aggregate", Shard: shard}, Hooks: hooks,
		Labels: map[string]string{"region": "eu"}})
}

// adminToken is the rebalancer's admin token in these tests; post sends it.
const adminToken = "dash-test-token"

func post(t *testing.T, url string, body any) []byte {
	t.Helper()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequest(http.MethodPost, url, bytes.NewReader(b))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+adminToken)
	resp, err := tmtest.HTTP.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out bytes.Buffer
	_, _ = out.ReadFrom(resp.Body)
	if resp.StatusCode >= 300 {
		t.Fatalf("POST %s: %d %s", url, resp.StatusCode, out.String())
	}
	return out.Bytes()
}

// TestDashboardShowsInstancesAndMoveProgress runs the rebalancer service with two real shards,
// opens the dashboard in headless Chromium, and watches a move go through its phases live.
func TestDashboardShowsInstancesAndMoveProgress(t *testing.T) {
	if testing.Short() {
		t.Skip("browser test")
	}
	path := chromium(t)
	srv := natstest.Server(t)
	ctx := context.Background()
	st := kittest.StoreAt(t, srv.URL())
	// The target's warm-up waits for the test, so the page can be seen showing "warming".
	release := make(chan struct{})
	startShard(t, st, "s-1", shardkit.Hooks{Sizes: func() []schema.TenantSize {
		return []schema.TenantSize{{Tenant: "acme", Events: 1500, EventBytes: 3 << 20}, {Tenant: "globex", Queued: 4}}
	}})
	startShard(t, st, "s-2", shardkit.Hooks{Warm: func(ctx context.Context, _ string, _ uint64) error {
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil
	}})
	for _, tenant := range []string{"acme", "globex", "initech"} {
		if _, err := st.Placements("aggregate").Create(ctx, schema.Placement{Tenant: tenant, Shard: "s-1"}); err != nil {
			t.Fatal(err)
		}
	}
	rs, err := server.New(server.Config{Store: st, Holder: "dash-test", NoCompact: true, AdminToken: adminToken})
	if err != nil {
		t.Fatal(err)
	}
	sctx, stop := context.WithCancel(ctx)
	if err := rs.Start(sctx); err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(rs.Handler())
	t.Cleanup(func() { stop(); rs.Wait(); ts.Close() })

	alloc, cancelAlloc := chromedp.NewExecAllocator(ctx, append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(path), chromedp.NoSandbox, chromedp.Flag("disable-gpu", true), chromedp.UserDataDir(t.TempDir()),
		chromedp.Flag("disable-background-networking", true), chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true), chromedp.Flag("no-first-run", true), chromedp.Flag("disable-quic", true),
		chromedp.WindowSize(1400, 1100))...)
	defer cancelAlloc()
	bctx, cancelBrowser := chromedp.NewContext(alloc)
	defer cancelBrowser()
	bctx, cancelTimeout := context.WithTimeout(bctx, 90*time.Second)
	defer cancelTimeout()

	// It loads and shows the instances, with status and labels, and the tenants per shard.
	err = chromedp.Do(bctx,
		chromedp.Navigate(ts.URL+"/"),
		chromedp.WaitVisible(chromedp.CSS(`tr[data-instance="aggregate.s-1.i1"]`)),
		chromedp.WaitVisible(chromedp.CSS(`tr[data-instance="aggregate.s-2.i1"]`)),
		chromedp.WaitVisible(chromedp.CSS(`.bar[data-shard="s-1"]`)),
		chromedp.WaitVisible(chromedp.CSS(`#live.s-online`)),
	)
	if err != nil {
		t.Fatalf("dashboard did not show the instances: %v", err)
	}
	// The largest tenants by stored size, from the shards' telemetry (the page polls every 5s).
	if err := chromedp.Do(bctx, chromedp.WaitVisible(chromedp.CSS(`tr[data-tenant="aggregate/acme"]`))); err != nil {
		t.Fatalf("dashboard did not show the tenant sizes: %v", err)
	}
	if sz, err := chromedp.Run(bctx, chromedp.Text(chromedp.CSS(`tr[data-tenant="aggregate/acme"]`))); err != nil || !strings.Contains(sz, "3.0 MiB") {
		t.Fatalf("acme's row %q (%v), want its 3.0 MiB", sz, err)
	}
	statusText, err := chromedp.Run(bctx, chromedp.Text(chromedp.CSS(`tr[data-instance="aggregate.s-1.i1"] .pill`)))
	if err != nil {
		t.Fatal(err)
	}
	labels, err := chromedp.Run(bctx, chromedp.Text(chromedp.CSS(`tr[data-instance="aggregate.s-1.i1"] .labels`)))
	if err != nil {
		t.Fatal(err)
	}
	if statusText != "online" || labels != "region=eu" {
		t.Fatalf("instance row: status %q labels %q", statusText, labels)
	}

	// A move, applied through the API, shows up live: warming while the target warms, then done.
	deadline := time.Now().Add(20 * time.Second)
	for !rs.IsLeader() {
		if time.Now().After(deadline) {
			t.Fatal("the service did not lead")
		}
		time.Sleep(20 * time.Millisecond) // polling the lease; no event to await
	}
	var created server.PlanResponse
	if err := json.Unmarshal(post(t, ts.URL+"/api/plans", map[string]any{"strategy": "manual", "kind": "aggregate",
		"moves": []map[string]string{{"tenant": "acme", "to": "s-2"}}}), &created); err != nil {
		t.Fatal(err)
	}
	post(t, ts.URL+"/api/plans/"+created.Plan.ID+"/apply", nil)
	move := `tr[data-move="` + created.Plan.ID + `/m00001"]`
	if err := chromedp.Do(bctx, chromedp.WaitVisible(chromedp.CSS(move+`[data-state="warming"]`))); err != nil {
		t.Fatalf("the move was not shown warming: %v", err)
	}
	shot, err := chromedp.Run(bctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	close(release)
	err = chromedp.Do(bctx,
		chromedp.WaitVisible(chromedp.CSS(move+`[data-state="done"]`)),
		chromedp.WaitVisible(chromedp.CSS(`#audit li`)),
	)
	if err != nil {
		t.Fatalf("the move was not shown done: %v", err)
	}
	planDone := `document.querySelector('[data-plan="` + created.Plan.ID + `"] .head .pill').textContent === "done"`
	if _, err := chromedp.Run(bctx, chromedp.Poll[bool](planDone, chromedp.WithPollingTimeout(20*time.Second))); err != nil {
		t.Fatalf("the plan was not shown done: %v", err)
	}
	// TM_SCREENSHOT=path keeps a picture of the page mid-move (docs/dashboard.png in the README).
	if out := os.Getenv("TM_SCREENSHOT"); out != "" {
		if err := os.WriteFile(filepath.Clean(out), shot, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// TestDashboardInstancePage opens one instance's page (seed 003's host page) in headless
// Chromium: its status with the operator's flag, its tenants and its status history.
func TestDashboardInstancePage(t *testing.T) {
	if testing.Short() {
		t.Skip("browser test")
	}
	path := chromium(t)
	srv := natstest.Server(t)
	ctx := context.Background()
	st := kittest.StoreAt(t, srv.URL())
	startShard(t, st, "s-1", shardkit.Hooks{})
	if _, err := st.Placements("aggregate").Create(ctx, schema.Placement{Tenant: "acme", Shard: "s-1"}); err != nil {
		t.Fatal(err)
	}
	rs, err := server.New(server.Config{Store: st, Holder: "dash-test", NoCompact: true, AdminToken: adminToken,
		Sweep: sweeper.Config{Interval: 200 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	sctx, stop := context.WithCancel(ctx)
	if err := rs.Start(sctx); err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(rs.Handler())
	t.Cleanup(func() { stop(); rs.Wait(); ts.Close() })
	key := "aggregate.s-1.i1"
	req, _ := http.NewRequest(http.MethodPut, ts.URL+"/api/instances/"+key+"/degraded", bytes.NewReader([]byte(`{"reason":"disk replacement"}`)))
	req.Header.Set("Authorization", "Bearer "+adminToken)
	resp, err := tmtest.HTTP.Do(req)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("flag: %v %v", err, resp)
	}
	resp.Body.Close()

	alloc, cancelAlloc := chromedp.NewExecAllocator(ctx, append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(path), chromedp.NoSandbox, chromedp.Flag("disable-gpu", true), chromedp.UserDataDir(t.TempDir()),
		chromedp.Flag("disable-background-networking", true), chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true), chromedp.Flag("no-first-run", true), chromedp.Flag("disable-quic", true))...)
	defer cancelAlloc()
	bctx, cancelBrowser := chromedp.NewContext(alloc)
	defer cancelBrowser()
	bctx, cancelTimeout := context.WithTimeout(bctx, 60*time.Second)
	defer cancelTimeout()

	// From the list, the instance's link opens its page.
	page := `#instance-page[data-instance="` + key + `"]`
	err = chromedp.Do(bctx,
		chromedp.Navigate(ts.URL+"/"),
		chromedp.WaitVisible(chromedp.CSS(`tr[data-instance="`+key+`"] a`)),
		chromedp.Click(chromedp.CSS(`tr[data-instance="`+key+`"] a`)),
		chromedp.WaitVisible(chromedp.CSS(page)),
		chromedp.WaitVisible(chromedp.CSS(`#ip-tenants li[data-tenant="acme"]`)),
		chromedp.WaitVisible(chromedp.CSS(`#ip-history li[data-to="degraded"]`)),
	)
	if err != nil {
		t.Fatalf("the instance page did not show: %v", err)
	}
	flag, err := chromedp.Run(bctx, chromedp.Text(chromedp.CSS(`#ip-flag`)))
	if err != nil {
		t.Fatal(err)
	}
	status, err := chromedp.Run(bctx, chromedp.Text(chromedp.CSS(`#ip-fields .pill`)))
	if err != nil {
		t.Fatal(err)
	}
	if status != "degraded" || flag != "flagged degraded by api/dash-test: disk replacement" {
		t.Fatalf("page: status %q flag %q", status, flag)
	}
}

// TestDashboardPlanControlAndAutopilot pauses and resumes a plan from the dashboard's buttons
// (the admin token asked once and kept for the tab), and shows the autopilot's mode.
func TestDashboardPlanControlAndAutopilot(t *testing.T) {
	if testing.Short() {
		t.Skip("browser test")
	}
	path := chromium(t)
	srv := natstest.Server(t)
	ctx := context.Background()
	st := kittest.StoreAt(t, srv.URL())
	release := make(chan struct{})
	startShard(t, st, "s-1", shardkit.Hooks{})
	startShard(t, st, "s-2", shardkit.Hooks{Warm: func(ctx context.Context, _ string, _ uint64) error {
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil
	}})
	for _, tenant := range []string{"acme", "globex"} {
		if _, err := st.Placements("aggregate").Create(ctx, schema.Placement{Tenant: tenant, Shard: "s-1"}); err != nil {
			t.Fatal(err)
		}
	}
	rs, err := server.New(server.Config{Store: st, Holder: "dash-test", NoCompact: true, AdminToken: adminToken,
		Autopilot: autopilot.Config{Mode: autopilot.DryRun, Startup: 100 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	sctx, stop := context.WithCancel(ctx)
	if err := rs.Start(sctx); err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(rs.Handler())
	t.Cleanup(func() { stop(); rs.Wait(); ts.Close() })
	for deadline := time.Now().Add(20 * time.Second); !rs.IsLeader(); {
		if time.Now().After(deadline) {
			t.Fatal("the service did not lead")
		}
		time.Sleep(20 * time.Millisecond) // polling the lease; no event to await
	}
	var created server.PlanResponse
	if err := json.Unmarshal(post(t, ts.URL+"/api/plans", map[string]any{"strategy": "manual", "kind": "aggregate", "concurrency": 1,
		"moves": []map[string]string{{"tenant": "acme", "to": "s-2"}, {"tenant": "globex", "to": "s-2"}}}), &created); err != nil {
		t.Fatal(err)
	}
	id := created.Plan.ID
	post(t, ts.URL+"/api/plans/"+id+"/apply", nil)

	alloc, cancelAlloc := chromedp.NewExecAllocator(ctx, append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(path), chromedp.NoSandbox, chromedp.Flag("disable-gpu", true), chromedp.UserDataDir(t.TempDir()),
		chromedp.Flag("disable-background-networking", true), chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true), chromedp.Flag("no-first-run", true), chromedp.Flag("disable-quic", true))...)
	defer cancelAlloc()
	bctx, cancelBrowser := chromedp.NewContext(alloc)
	defer cancelBrowser()
	bctx, cancelTimeout := context.WithTimeout(bctx, 60*time.Second)
	defer cancelTimeout()

	plan := `[data-plan="` + id + `"]`
	poll := func(what, expr string) {
		t.Helper()
		if _, err := chromedp.Run(bctx, chromedp.Poll[bool](expr, chromedp.WithPollingTimeout(20*time.Second))); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	status := func(want string) string {
		return `document.querySelector('` + plan + ` .head .pill')?.textContent === "` + want + `"`
	}
	if err := chromedp.Do(bctx, chromedp.Navigate(ts.URL+"/")); err != nil {
		t.Fatal(err)
	}
	if _, err := chromedp.Run(bctx, chromedp.Evaluate[any](`sessionStorage.setItem("tmAdminToken", "`+adminToken+`")`)); err != nil {
		t.Fatal(err)
	}
	poll("the autopilot's mode", `document.querySelector('#ap-mode').textContent.startsWith("dry-run")`)
	err = chromedp.Do(bctx,
		chromedp.WaitVisible(chromedp.CSS(`tr[data-move="`+id+`/m00001"][data-state="warming"]`)),
		chromedp.Click(chromedp.CSS(plan+` button[data-act="pause"]`)),
	)
	if err != nil {
		t.Fatalf("pausing from the dashboard: %v", err)
	}
	// The button's request is the page's: wait until the plan took it, then let the move under
	// way finish; the next one does not start.
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("the pause recorded", func() bool {
		rec, _, err := rs.Engine().Plan(ctx, id)
		return err == nil && rec.Control == "pause"
	}))
	close(release)
	poll("the plan shown paused", status("paused"))
	if rec, moves, err := rs.Engine().Plan(ctx, id); err != nil || rec.ControlBy != "dashboard" || moves[1].State != "pending" {
		t.Fatalf("paused plan %+v moves %+v: %v", rec, moves, err)
	}
	if err := chromedp.Do(bctx, chromedp.Click(chromedp.CSS(plan+` button[data-act="resume"]`))); err != nil {
		t.Fatalf("resuming from the dashboard: %v", err)
	}
	poll("the resumed plan shown done", status("done"))
}
