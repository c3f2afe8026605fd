package deploy

import (
	"bytes"
	"context"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
)

// --- Helm chart ------------------------------------------------------------------------------

const (
	helmChart = "helm/tenantmesh"
	// helmKubeVersion is the Kubernetes version charts are rendered for (a helm built with go
	// install assumes v1.20, below the chart's kubeVersion).
	helmKubeVersion = "1.31.0"
)

// helmCase is one values file the chart is rendered with, and what it asks for.
type helmCase struct {
	name, values  string // values file relative to the chart ("" = the defaults)
	shards        int    // of each kind
	monitoring    bool   // ServiceMonitor and PrometheusRule
	secrets       bool   // the chart creates the Secrets
	gatewayHPA    bool
	replicasByKnd map[string]int
}

var helmCases = []helmCase{
	{name: "defaults", shards: 2, gatewayHPA: true, replicasByKnd: map[string]int{"aggregate": 2, "projection": 2, "runner": 2}},
	{name: "three-shards", values: "ci/three-shards-values.yaml", shards: 3, monitoring: true, secrets: true,
		replicasByKnd: map[string]int{"aggregate": 3, "projection": 2, "runner": 2}},
}

// helmRun runs helm with a deadline and returns its standard output.
func helmRun(t *testing.T, helm string, args ...string) []byte {
	t.Helper()
	out, stderr, err := helmExec(t, helm, args...)
	if err != nil {
		t.Fatalf("helm %s: %v\n%s%s", strings.Join(args, " "), err, out, stderr)
	}
	return out
}

func helmExec(t *testing.T, helm string, args ...string) (stdout, stderr []byte, err error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var errb bytes.Buffer
	cmd := exec.CommandContext(ctx, helm, args...)
	cmd.Stderr = &errb
	cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+t.TempDir(), "HELM_CONFIG_HOME="+t.TempDir(), "HELM_DATA_HOME="+t.TempDir())
	out, err := cmd.Output()
	return out, errb.Bytes(), err
}

// helmRefuses: values the chart must refuse, and what its error says.
var helmRefuses = []struct{ set, says string }{
	{"shard.kinds.aggregate.count=3", "additional properties 'shard' not allowed"},    // values.schema.json: a misspelt key
	{"shards.kinds.aggregat.count=1", "additional properties 'aggregat' not allowed"}, // not a kind
	{"shards.kinds.runner.replicas=0", "minimum"},                                     // a shard without instances
	{"nats.enabled=false", "nats.url is required"},                                    // no NATS at all
	{"secrets.create=true,secrets.adminToken=x", "secrets.natsAuthConf"},              // create needs every file
	{"gateway.env.LOG_LEVEL=debug", "does not match pattern"},                         // env is TM_* settings
}

// TestHelmChart lints the chart and renders it with each helmCases values file; the rendered
// objects go through the same checks as deploy/k8s (strict schema decoding, consistency, the
// binaries' flags), then the chart's own promises are checked: N shards of each kind with their
// PDB, Service and credentials, a NATS config nats-server loads, the Secrets and monitoring
// objects when asked for, and with the defaults the same objects deploy/k8s defines.
func TestHelmChart(t *testing.T) {
	helm := externalTool(t, "helm", "make tools (go install helm.sh/helm/v3/cmd/helm@v3.22.0)",
		filepath.Join(repoRoot, ".tools", "helm-v3.22.0", "helm"))
	flags := allFlags(t)
	checkChartRulesCopy(t)
	for _, r := range helmRefuses {
		_, stderr, err := helmExec(t, helm, "template", "tenantmesh", helmChart, "--kube-version", helmKubeVersion, "--set", r.set)
		if err == nil || !bytes.Contains(stderr, []byte(r.says)) {
			t.Errorf("helm template --set %s: %v, want an error saying %q:\n%s", r.set, err, r.says, stderr)
		}
	}
	for _, hc := range helmCases {
		t.Run(hc.name, func(t *testing.T) {
			args := []string{"--kube-version", helmKubeVersion, "--namespace", namespace}
			if hc.values != "" {
				args = append(args, "-f", filepath.Join(helmChart, hc.values))
			}
			lint := helmRun(t, helm, append([]string{"lint", "--strict", helmChart}, args...)...)
			if !bytes.Contains(lint, []byte("0 chart(s) failed")) {
				t.Errorf("helm lint:\n%s", lint)
			}
			out := helmRun(t, helm, append([]string{"template", "tenantmesh", helmChart}, args...)...)
			objs := k8sObjectsOf(t, "helm "+hc.name, yamlDocsOf(t, "helm template", out), map[string]bool{})
			checkK8sSchema(t, objs)
			checkK8sObjects(t, objs, flags)
			checkChart(t, hc, objs)
			if hc.name == "defaults" {
				checkChartMatchesK8s(t, objs)
			}
		})
	}
}

