package deploy

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

// --- Prometheus alerting rules ---------------------------------------------------------------

// alertRulesFile holds the alerting rules, in prometheus/; its promtool unit tests are in
// alertRulesTestFile.
const (
	alertRulesFile     = "tenantmesh-alerts.yml"
	alertRulesTestFile = "tenantmesh-alerts_test.yml"
)

type alertRule struct {
	Alert       string            `yaml:"alert"`
	Record      string            `yaml:"record"`
	Expr        string            `yaml:"expr"`
	For         string            `yaml:"for"`
	Labels      map[string]string `yaml:"labels"`
	Annotations map[string]string `yaml:"annotations"`
}

type alertRules struct {
	Groups []struct {
		Name     string      `yaml:"name"`
		Interval string      `yaml:"interval"`
		Rules    []alertRule `yaml:"rules"`
	} `yaml:"groups"`
}

// alertRuleTests is the part of promtool's unit test format the test file uses.
type alertRuleTests struct {
	RuleFiles          []string `yaml:"rule_files"`
	EvaluationInterval string   `yaml:"evaluation_interval"`
	Tests              []struct {
		Name        string `yaml:"name"`
		Interval    string `yaml:"interval"`
		InputSeries []struct {
			Series string `yaml:"series"`
			Values string `yaml:"values"`
		} `yaml:"input_series"`
		AlertRuleTest []struct {
			EvalTime  string `yaml:"eval_time"`
			AlertName string `yaml:"alertname"`
			ExpAlerts []struct {
				ExpLabels      map[string]string `yaml:"exp_labels"`
				ExpAnnotations map[string]string `yaml:"exp_annotations"`
			} `yaml:"exp_alerts"`
		} `yaml:"alert_rule_test"`
	} `yaml:"tests"`
}

// alertsCovered are the failure modes issue 18 asks alerts for, and the alert for each.
var alertsCovered = map[string]string{
	"instance offline":                  "TenantmeshInstanceOffline",
	"move stuck":                        "TenantmeshMoveStuck",
	"gateway placement snapshot stale":  "TenantmeshGatewaySnapshotStale",
	"hold budget spent":                 "TenantmeshHoldBudgetSpent",
	"breaker open":                      "TenantmeshBreakerOpen",
	"NATS unreachable":                  "TenantmeshNATSUnreachable",
	"scrape target down (process gone)": "TenantmeshTargetDown",
	"move verification mismatch":        "TenantmeshMoveVerifyMismatch",
}

// loadAlertRules decodes the rules strictly and checks each one: named, labelled with a
// severity and platform=tenantmesh (the dashboard's alert list filters on it), a summary and a
// description, and an expression whose tm_* metrics the Go code defines (rate/increase only of
// counters and histogram series), with balanced brackets.
func loadAlertRules(t *testing.T) map[string]alertRule {
	t.Helper()
	var rules alertRules
	strictYAML(t, filepath.Join("prometheus", alertRulesFile), &rules)
	defs := goMetrics(t)
	byName := map[string]alertRule{}
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			where := fmt.Sprintf("%s group %s alert %q", alertRulesFile, g.Name, r.Alert)
			if r.Alert == "" || r.Record != "" {
				t.Errorf("%s: only alerting rules belong here", where)
				continue
			}
			if _, dup := byName[r.Alert]; dup {
				t.Errorf("%s: defined twice", where)
			}
			byName[r.Alert] = r
			if sev := r.Labels["severity"]; sev != "critical" && sev != "warning" {
				t.Errorf("%s: severity %q, want critical or warning", where, sev)
			}
			if r.Labels["platform"] != "tenantmesh" {
				t.Errorf("%s: no label platform=tenantmesh", where)
			}
			if r.Annotations["summary"] == "" || r.Annotations["description"] == "" {
				t.Errorf("%s: no summary or description annotation", where)
			}
			if r.For != "" {
				if _, err := time.ParseDuration(r.For); err != nil {
					t.Errorf("%s: for %q: %v", where, r.For, err)
				}
			}
			checkPromQL(t, where, r.Expr, nil)
			checkRuleMetrics(t, where, r.Expr, defs)
		}
	}
	return byName
}

