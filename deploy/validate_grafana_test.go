package deploy

import (
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// --- Grafana ---------------------------------------------------------------------------------

type grafanaPanel struct {
	ID         int             `json:"id"`
	Type       string          `json:"type"`
	Title      string          `json:"title"`
	Datasource json.RawMessage `json:"datasource"`
	GridPos    struct {
		H, W, X, Y int
	} `json:"gridPos"`
	Targets []struct {
		RefID string `json:"refId"`
		Expr  string `json:"expr"`
	} `json:"targets"`
	Panels  []grafanaPanel `json:"panels"`
	Options struct {
		AlertInstanceLabelFilter string `json:"alertInstanceLabelFilter"`
	} `json:"options"`
}

type grafanaDashboard struct {
	UID        string `json:"uid"`
	Title      string `json:"title"`
	Templating struct {
		List []struct {
			Name  string `json:"name"`
			Type  string `json:"type"`
			Query any    `json:"query"`
		} `json:"list"`
	} `json:"templating"`
	Panels []grafanaPanel `json:"panels"`
	Links  []struct {
		Title string `json:"title"`
		Type  string `json:"type"`
		URL   string `json:"url"`
	} `json:"links"`
}

var (
	metricRefRe = regexp.MustCompile(`\btm_[a-z0-9_]+`)
	rateArgRe   = regexp.MustCompile(`\b(?:rate|irate|increase)\(\s*(tm_[a-z0-9_]+)`)
)

// dashboardMetrics must be on the dashboard: the platform's key figures.
var dashboardMetrics = []string{
	"tm_gateway_requests_total", "tm_gateway_request_duration_seconds", "tm_gateway_hold_total",
	"tm_gateway_retries_total", "tm_gateway_circuit_state", "tm_placement_staleness_seconds",
	"tm_placement_entries", "tm_placement_watch_resumes_total", "tm_shard_in_flight",
	"tm_shard_requests_total", "tm_aggregate_commands_total", "tm_aggregate_append_conflicts_total",
	"tm_aggregate_rehydrate_seconds", "tm_aggregate_snapshot_loads_total", "tm_shard_tenant_lag",
	"tm_runner_jobs_created_total", "tm_runner_effects_total", "tm_rebalancer_move_stalled_seconds",
}

func TestGrafanaDashboard(t *testing.T) {
	b, err := os.ReadFile("grafana/tenantmesh-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var d grafanaDashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatal(err)
	}
	if d.UID == "" || d.Title == "" || len(d.Panels) == 0 {
		t.Fatalf("dashboard uid %q title %q, %d panels", d.UID, d.Title, len(d.Panels))
	}
	vars := map[string]bool{"__rate_interval": true, "__interval": true, "__range": true}
	for _, v := range d.Templating.List {
		vars[v.Name] = true
	}
	defs := goMetrics(t)
	if len(defs) < 20 {
		t.Fatalf("found only %d metric names in the Go code; is the walk broken?", len(defs))
	}
	used := map[string]bool{}
	alertList := false
	ids := map[int]bool{}
	type rect struct {
		title      string
		x, y, w, h int
	}
	var rects []rect
	var walk func(ps []grafanaPanel)
	walk = func(ps []grafanaPanel) {
		for _, p := range ps {
			if ids[p.ID] || p.ID == 0 {
				t.Errorf("panel %q: id %d zero or repeated", p.Title, p.ID)
			}
			ids[p.ID] = true
			g := p.GridPos
			if g.W <= 0 || g.H <= 0 || g.X < 0 || g.X+g.W > 24 {
				t.Errorf("panel %q: gridPos %+v out of the 24-column grid", p.Title, g)
			}
			for _, r := range rects {
				if g.X < r.x+r.w && r.x < g.X+g.W && g.Y < r.y+r.h && r.y < g.Y+g.H {
					t.Errorf("panel %q overlaps panel %q", p.Title, r.title)
				}
			}
			rects = append(rects, rect{p.Title, g.X, g.Y, g.W, g.H})
			walk(p.Panels)
			if p.Type == "row" {
				continue
			}
			if p.Type == "alertlist" {
				// Lists the alerting rules' alerts (Grafana's alerting API, no query).
				if p.Options.AlertInstanceLabelFilter != `{platform="tenantmesh"}` {
					t.Errorf("panel %q: alert list filter %q, want the rules' label {platform=\"tenantmesh\"}", p.Title, p.Options.AlertInstanceLabelFilter)
				}
				alertList = true
				continue
			}
			if len(p.Datasource) == 0 || len(p.Targets) == 0 {
				t.Errorf("panel %q: no datasource or no targets", p.Title)
			}
			refs := map[string]bool{}
			for _, tg := range p.Targets {
				where := fmt.Sprintf("panel %q target %s", p.Title, tg.RefID)
				if tg.RefID == "" || refs[tg.RefID] {
					t.Errorf("%s: refId empty or repeated", where)
				}
				refs[tg.RefID] = true
				checkPromQL(t, where, tg.Expr, vars)
				for _, m := range rateArgRe.FindAllStringSubmatch(tg.Expr, -1) {
					name, def := resolveMetric(m[1], defs)
					if def.typ != "" && def.typ != "Counter" && !(def.typ == "Histogram" && name != m[1]) {
						t.Errorf("%s: rate/increase of %s, a %s", where, m[1], def.typ)
					}
				}
				for _, ref := range metricRefRe.FindAllString(tg.Expr, -1) {
					name, def := resolveMetric(ref, defs)
					if def.file == "" {
						t.Errorf("%s: metric %s is not defined in the Go code", where, ref)
						continue
					}
					if name != ref && def.typ != "Histogram" && def.typ != "Summary" {
						t.Errorf("%s: %s, but %s is a %q, not a histogram", where, ref, name, def.typ)
					}
					used[name] = true
				}
			}
		}
	}
	walk(d.Panels)
	// The alerting rules (deploy/prometheus) are on the dashboard: a list of those firing, and
	// a link to Grafana's rule list filtered to them.
	if !alertList {
		t.Error("the dashboard has no alert list panel for the tenantmesh alerting rules")
	}
	linked := false
	for _, l := range d.Links {
		if l.Type == "link" && strings.HasPrefix(l.URL, "/alerting/list") && strings.Contains(l.URL, "platform%3Dtenantmesh") {
			linked = true
		}
	}
	if !linked {
		t.Errorf("the dashboard does not link to the alert rules (/alerting/list filtered on platform=tenantmesh): %+v", d.Links)
	}
	for _, m := range dashboardMetrics {
		if !used[m] {
			t.Errorf("the dashboard does not show %s", m)
		}
	}
	t.Logf("dashboard queries %d metrics of the %d defined in Go", len(used), len(defs))
}

// resolveMetric maps a name used in PromQL to the metric defined in Go: itself, or for
// histogram series the name without _bucket, _sum or _count.
func resolveMetric(ref string, defs map[string]metricDef) (string, metricDef) {
	if def, ok := defs[ref]; ok {
		return ref, def
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(ref, suffix); ok {
			if def, ok := defs[base]; ok {
				return base, def
			}
		}
	}
	return ref, metricDef{}
}

var templateVarRe = regexp.MustCompile(`\$\{?([A-Za-z_][A-Za-z0-9_]*)`)

// checkPromQL is a light syntax check: balanced brackets outside strings, closed strings, and
// only defined dashboard variables.
func checkPromQL(t *testing.T, where, expr string, vars map[string]bool) {
	t.Helper()
	if strings.TrimSpace(expr) == "" {
		t.Errorf("%s: empty expr", where)
		return
	}
	var stack []rune
	pairs := map[rune]rune{')': '(', ']': '[', '}': '{'}
	inString := rune(0)
	for i, r := range expr {
		if inString != 0 {
			if r == inString && (i == 0 || expr[i-1] != '\\') {
				inString = 0
			}
			continue
		}
		switch r {
		case '"', '\'', '`':
			inString = r
		case '(', '[', '{':
			stack = append(stack, r)
		case ')', ']', '}':
			if len(stack) == 0 || stack[len(stack)-1] != pairs[r] {
				t.Errorf("%s: unbalanced %q in %s", where, r, expr)
				return
			}
			stack = stack[:len(stack)-1]
		}
	}
	if inString != 0 || len(stack) > 0 {
		t.Errorf("%s: unclosed string or bracket in %s", where, expr)
	}
	for _, m := range templateVarRe.FindAllStringSubmatch(expr, -1) {
		if !vars[m[1]] {
			t.Errorf("%s: variable $%s is not defined on the dashboard", where, m[1])
		}
	}
	if strings.Contains(expr, "histogram_quantile(") && !strings.Contains(expr, "_bucket") {
		t.Errorf("%s: histogram_quantile without _bucket series", where)
	}
	if strings.Contains(expr, "_bucket") && !regexp.MustCompile(`by \([^)]*\ble\b`).MatchString(expr) {
		t.Errorf("%s: _bucket series aggregated without le", where)
	}
}

func TestGrafanaProvisioning(t *testing.T) {
	c := loadCompose(t)
	g := c.Services["grafana"]
	var ds struct {
		APIVersion  int `yaml:"apiVersion"`
		Datasources []struct {
			Name      string         `yaml:"name"`
			UID       string         `yaml:"uid"`
			Type      string         `yaml:"type"`
			Access    string         `yaml:"access"`
			URL       string         `yaml:"url"`
			IsDefault bool           `yaml:"isDefault"`
			Editable  bool           `yaml:"editable"`
			JSONData  map[string]any `yaml:"jsonData"`
		} `yaml:"datasources"`
	}
	strictYAML(t, "grafana/provisioning/datasources/prometheus.yml", &ds)
	if len(ds.Datasources) != 1 || ds.Datasources[0].Type != "prometheus" {
		t.Fatalf("want one prometheus data source, got %+v", ds.Datasources)
	}
	u, err := url.Parse(ds.Datasources[0].URL)
	if err != nil || c.Services[u.Hostname()].Image == "" || !slices.Contains(c.Services[u.Hostname()].Ports, "127.0.0.1:"+u.Port()+":"+u.Port()) {
		t.Errorf("data source URL %q is not the compose prometheus service", ds.Datasources[0].URL)
	}
	var dash struct {
		APIVersion int `yaml:"apiVersion"`
		Providers  []struct {
			Name                  string `yaml:"name"`
			OrgID                 int    `yaml:"orgId"`
			Folder                string `yaml:"folder"`
			Type                  string `yaml:"type"`
			DisableDeletion       bool   `yaml:"disableDeletion"`
			AllowUIUpdates        bool   `yaml:"allowUiUpdates"`
			UpdateIntervalSeconds int    `yaml:"updateIntervalSeconds"`
			Options               struct {
				Path                      string `yaml:"path"`
				FoldersFromFilesStructure bool   `yaml:"foldersFromFilesStructure"`
			} `yaml:"options"`
		} `yaml:"providers"`
	}
	strictYAML(t, "grafana/provisioning/dashboards/tenantmesh.yml", &dash)
	if len(dash.Providers) != 1 || dash.Providers[0].Type != "file" {
		t.Fatalf("want one file provider, got %+v", dash.Providers)
	}
	want := "../grafana/tenantmesh-dashboard.json:" + dash.Providers[0].Options.Path + "/tenantmesh-dashboard.json:ro"
	if !slices.Contains(g.Volumes, want) {
		t.Errorf("compose grafana does not mount the dashboard where the provider reads it (%s): %v", want, g.Volumes)
	}
	if !slices.Contains(g.Volumes, "../grafana/provisioning:/etc/grafana/provisioning:ro") {
		t.Errorf("compose grafana does not mount the provisioning directory: %v", g.Volumes)
	}
}