// checkChart checks what the values asked for.
func checkChart(t *testing.T, hc helmCase, objs []k8sObject) {
	t.Helper()
	secrets := map[string]bool{}
	for _, s := range byKind(objs, "Secret") {
		secrets[s.name()] = true
	}
	for kind, replicas := range hc.replicasByKnd {
		n := 0
		for _, sts := range byKind(objs, "StatefulSet") {
			if getStr(sts.o, "spec", "template", "metadata", "labels", "tenantmesh.io/kind") == kind {
				n++
			}
		}
		if n != hc.shards {
			t.Errorf("%d %s shards, want %d", n, kind, hc.shards)
		}
		for i := 1; i <= hc.shards; i++ {
			name := fmt.Sprintf("%s-%d", kind, i)
			sts, ok := find(objs, "StatefulSet", name)
			if !ok {
				t.Errorf("no StatefulSet %s", name)
				continue
			}
			if r, _ := getInt(sts.o, "spec", "replicas"); r != replicas {
				t.Errorf("%v: replicas %d, want %d", sts, r, replicas)
			}
			c := getList(sts.o, "spec", "template", "spec", "containers")[0].(obj)
			_, env := containerEnv(c)
			if v := getStr(env["TM_SHARD"], "value"); v != name {
				t.Errorf("%v: TM_SHARD %q", sts, v)
			}
			if v := getStr(env["TM_INSTANCE"], "valueFrom", "fieldRef", "fieldPath"); v != "metadata.name" {
				t.Errorf("%v: TM_INSTANCE is not the pod name", sts)
			}
			if v := getStr(env["TM_URL"], "value"); v != "http://$(POD_IP):9000" {
				t.Errorf("%v: TM_URL %q", sts, v)
			}
			if g, _ := getInt(sts.o, "spec", "template", "spec", "terminationGracePeriodSeconds"); g < 45 {
				t.Errorf("%v: terminationGracePeriodSeconds %d, too short for a drain", sts, g)
			}
			if _, ok := find(objs, "PodDisruptionBudget", name); !ok {
				t.Errorf("shard %s has no PodDisruptionBudget", name)
			}
			wantCreds := "tm-nats-shard-" + kind + "-" + name // rebalance auth init's name
			if got := podSecretVolume(sts.o, "nats-creds"); got != wantCreds {
				t.Errorf("%v: credentials from Secret %q, want %q", sts, got, wantCreds)
			}
		}
	}
	if _, ok := find(objs, "HorizontalPodAutoscaler", "gateway"); ok != hc.gatewayHPA {
		t.Errorf("gateway HPA present %v, want %v", ok, hc.gatewayHPA)
	}
	// Every Secret a pod reads is one the chart makes (when asked to) or one the operator makes.
	read := map[string]bool{}
	for _, w := range byKind(objs, "Deployment", "StatefulSet") {
		for _, name := range podSecrets(w.o) {
			if hc.secrets && !secrets[name] {
				t.Errorf("%v reads Secret %s, which the chart does not create", w, name)
			}
			read[name] = true
		}
		for _, c := range getList(w.o, "spec", "template", "spec", "containers") {
			_, env := containerEnv(c.(obj))
			if _, ok := env["TM_NATS_URL"]; !ok {
				continue
			}
			checkCredsMount(t, w, c.(obj), getStr(env["TM_NATS_CREDS"], "value"))
			for _, u := range strings.Split(getStr(env["TM_NATS_URL"], "value"), ",") {
				pu, err := url.Parse(u)
				if err != nil {
					t.Errorf("%v: TM_NATS_URL %q: %v", w, u, err)
				} else if _, ok := find(objs, "Service", pu.Hostname()); !ok {
					t.Errorf("%v: TM_NATS_URL host %q is not a Service", w, pu.Hostname())
				}
			}
		}
	}
	for name := range secrets {
		if !read[name] {
			t.Errorf("Secret %s is read by no pod", name)
		}
	}
	if !hc.secrets && len(byKind(objs, "Secret")) > 0 {
		t.Errorf("secrets.create is off, but the chart renders %d Secrets", len(byKind(objs, "Secret")))
	}
	checkChartNATS(t, objs)
	checkChartMonitoring(t, hc, objs)
}