// checkRuleMetrics reports tm_* names in expr that no Go code defines, and rates of gauges.
func checkRuleMetrics(t *testing.T, where, expr string, defs map[string]metricDef) {
	t.Helper()
	refs := metricRefRe.FindAllString(expr, -1)
	if len(refs) == 0 && !regexp.MustCompile(`\bup\b`).MatchString(expr) {
		t.Errorf("%s: reads no tenantmesh metric", where)
	}
	for _, ref := range refs {
		name, def := resolveMetric(ref, defs)
		if def.file == "" {
			t.Errorf("%s: metric %s is not defined in the Go code", where, ref)
		} else if name != ref && def.typ != "Histogram" && def.typ != "Summary" {
			t.Errorf("%s: %s, but %s is a %q, not a histogram", where, ref, name, def.typ)
		}
	}
	for _, m := range rateArgRe.FindAllStringSubmatch(expr, -1) {
		name, def := resolveMetric(m[1], defs)
		if def.typ != "" && def.typ != "Counter" && !(def.typ == "Histogram" && name != m[1]) {
			t.Errorf("%s: rate/increase of %s, a %s", where, m[1], def.typ)
		}
	}
}

// TestAlertRules checks the rules themselves (loadAlertRules), that every failure mode has its
// alert, and that the promtool unit tests make every alert fire at least once.
func TestAlertRules(t *testing.T) {
	rules := loadAlertRules(t)
	for mode, alert := range alertsCovered {
		if _, ok := rules[alert]; !ok {
			t.Errorf("no alert %s for %s", alert, mode)
		}
	}
	var tests alertRuleTests
	strictYAML(t, filepath.Join("prometheus", alertRulesTestFile), &tests)
	if !slices.Equal(tests.RuleFiles, []string{alertRulesFile}) {
		t.Errorf("%s: rule_files %v, want [%s]", alertRulesTestFile, tests.RuleFiles, alertRulesFile)
	}
	fires := map[string]bool{}
	for _, tc := range tests.Tests {
		for _, a := range tc.AlertRuleTest {
			if _, ok := rules[a.AlertName]; !ok {
				t.Errorf("%s test %q: alert %s is not a rule", alertRulesTestFile, tc.Name, a.AlertName)
			}
			if len(a.ExpAlerts) > 0 {
				fires[a.AlertName] = true
			}
		}
	}
	for name := range rules {
		if !fires[name] {
			t.Errorf("no test in %s makes %s fire", alertRulesTestFile, name)
		}
	}
}

// TestPromtoolRules runs promtool check rules and promtool test rules (Debian's prometheus
// package; make tools installs it), and promtool check config on the compose config, which
// loads the rules. (Debian's promtool is built without Kubernetes discovery, so it cannot read
// prometheus-k8s.yml.)
func TestPromtoolRules(t *testing.T) {
	promtool := externalTool(t, "promtool", "make tools (apt-get install prometheus)")
	for _, args := range [][]string{{"check", "rules", alertRulesFile}, {"test", "rules", alertRulesTestFile},
		{"check", "config", "prometheus.yml"}} {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		cmd := exec.CommandContext(ctx, promtool, args...)
		cmd.Dir = "prometheus"
		out, err := cmd.CombinedOutput()
		cancel()
		if err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		} else if !bytes.Contains(out, []byte("SUCCESS")) {
			t.Errorf("promtool %s says no SUCCESS:\n%s", strings.Join(args, " "), out)
		}
	}
}

// externalTool finds a program the deploy tests run: the path in $TM_<NAME> (TM_PROMTOOL,
// TM_HELM), then candidates, then $PATH. When it is missing, the test fails under
// TM_REQUIRE_TOOLS=1 (make test and CI set it, so the checks cannot silently vanish there) and
// skips otherwise (a plain go test ./deploy/ on a machine without the tool), naming install.
func externalTool(t *testing.T, name, install string, candidates ...string) string {
	t.Helper()
	env := "TM_" + strings.ToUpper(name)
	if p := os.Getenv(env); p != "" {
		candidates = append([]string{p}, candidates...)
	}
	for _, c := range candidates {
		if fi, err := os.Stat(c); err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0 {
			abs, _ := filepath.Abs(c)
			return abs
		}
	}
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	msg := fmt.Sprintf("%s is not installed (nor in $%s); install it with: %s", name, env, install)
	if os.Getenv("TM_REQUIRE_TOOLS") != "" {
		t.Fatal(msg + " (TM_REQUIRE_TOOLS is set: make test and CI need it)")
	}
	t.Skip(msg + " (set TM_REQUIRE_TOOLS=1 to make this a failure, as make test does)")
	return ""
}