// podSecretVolume is the Secret behind a pod template's volume.
func podSecretVolume(w obj, volume string) string {
	for _, v := range getList(w, "spec", "template", "spec", "volumes") {
		if getStr(v, "name") == volume {
			return getStr(v, "secret", "secretName")
		}
	}
	return ""
}

// podSecrets lists the Secrets a workload's pods read: secret volumes and secretKeyRefs.
func podSecrets(w obj) []string {
	var out []string
	for _, v := range getList(w, "spec", "template", "spec", "volumes") {
		if n := getStr(v, "secret", "secretName"); n != "" {
			out = append(out, n)
		}
	}
	for _, c := range getList(w, "spec", "template", "spec", "containers") {
		for _, e := range getList(c, "env") {
			if n := getStr(e, "valueFrom", "secretKeyRef", "name"); n != "" {
				out = append(out, n)
			}
		}
	}
	return out
}

// checkChartNATS: the chart's NATS config loads with nats-server's parser as a cluster routing
// to its own pods, and includes auth.conf from the Secret the servers mount.
func checkChartNATS(t *testing.T, objs []k8sObject) {
	t.Helper()
	nats, ok := find(objs, "StatefulSet", "nats")
	if !ok {
		t.Error("no NATS StatefulSet")
		return
	}
	replicas, _ := getInt(nats.o, "spec", "replicas")
	var routes []string
	for i := range replicas {
		routes = append(routes, fmt.Sprintf("nats-%d.%s:6222", i, getStr(nats.o, "spec", "serviceName")))
	}
	cm, ok := find(objs, "ConfigMap", "nats-config")
	if !ok {
		t.Fatal("no ConfigMap nats-config")
	}
	conf := filepath.Join(t.TempDir(), "nats.conf")
	if err := os.WriteFile(conf, []byte(getStr(cm.o, "data", "nats.conf")), 0o600); err != nil {
		t.Fatal(err)
	}
	checkNATSConfig(t, conf, map[string]string{"SERVER_NAME": "nats-0"}, routes)
	if got := podSecretVolume(nats.o, "auth"); got != "nats-auth" {
		t.Errorf("NATS reads auth.conf from Secret %q, want nats-auth", got)
	}
}

// checkChartMonitoring: the ServiceMonitor (when on) selects the Services of the gateway, the
// rebalancer and every shard, on their http port, naming jobs as the alert rules expect; the
// PrometheusRule holds exactly deploy/prometheus's rules.
func checkChartMonitoring(t *testing.T, hc helmCase, objs []k8sObject) {
	t.Helper()
	sms, rules := byKind(objs, "ServiceMonitor"), byKind(objs, "PrometheusRule")
	if !hc.monitoring {
		if len(sms)+len(rules) > 0 {
			t.Errorf("monitoring is off by default, but the chart renders %d ServiceMonitors and %d PrometheusRules", len(sms), len(rules))
		}
		return
	}
	if len(sms) != 1 || len(rules) != 1 {
		t.Fatalf("%d ServiceMonitors and %d PrometheusRules, want 1 each", len(sms), len(rules))
	}
	sm := sms[0]
	if getStr(sm.o, "spec", "jobLabel") != "app.kubernetes.io/name" {
		t.Errorf("%v: jobLabel %q: jobs must be gateway, rebalancer, aggregate, ... (the alert rules match them)", sm, getStr(sm.o, "spec", "jobLabel"))
	}
	sel := stringMap(getMap(sm.o, "spec", "selector", "matchLabels"))
	port := getStr(getList(sm.o, "spec", "endpoints")[0], "port")
	scraped := map[string]bool{}
	for _, s := range byKind(objs, "Service") {
		if !subset(sel, stringMap(getMap(s.o, "metadata", "labels"))) {
			continue
		}
		scraped[s.name()] = true
		hasPort := false
		for _, p := range getList(s.o, "spec", "ports") {
			hasPort = hasPort || getStr(p, "name") == port
		}
		if !hasPort {
			t.Errorf("%v: selected by the ServiceMonitor but has no port %q", s, port)
		}
		if getStr(s.o, "metadata", "labels", "app.kubernetes.io/name") == "" {
			t.Errorf("%v: no app.kubernetes.io/name label for the job", s)
		}
	}
	want := []string{"gateway", "rebalancer"}
	for kind := range hc.replicasByKnd {
		for i := 1; i <= hc.shards; i++ {
			want = append(want, fmt.Sprintf("%s-%d", kind, i))
		}
	}
	for _, w := range want {
		if !scraped[w] {
			t.Errorf("the ServiceMonitor does not scrape Service %s", w)
		}
	}
	if scraped["nats"] || scraped["nats-headless"] {
		t.Error("the ServiceMonitor selects a NATS Service (it has no /metrics)")
	}
	var fromChart, fromFile alertRules
	b, _ := yaml.Marshal(getMap(rules[0].o, "spec"))
	if err := yaml.Unmarshal(b, &fromChart); err != nil {
		t.Fatal(err)
	}
	strictYAML(t, filepath.Join("prometheus", alertRulesFile), &fromFile)
	if !reflect.DeepEqual(fromChart, fromFile) || len(fromFile.Groups) == 0 {
		t.Errorf("the PrometheusRule's groups differ from prometheus/%s", alertRulesFile)
	}
}

// checkChartRulesCopy: the chart carries a copy of the alert rules (helm reads only files
// inside the chart); it must be the same file.
func checkChartRulesCopy(t *testing.T) {
	t.Helper()
	a, err := os.ReadFile(filepath.Join("prometheus", alertRulesFile))
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(helmChart, "files", alertRulesFile))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a, b) {
		t.Errorf("%s/files/%s differs from prometheus/%s: cp deploy/prometheus/%[2]s deploy/%[1]s/files/", helmChart, alertRulesFile, alertRulesFile)
	}
}

// checkChartMatchesK8s: rendered with its defaults, the chart defines the objects deploy/k8s
// does (the Namespace aside: helm install --create-namespace makes it).
func checkChartMatchesK8s(t *testing.T, objs []k8sObject) {
	t.Helper()
	ids := func(objs []k8sObject) []string {
		var out []string
		for _, k := range objs {
			if k.kind() != "Namespace" {
				out = append(out, k.kind()+"/"+k.name())
			}
		}
		slices.Sort(out)
		return out
	}
	chart, k8s := ids(objs), ids(loadK8s(t))
	if !slices.Equal(chart, k8s) {
		t.Errorf("the chart's default objects differ from deploy/k8s's:\nchart: %v\nk8s:   %v", chart, k8s)
	}
}
