package deploy

// These tests validate the deployment files without a container engine or a cluster: every YAML
// and JSON file parses, the Kubernetes objects are consistent with each other and with the
// binaries' flags, compose references resolve, the NATS configs load with nats-server's own
// parser as 3-node JetStream clusters, the Prometheus configs name real services, and every
// metric the Grafana dashboard queries is defined in the Go code.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/tenantmesh/tenantmesh/internal/natsauth"
	"go.yaml.in/yaml/v3"
)

const namespace = "tenantmesh"

// repoRoot is the module root (the test runs in deploy/).
const repoRoot = ".."

// --- generic helpers -------------------------------------------------------------------------

type obj = map[string]any

// yamlDocs parses every document of a YAML file.
func yamlDocs(t *testing.T, path string) []obj {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	var out []obj
	for {
		var doc obj
		err := dec.Decode(&doc)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if doc != nil {
			out = append(out, doc)
		}
	}
	return out
}

// strictYAML decodes one YAML document into v, refusing keys v does not declare.
func strictYAML(t *testing.T, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

// get walks nested maps: get(o, "spec", "template", "metadata").
func get(o any, keys ...string) any {
	for _, k := range keys {
		m, ok := o.(obj)
		if !ok {
			return nil
		}
		o = m[k]
	}
	return o
}

func getMap(o any, keys ...string) obj {
	m, _ := get(o, keys...).(obj)
	return m
}

func getList(o any, keys ...string) []any {
	l, _ := get(o, keys...).([]any)
	return l
}

func getStr(o any, keys ...string) string {
	switch v := get(o, keys...).(type) {
	case string:
		return v
	case int:
		return strconv.Itoa(v)
	case bool:
		return strconv.FormatBool(v)
	}
	return ""
}

func getInt(o any, keys ...string) (int, bool) {
	v, ok := get(o, keys...).(int)
	return v, ok
}

// stringMap converts a map of labels to map[string]string.
func stringMap(m obj) map[string]string {
	out := map[string]string{}
	for k, v := range m {
		out[k] = fmt.Sprint(v)
	}
	return out
}

// subset reports whether every label of sel is in labels.
func subset(sel, labels map[string]string) bool {
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// --- Go source facts -------------------------------------------------------------------------

// metricDef is a metric name defined in Go and the constructor it was found in.
type metricDef struct {
	typ  string // Counter, Gauge, Histogram, Summary, Desc or "" when unknown
	file string
}

var (
	quotedMetricRe = regexp.MustCompile(`"(tm_[a-z0-9_]+)"`)
	metricCtorRe   = regexp.MustCompile(`prometheus\.(?:New(Counter|Gauge|Histogram|Summary|Desc)\w*|(Counter|Gauge|Histogram|Summary)Opts)\b`)
)

// goMetrics finds every metric name in the module's non-test Go files that use the Prometheus
// client: quoted "tm_..." strings, typed by the nearest prometheus constructor or Opts before them.
func goMetrics(t *testing.T) map[string]metricDef {
	t.Helper()
	defs := map[string]metricDef{}
	err := filepath.WalkDir(repoRoot, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() {
			if path != repoRoot && (strings.HasPrefix(name, ".") || name == "testdata" || name == "node_modules" || name == "bin") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		src := string(b)
		if !strings.Contains(src, `"github.com/prometheus/client_golang/`) {
			return nil // NATS bucket names and the like are tm_ strings too
		}
		for _, m := range quotedMetricRe.FindAllStringSubmatchIndex(src, -1) {
			metric := src[m[2]:m[3]]
			typ := ""
			if ctors := metricCtorRe.FindAllStringSubmatch(src[:m[0]], -1); len(ctors) > 0 {
				last := ctors[len(ctors)-1]
				typ = last[1] + last[2]
			}
			if prev, ok := defs[metric]; !ok || prev.typ == "" {
				defs[metric] = metricDef{typ: typ, file: path}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return defs
}

var (
	envflagRe = regexp.MustCompile(`envflag\.\w+\(\s*\w+\s*,\s*&[^,]+,\s*"([a-z0-9-]+)"`)
	getenvRe  = regexp.MustCompile(`os\.(?:Getenv|LookupEnv)\("(TM_[A-Z0-9_]+)"\)`)
)

// binaryFlags returns the TM_* variables a binary reads, from its envflag definitions, and
// false when the binary's source is not (yet) in the tree.
func binaryFlags(t *testing.T, binary string) (map[string]bool, bool) {
	t.Helper()
	var globs []string
	switch binary {
	case "gateway":
		globs = []string{"gateway/cmd/gateway/*.go"}
	case "rebalance":
		globs = []string{"rebalancer/cmd/rebalance/*.go", "rebalancer/cli/*.go"}
	case "aggregate", "projection", "runner":
		globs = []string{"services/" + binary + "/cmd/" + binary + "/*.go", "services/internal/svcmain/*.go"}
	default:
		t.Fatalf("unknown binary %q", binary)
	}
	globs = append(globs, "internal/natsconn/*.go") // every binary's --nats-* flags
	vars := map[string]bool{}
	found := false
	for _, g := range globs {
		files, _ := filepath.Glob(filepath.Join(repoRoot, g))
		for _, f := range files {
			if strings.HasSuffix(f, "_test.go") {
				continue
			}
			if strings.Contains(f, filepath.Join("cmd", binary)) {
				found = true
			}
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range envflagRe.FindAllStringSubmatch(string(b), -1) {
				vars["TM_"+strings.ToUpper(strings.ReplaceAll(m[1], "-", "_"))] = true
			}
			for _, m := range getenvRe.FindAllStringSubmatch(string(b), -1) {
				vars[m[1]] = true
			}
		}
	}
	return vars, found
}

// binaries the image carries, and the flags (TM_* variables) each reads.
var binaries = []string{"gateway", "rebalance", "aggregate", "projection", "runner"}

type flagSets map[string]map[string]bool // binary -> TM_* variables; nil when the source is absent

func allFlags(t *testing.T) flagSets {
	fl := flagSets{}
	for _, b := range binaries {
		if vars, ok := binaryFlags(t, b); ok {
			fl[b] = vars
		} else {
			t.Logf("%s: source not in the tree yet; its TM_* variables are not checked", b)
			fl[b] = nil
		}
	}
	return fl
}

// reads reports whether a binary reads a TM_* variable; true when its source is not in the tree.
func (fl flagSets) reads(binary, variable string) bool {
	vars := fl[binary]
	return vars == nil || vars[variable]
}

// checkCluster checks that a process that can create buckets and streams is told to give them 3
// replicas and that one with an admin API gets its token.
func (fl flagSets) checkCluster(t *testing.T, where, binary string, env map[string]string) {
	t.Helper()
	if fl.reads(binary, "TM_REPLICAS") {
		if env["TM_REPLICAS"] != "3" {
			t.Errorf("%s: TM_REPLICAS %q, want 3 (a 3-node NATS cluster)", where, env["TM_REPLICAS"])
		}
	} else {
		t.Logf("NOTE %s: %s has no --replicas flag; buckets and streams it creates get 1 replica", where, binary)
	}
	if fl.reads(binary, "TM_ADMIN_TOKEN") && env["TM_ADMIN_TOKEN"] == "" {
		t.Errorf("%s: no TM_ADMIN_TOKEN", where)
	}
}

// listenPort is the port a tenantmesh process listens on: its --addr argument, else TM_ADDR.
func listenPort(args []string, env map[string]string) string {
	addr := env["TM_ADDR"]
	for i, a := range args {
		if a == "--addr" && i+1 < len(args) {
			addr = args[i+1]
		} else if v, ok := strings.CutPrefix(a, "--addr="); ok {
			addr = v
		}
	}
	_, port, _ := strings.Cut(addr, ":")
	return port
}

// checkEnv reports TM_* variables the binary does not read (a typo, or a flag it lacks).
func (fl flagSets) checkEnv(t *testing.T, where, binary string, env []string) {
	t.Helper()
	vars, ok := fl[binary]
	if !ok {
		t.Errorf("%s: unknown binary %q", where, binary)
		return
	}
	if vars == nil {
		return
	}
	for _, e := range env {
		if strings.HasPrefix(e, "TM_") && !vars[e] {
			t.Errorf("%s: %s sets %s, which %s has no flag for", where, binary, e, binary)
		}
	}
}

// --- every file parses -----------------------------------------------------------------------

func deployFiles(t *testing.T, exts ...string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (path == "devstack" || (path != "." && strings.HasPrefix(d.Name(), "."))) {
			return filepath.SkipDir
		}
		if !d.IsDir() && slices.Contains(exts, filepath.Ext(path)) {
			out = append(out, path)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(out)
	return out
}

func TestFilesParse(t *testing.T) {
	files := deployFiles(t, ".yaml", ".yml", ".json")
	if len(files) < 20 {
		t.Fatalf("found only %d YAML/JSON files under deploy/: %v", len(files), files)
	}
	for _, f := range files {
		if filepath.Ext(f) == ".json" {
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			if !json.Valid(b) {
				t.Errorf("%s: invalid JSON", f)
			}
			continue
		}
		if len(yamlDocs(t, f)) == 0 {
			t.Errorf("%s: no YAML document", f)
		}
	}
}

// --- Kubernetes ------------------------------------------------------------------------------

type k8sObject struct {
	file string
	o    obj
}

func (k k8sObject) kind() string { return getStr(k.o, "kind") }
func (k k8sObject) name() string { return getStr(k.o, "metadata", "name") }
func (k k8sObject) String() string {
	return fmt.Sprintf("%s %s/%s", k.file, k.kind(), k.name())
}

// apiVersions are the API versions this repository's manifests may use, per kind.
var apiVersions = map[string]string{
	"Namespace":               "v1",
	"ConfigMap":               "v1",
	"Service":                 "v1",
	"ServiceAccount":          "v1",
	"Deployment":              "apps/v1",
	"StatefulSet":             "apps/v1",
	"PodDisruptionBudget":     "policy/v1",
	"HorizontalPodAutoscaler": "autoscaling/v2",
}

func loadK8s(t *testing.T) []k8sObject {
	t.Helper()
	var kust struct {
		APIVersion string   `yaml:"apiVersion"`
		Kind       string   `yaml:"kind"`
		Namespace  string   `yaml:"namespace"`
		Resources  []string `yaml:"resources"`
		Labels     []struct {
			Pairs            map[string]string `yaml:"pairs"`
			IncludeSelectors bool              `yaml:"includeSelectors"`
		} `yaml:"labels"`
		Images []struct {
			Name    string `yaml:"name"`
			NewName string `yaml:"newName"`
			NewTag  string `yaml:"newTag"`
		} `yaml:"images"`
	}
	strictYAML(t, "k8s/kustomization.yaml", &kust)
	if kust.Kind != "Kustomization" || kust.APIVersion != "kustomize.config.k8s.io/v1beta1" {
		t.Errorf("kustomization.yaml: kind %q apiVersion %q", kust.Kind, kust.APIVersion)
	}
	if kust.Namespace != namespace {
		t.Errorf("kustomization.yaml: namespace %q, want %q", kust.Namespace, namespace)
	}
	for _, l := range kust.Labels {
		if l.IncludeSelectors {
			t.Errorf("kustomization.yaml: labels with includeSelectors change immutable workload selectors")
		}
	}
	listed := map[string]bool{}
	for _, r := range kust.Resources {
		if listed[r] {
			t.Errorf("kustomization.yaml lists %s twice", r)
		}
		listed[r] = true
	}
	var files []string
	err := filepath.WalkDir("k8s", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if ext := filepath.Ext(path); !d.IsDir() && (ext == ".yaml" || ext == ".yml") {
			rel, _ := filepath.Rel("k8s", path)
			if rel != "kustomization.yaml" {
				files = append(files, filepath.ToSlash(rel))
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		if !listed[f] {
			t.Errorf("k8s/%s is not listed in kustomization.yaml resources", f)
		}
		delete(listed, f)
	}
	for r := range listed {
		t.Errorf("kustomization.yaml lists %s, which does not exist", r)
	}
	var objs []k8sObject
	seen := map[string]bool{}
	for _, f := range files {
		for _, o := range yamlDocs(t, filepath.Join("k8s", f)) {
			k := k8sObject{file: "k8s/" + f, o: o}
			if k.kind() == "" || getStr(o, "apiVersion") == "" || k.name() == "" {
				t.Errorf("%s: object without apiVersion, kind or metadata.name", k.file)
				continue
			}
			want, ok := apiVersions[k.kind()]
			switch {
			case !ok:
				t.Errorf("%v: kind not expected here (add it to apiVersions)", k)
			case getStr(o, "apiVersion") != want:
				t.Errorf("%v: apiVersion %q, want %q", k, getStr(o, "apiVersion"), want)
			}
			if ns := getStr(o, "metadata", "namespace"); k.kind() != "Namespace" && ns != namespace {
				t.Errorf("%v: namespace %q, want %q", k, ns, namespace)
			}
			if getMap(o, "spec") == nil && getMap(o, "data") == nil && k.kind() != "Namespace" {
				t.Errorf("%v: no spec", k)
			}
			id := k.kind() + "/" + k.name()
			if seen[id] {
				t.Errorf("%v: defined twice", k)
			}
			seen[id] = true
			objs = append(objs, k)
		}
	}
	if !seen["Namespace/"+namespace] {
		t.Errorf("no Namespace %s", namespace)
	}
	return objs
}

func byKind(objs []k8sObject, kinds ...string) []k8sObject {
	var out []k8sObject
	for _, k := range objs {
		if slices.Contains(kinds, k.kind()) {
			out = append(out, k)
		}
	}
	return out
}

func find(objs []k8sObject, kind, name string) (k8sObject, bool) {
	for _, k := range objs {
		if k.kind() == kind && k.name() == name {
			return k, true
		}
	}
	return k8sObject{}, false
}

// containerPort resolves a probe's or Service's port (a number or a port name) against a
// container's ports.
func containerPort(c obj, port any) (int, bool) {
	for _, p := range getList(c, "ports") {
		n, _ := getInt(p, "containerPort")
		switch v := port.(type) {
		case int:
			if v == n {
				return n, true
			}
		case string:
			if v == getStr(p, "name") {
				return n, true
			}
			if i, err := strconv.Atoi(v); err == nil && i == n {
				return n, true
			}
		}
	}
	return 0, false
}

// env is a container's environment in order: name -> the entry.
func containerEnv(c obj) ([]string, map[string]obj) {
	var names []string
	m := map[string]obj{}
	for _, e := range getList(c, "env") {
		eo, _ := e.(obj)
		n := getStr(eo, "name")
		names = append(names, n)
		m[n] = eo
	}
	return names, m
}

var envRefRe = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

func TestKubernetes(t *testing.T) {
	objs := loadK8s(t)
	flags := allFlags(t)
	workloads := byKind(objs, "Deployment", "StatefulSet")
	if len(workloads) == 0 {
		t.Fatal("no workloads")
	}
	podLabels := func(w k8sObject) map[string]string {
		return stringMap(getMap(w.o, "spec", "template", "metadata", "labels"))
	}
	// replicas of a workload: spec.replicas, or the HPA's minReplicas when one scales it (then
	// spec.replicas must be absent, or every apply would reset the HPA's count).
	hpaMin := map[string]int{}
	for _, h := range byKind(objs, "HorizontalPodAutoscaler") {
		ref := getMap(h.o, "spec", "scaleTargetRef")
		hpaMin[getStr(ref, "kind")+"/"+getStr(ref, "name")], _ = getInt(h.o, "spec", "minReplicas")
	}
	replicasOf := func(w k8sObject) int {
		if n, ok := hpaMin[w.kind()+"/"+w.name()]; ok {
			return n
		}
		n, _ := getInt(w.o, "spec", "replicas")
		return n
	}
	configMaps := map[string]obj{}
	for _, c := range byKind(objs, "ConfigMap") {
		configMaps[c.name()] = c.o
	}

	for _, w := range workloads {
		sel := stringMap(getMap(w.o, "spec", "selector", "matchLabels"))
		labels := podLabels(w)
		if len(sel) == 0 {
			t.Errorf("%v: empty spec.selector.matchLabels", w)
		} else if !subset(sel, labels) {
			t.Errorf("%v: selector %v does not match the pod template labels %v", w, sel, labels)
		}
		_, hasReplicas := getMap(w.o, "spec")["replicas"]
		if _, scaled := hpaMin[w.kind()+"/"+w.name()]; scaled && hasReplicas {
			t.Errorf("%v: spec.replicas is set, but an HPA scales it (apply would reset the count)", w)
		}
		if replicasOf(w) < 1 {
			t.Errorf("%v: no replicas (spec.replicas or an HPA's minReplicas)", w)
		}
		pod := getMap(w.o, "spec", "template", "spec")
		checkPod(t, w, pod, configMaps, flags)
		if w.kind() == "StatefulSet" {
			svcName := getStr(w.o, "spec", "serviceName")
			svc, ok := find(objs, "Service", svcName)
			switch {
			case !ok:
				t.Errorf("%v: serviceName %q is not a Service here", w, svcName)
			case getStr(svc.o, "spec", "clusterIP") != "None":
				t.Errorf("%v: serviceName %q is not headless", w, svcName)
			case !subset(stringMap(getMap(svc.o, "spec", "selector")), labels):
				t.Errorf("%v: Service %s does not select its pods", w, svcName)
			}
		}
	}

	// Services select pods of some workload, on ports those pods expose.
	for _, s := range byKind(objs, "Service") {
		sel := stringMap(getMap(s.o, "spec", "selector"))
		if len(sel) == 0 {
			t.Errorf("%v: no selector", s)
			continue
		}
		var matched []k8sObject
		for _, w := range workloads {
			if subset(sel, podLabels(w)) {
				matched = append(matched, w)
			}
		}
		if len(matched) != 1 {
			t.Errorf("%v: selector %v matches the pods of %d workloads, want 1", s, sel, len(matched))
			continue
		}
		for _, p := range getList(s.o, "spec", "ports") {
			target := get(p, "targetPort")
			if target == nil {
				target = get(p, "port")
			}
			for _, w := range matched {
				ok := false
				for _, c := range getList(w.o, "spec", "template", "spec", "containers") {
					if _, found := containerPort(c.(obj), target); found {
						ok = true
					}
				}
				if !ok {
					t.Errorf("%v: targetPort %v is not a container port of %v", s, target, w)
				}
			}
		}
	}

	// PodDisruptionBudgets cover a workload and leave it room to be disrupted.
	for _, p := range byKind(objs, "PodDisruptionBudget") {
		_, hasMin := getMap(p.o, "spec")["minAvailable"]
		_, hasMax := getMap(p.o, "spec")["maxUnavailable"]
		if hasMin == hasMax {
			t.Errorf("%v: want exactly one of minAvailable and maxUnavailable", p)
		}
		sel := stringMap(getMap(p.o, "spec", "selector", "matchLabels"))
		matched := 0
		for _, w := range workloads {
			if len(sel) > 0 && subset(sel, podLabels(w)) {
				matched++
				replicas := replicasOf(w)
				if min, ok := getInt(p.o, "spec", "minAvailable"); ok && min >= replicas {
					t.Errorf("%v: minAvailable %d with %d replicas of %v blocks every eviction", p, min, replicas, w)
				}
			}
		}
		if matched != 1 {
			t.Errorf("%v: selector %v matches %d workloads, want 1", p, sel, matched)
		}
	}

	for _, h := range byKind(objs, "HorizontalPodAutoscaler") {
		ref := getMap(h.o, "spec", "scaleTargetRef")
		if _, ok := find(objs, getStr(ref, "kind"), getStr(ref, "name")); !ok {
			t.Errorf("%v: scaleTargetRef %s/%s does not exist", h, getStr(ref, "kind"), getStr(ref, "name"))
		}
		minR, _ := getInt(h.o, "spec", "minReplicas")
		maxR, _ := getInt(h.o, "spec", "maxReplicas")
		if minR < 1 || maxR < minR {
			t.Errorf("%v: minReplicas %d maxReplicas %d", h, minR, maxR)
		}
	}

	checkK8sPlatform(t, objs)
}

// checkPod checks one pod template: security context, resources, probes on container ports,
// volumes, environment references, and for tenantmesh containers the probe paths, the
// Prometheus annotations, the admin token Secret and the TM_* variables the binary reads.
func checkPod(t *testing.T, w k8sObject, pod obj, configMaps map[string]obj, flags flagSets) {
	t.Helper()
	podNonRoot := get(pod, "securityContext", "runAsNonRoot") == true
	volumes := map[string]bool{}
	for _, v := range getList(pod, "volumes") {
		volumes[getStr(v, "name")] = true
		if cm := getStr(v, "configMap", "name"); cm != "" && configMaps[cm] == nil {
			t.Errorf("%v: volume %s uses ConfigMap %s, which is not defined", w, getStr(v, "name"), cm)
		}
	}
	for _, v := range getList(w.o, "spec", "volumeClaimTemplates") {
		volumes[getStr(v, "metadata", "name")] = true
	}
	containers := getList(pod, "containers")
	if len(containers) == 0 {
		t.Errorf("%v: no containers", w)
	}
	annotations := stringMap(getMap(w.o, "spec", "template", "metadata", "annotations"))
	for _, ci := range containers {
		c := ci.(obj)
		where := fmt.Sprintf("%v container %s", w, getStr(c, "name"))
		image := getStr(c, "image")
		if image == "" {
			t.Errorf("%s: no image", where)
		}
		if !podNonRoot && get(c, "securityContext", "runAsNonRoot") != true {
			t.Errorf("%s: runAsNonRoot is not set", where)
		}
		if get(c, "securityContext", "readOnlyRootFilesystem") != true {
			t.Errorf("%s: readOnlyRootFilesystem is not true", where)
		}
		if get(c, "securityContext", "allowPrivilegeEscalation") != false {
			t.Errorf("%s: allowPrivilegeEscalation is not false", where)
		}
		for _, k := range []string{"requests", "limits"} {
			if getStr(c, "resources", k, "memory") == "" {
				t.Errorf("%s: no resources.%s.memory", where, k)
			}
		}
		if getStr(c, "resources", "requests", "cpu") == "" {
			t.Errorf("%s: no resources.requests.cpu", where)
		}
		probePaths := map[string]string{}
		for _, probe := range []string{"readinessProbe", "livenessProbe"} {
			hg := getMap(c, probe, "httpGet")
			if hg == nil {
				t.Errorf("%s: no %s.httpGet", where, probe)
				continue
			}
			if _, ok := containerPort(c, hg["port"]); !ok {
				t.Errorf("%s: %s port %v is not a container port", where, probe, hg["port"])
			}
			probePaths[probe] = getStr(hg, "path")
		}
		for _, m := range getList(c, "volumeMounts") {
			if !volumes[getStr(m, "name")] {
				t.Errorf("%s: volumeMount %s has no volume", where, getStr(m, "name"))
			}
		}
		names, env := containerEnv(c)
		for i, n := range names {
			for _, ref := range envRefRe.FindAllStringSubmatch(getStr(env[n], "value"), -1) {
				if !slices.Contains(names[:i], ref[1]) {
					t.Errorf("%s: %s refers to $(%s), which is not defined before it", where, n, ref[1])
				}
			}
		}
		if !strings.HasPrefix(image, "tenantmesh:") {
			continue
		}
		// A tenantmesh process.
		if probePaths["readinessProbe"] != "/readyz" || probePaths["livenessProbe"] != "/healthz" {
			t.Errorf("%s: probes %v, want readiness /readyz and liveness /healthz", where, probePaths)
		}
		cmd := getList(c, "command")
		if len(cmd) == 0 {
			t.Errorf("%s: no command (the image holds several binaries)", where)
			continue
		}
		binary := fmt.Sprint(cmd[0])
		flags.checkEnv(t, where, binary, names)
		if annotations["prometheus.io/scrape"] != "true" {
			t.Errorf("%s: pod lacks prometheus.io/scrape: \"true\"", where)
		}
		if p, err := strconv.Atoi(annotations["prometheus.io/port"]); err != nil {
			t.Errorf("%s: prometheus.io/port %q", where, annotations["prometheus.io/port"])
		} else if _, ok := containerPort(c, p); !ok {
			t.Errorf("%s: prometheus.io/port %d is not a container port", where, p)
		}
		values := map[string]string{}
		for n, e := range env {
			values[n] = getStr(e, "value")
			if getStr(e, "valueFrom", "secretKeyRef", "name") != "" {
				values[n] = "(secret)"
			}
		}
		var args []string
		for _, a := range append(getList(c, "command"), getList(c, "args")...) {
			args = append(args, fmt.Sprint(a))
		}
		if n, err := strconv.Atoi(listenPort(args, values)); err != nil {
			t.Errorf("%s: no listen address (--addr or TM_ADDR)", where)
		} else if _, ok := containerPort(c, n); !ok {
			t.Errorf("%s: listens on %d, not a container port", where, n)
		}
		if values["TM_NATS_URL"] == "" {
			t.Errorf("%s: no TM_NATS_URL", where)
		}
		if env["TM_ADMIN_TOKEN"] != nil && values["TM_ADMIN_TOKEN"] != "(secret)" {
			t.Errorf("%s: TM_ADMIN_TOKEN does not come from a Secret", where)
		}
		flags.checkCluster(t, where, binary, values)
	}
}

// checkK8sPlatform checks what the platform needs: the shards of deploy.Shards as generated, one
// StatefulSet each with the instance identity from the downward API, the gateway and
// rebalancer, and a 3-node NATS cluster whose config routes to its own pods.
func checkK8sPlatform(t *testing.T, objs []k8sObject) {
	t.Helper()
	for _, s := range Shards {
		want, err := RenderShard(s)
		if err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(filepath.Join("k8s", ShardFile(s)))
		if err != nil {
			t.Errorf("shard %s: %v (run go run ./deploy/k8s/gen)", s.Name(), err)
			continue
		}
		if !bytes.Equal(got, want) {
			t.Errorf("k8s/%s is not what deploy/k8s/gen generates; run go run ./deploy/k8s/gen", ShardFile(s))
		}
		sts, ok := find(objs, "StatefulSet", s.Name())
		if !ok {
			t.Errorf("no StatefulSet %s", s.Name())
			continue
		}
		if r, _ := getInt(sts.o, "spec", "replicas"); r != s.Replicas {
			t.Errorf("%v: replicas %d, want %d", sts, r, s.Replicas)
		}
		if g, _ := getInt(sts.o, "spec", "template", "spec", "terminationGracePeriodSeconds"); g < 45 {
			t.Errorf("%v: terminationGracePeriodSeconds %d, too short for a drain", sts, g)
		}
		c := getList(sts.o, "spec", "template", "spec", "containers")[0].(obj)
		if cmd := getList(c, "command"); len(cmd) == 0 || cmd[0] != s.Kind {
			t.Errorf("%v: command %v, want %s", sts, cmd, s.Kind)
		}
		_, env := containerEnv(c)
		if v := getStr(env["TM_SHARD"], "value"); v != s.Name() {
			t.Errorf("%v: TM_SHARD %q", sts, v)
		}
		if v := getStr(env["TM_INSTANCE"], "valueFrom", "fieldRef", "fieldPath"); v != "metadata.name" {
			t.Errorf("%v: TM_INSTANCE is not the pod name (fieldRef %q)", sts, v)
		}
		if v := getStr(env["POD_IP"], "valueFrom", "fieldRef", "fieldPath"); v != "status.podIP" {
			t.Errorf("%v: POD_IP is not status.podIP", sts)
		}
		if v := getStr(env["TM_URL"], "value"); v != "http://$(POD_IP):9000" {
			t.Errorf("%v: TM_URL %q", sts, v)
		}
		if _, ok := find(objs, "PodDisruptionBudget", s.Name()); !ok {
			t.Errorf("shard %s has no PodDisruptionBudget", s.Name())
		}
	}
	if len(byKind(objs, "StatefulSet")) != len(Shards)+1 {
		t.Errorf("%d StatefulSets, want one per shard (%d) and NATS", len(byKind(objs, "StatefulSet")), len(Shards))
	}
	for _, name := range []string{"gateway", "rebalancer"} {
		if _, ok := find(objs, "Deployment", name); !ok {
			t.Errorf("no Deployment %s", name)
		}
		if _, ok := find(objs, "Service", name); !ok {
			t.Errorf("no Service %s", name)
		}
	}
	if pdb, ok := find(objs, "PodDisruptionBudget", "gateway"); !ok {
		t.Error("no gateway PodDisruptionBudget")
	} else if m, _ := getInt(pdb.o, "spec", "minAvailable"); m != 1 {
		t.Errorf("%v: minAvailable %d, want 1", pdb, m)
	}

	nats, ok := find(objs, "StatefulSet", "nats")
	if !ok {
		t.Fatal("no NATS StatefulSet")
	}
	if r, _ := getInt(nats.o, "spec", "replicas"); r != 3 {
		t.Errorf("%v: replicas %d, want 3", nats, r)
	}
	headless := getStr(nats.o, "spec", "serviceName")
	if svc, ok := find(objs, "Service", headless); ok && get(svc.o, "spec", "publishNotReadyAddresses") != true {
		t.Errorf("%v: publishNotReadyAddresses must be true or the cluster cannot form", svc)
	}
	var routes []string
	for i := range 3 {
		routes = append(routes, fmt.Sprintf("nats-%d.%s:6222", i, headless))
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
	// Clients reach NATS through a Service that exists, with their role's credentials mounted
	// from a Secret.
	for _, w := range byKind(objs, "Deployment", "StatefulSet") {
		for _, c := range getList(w.o, "spec", "template", "spec", "containers") {
			_, env := containerEnv(c.(obj))
			if _, ok := env["TM_NATS_URL"]; ok {
				checkCredsMount(t, w, c.(obj), getStr(env["TM_NATS_CREDS"], "value"))
			}
			for _, u := range strings.Split(getStr(env["TM_NATS_URL"], "value"), ",") {
				if u == "" {
					continue
				}
				pu, err := url.Parse(u)
				if err != nil {
					t.Errorf("%v: TM_NATS_URL %q: %v", w, u, err)
					continue
				}
				if _, ok := find(objs, "Service", pu.Hostname()); !ok {
					t.Errorf("%v: TM_NATS_URL host %q is not a Service", w, pu.Hostname())
				}
			}
		}
	}
}

// checkCredsMount: creds is set and lies in a read-only mount of a Secret volume.
func checkCredsMount(t *testing.T, w any, c obj, creds string) {
	t.Helper()
	if creds == "" {
		t.Errorf("%v: no TM_NATS_CREDS: NATS runs secured", w)
		return
	}
	for _, m := range getList(c, "volumeMounts") {
		mo := m.(obj)
		if dir := getStr(mo, "mountPath"); dir != "" && filepath.Dir(creds) == dir {
			if get(mo, "readOnly") != true {
				t.Errorf("%v: credentials mount %s is not read-only", w, dir)
			}
			return
		}
	}
	t.Errorf("%v: TM_NATS_CREDS %s is in no volume mount", w, creds)
}

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

// --- docker ----------------------------------------------------------------------------------

var dockerBuildPkgRe = regexp.MustCompile(`\./[a-z]+(?:/[a-z]+)*/cmd/([a-z]+)`)

// dockerBinaries are the binaries deploy/docker/Dockerfile builds.
func dockerBinaries(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile("docker/Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	src := string(b)
	for _, want := range []string{"FROM golang:", "CGO_ENABLED=0", "USER 65532"} {
		if !strings.Contains(src, want) {
			t.Errorf("Dockerfile: no %q", want)
		}
	}
	var out []string
	for _, m := range dockerBuildPkgRe.FindAllStringSubmatch(src, -1) {
		out = append(out, m[1])
		pkg := filepath.Join(repoRoot, m[0])
		if files, _ := filepath.Glob(filepath.Join(pkg, "*.go")); len(files) == 0 {
			// The rebalancer's CLI may land after this file; everything else must exist.
			if m[1] == "rebalance" {
				t.Logf("Dockerfile builds %s, which is not in the tree yet", m[0])
			} else {
				t.Errorf("Dockerfile builds %s, which has no Go files", m[0])
			}
		}
	}
	for _, b := range binaries {
		if !slices.Contains(out, b) {
			t.Errorf("Dockerfile does not build %s", b)
		}
	}
	// The build context must keep what go build needs.
	ignore, err := os.ReadFile("docker/Dockerfile.dockerignore")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(ignore), "\n") {
		pat := strings.TrimSpace(line)
		if pat == "" || strings.HasPrefix(pat, "#") {
			continue
		}
		for _, need := range []string{"go.mod", "go.sum", "gateway/x.go", "rebalancer/x.go", "services/x.go", "shardkit/x.go", "internal/x.go"} {
			if m, _ := filepath.Match(pat, need); m || strings.HasPrefix(need, strings.TrimSuffix(pat, "/")+"/") {
				t.Errorf("Dockerfile.dockerignore: %q excludes %s from the build", pat, need)
			}
		}
	}
	return out
}

// --- compose ---------------------------------------------------------------------------------

type composeFile struct {
	Name     string                    `yaml:"name"`
	Services map[string]composeService `yaml:"services"`
	Volumes  map[string]any            `yaml:"volumes"`
	Networks map[string]any            `yaml:"networks"`
	Ext      map[string]any            `yaml:",inline"` // x-* extension fields
}

type composeService struct {
	Image string `yaml:"image"`
	Build *struct {
		Context    string `yaml:"context"`
		Dockerfile string `yaml:"dockerfile"`
	} `yaml:"build"`
	Command     []string       `yaml:"command"`
	Entrypoint  []string       `yaml:"entrypoint"`
	Environment map[string]any `yaml:"environment"`
	Ports       []string       `yaml:"ports"`
	Expose      []string       `yaml:"expose"`
	Volumes     []string       `yaml:"volumes"`
	DependsOn   map[string]struct {
		Condition string `yaml:"condition"`
	} `yaml:"depends_on"`
	Healthcheck *struct {
		Test          []string `yaml:"test"`
		Interval      string   `yaml:"interval"`
		Timeout       string   `yaml:"timeout"`
		Retries       int      `yaml:"retries"`
		StartPeriod   string   `yaml:"start_period"`
		StartInterval string   `yaml:"start_interval"`
	} `yaml:"healthcheck"`
	Hostname        string            `yaml:"hostname"`
	Restart         string            `yaml:"restart"`
	StopGracePeriod string            `yaml:"stop_grace_period"`
	Labels          map[string]string `yaml:"labels"`
	User            string            `yaml:"user"`
}

func (s composeService) env() map[string]string {
	out := map[string]string{}
	for k, v := range s.Environment {
		out[k] = fmt.Sprint(v)
	}
	return out
}

func loadCompose(t *testing.T) composeFile {
	t.Helper()
	var c composeFile
	strictYAML(t, "compose/docker-compose.yml", &c)
	for k := range c.Ext {
		if !strings.HasPrefix(k, "x-") {
			t.Errorf("docker-compose.yml: unknown top-level key %q", k)
		}
	}
	return c
}

func TestCompose(t *testing.T) {
	c := loadCompose(t)
	flags := allFlags(t)
	built := dockerBinaries(t)
	hostPorts := map[string]string{}
	for name, s := range c.Services {
		where := "compose " + name
		if s.Image == "" && s.Build == nil {
			t.Errorf("%s: neither image nor build", where)
		}
		if s.Build != nil {
			ctx := filepath.Join("compose", s.Build.Context)
			if _, err := os.Stat(filepath.Join(ctx, "go.mod")); err != nil {
				t.Errorf("%s: build context %s is not the module root: %v", where, s.Build.Context, err)
			}
			if _, err := os.Stat(filepath.Join(ctx, s.Build.Dockerfile)); err != nil {
				t.Errorf("%s: dockerfile: %v", where, err)
			}
		}
		for dep, cond := range s.DependsOn {
			d, ok := c.Services[dep]
			if !ok {
				t.Errorf("%s: depends on %s, which is not a service", where, dep)
				continue
			}
			switch cond.Condition {
			case "service_healthy":
				if d.Healthcheck == nil {
					t.Errorf("%s: waits for %s to be healthy, which has no healthcheck", where, dep)
				}
			case "", "service_started", "service_completed_successfully":
			default:
				t.Errorf("%s: depends_on %s condition %q", where, dep, cond.Condition)
			}
		}
		if s.Healthcheck == nil || len(s.Healthcheck.Test) < 2 || s.Healthcheck.Test[0] != "CMD" {
			t.Errorf("%s: no healthcheck (CMD form)", where)
		}
		for _, p := range s.Ports {
			parts := strings.Split(p, ":")
			if len(parts) != 2 {
				t.Errorf("%s: port %q: want host:container", where, p)
				continue
			}
			if other, dup := hostPorts[parts[0]]; dup {
				t.Errorf("%s: host port %s is also published by %s", where, parts[0], other)
			}
			hostPorts[parts[0]] = name
		}
		for _, v := range s.Volumes {
			src, _, ok := strings.Cut(v, ":")
			if !ok {
				t.Errorf("%s: volume %q: want source:target", where, v)
				continue
			}
			if strings.HasPrefix(src, "./nats-auth/") {
				continue // written by rebalance auth init before the first up (see the file's header)
			}
			if strings.HasPrefix(src, ".") || strings.HasPrefix(src, "/") {
				if _, err := os.Stat(filepath.Join("compose", src)); err != nil {
					t.Errorf("%s: bind mount: %v", where, err)
				}
			} else if _, ok := c.Volumes[src]; !ok {
				t.Errorf("%s: named volume %s is not declared", where, src)
			}
		}
		if s.Image != "tenantmesh:dev" {
			continue
		}
		// A tenantmesh process.
		if len(s.Command) == 0 {
			t.Errorf("%s: no command", where)
			continue
		}
		binary := s.Command[0]
		if binary == "sh" && len(s.Command) == 3 {
			binary = strings.Fields(s.Command[2])[1] // sh -c "exec <binary> ..."
		}
		if !slices.Contains(built, binary) {
			t.Errorf("%s: runs %q, which the image does not build", where, binary)
		}
		env := s.env()
		var names []string
		for k := range env {
			names = append(names, k)
		}
		sort.Strings(names)
		flags.checkEnv(t, where, binary, names)
		if env["TM_NATS_URL"] == "" {
			t.Errorf("%s: no TM_NATS_URL", where)
		}
		if creds := env["TM_NATS_CREDS"]; creds == "" {
			t.Errorf("%s: no TM_NATS_CREDS: NATS runs secured", where)
		} else if !slices.ContainsFunc(s.Volumes, func(v string) bool { return strings.Contains(v, ":"+creds+":") }) {
			t.Errorf("%s: TM_NATS_CREDS %s is not mounted", where, creds)
		}
		for _, u := range strings.Split(env["TM_NATS_URL"], ",") {
			pu, err := url.Parse(u)
			if err != nil || c.Services[pu.Hostname()].Image == "" {
				t.Errorf("%s: TM_NATS_URL %q is not a compose service", where, u)
			} else if _, ok := s.DependsOn[pu.Hostname()]; !ok {
				t.Errorf("%s: does not depend on %s", where, pu.Hostname())
			}
		}
		port := listenPort(s.Command, env)
		if port == "" {
			t.Errorf("%s: no listen address (--addr or TM_ADDR)", where)
		}
		if s.Healthcheck != nil && !strings.Contains(strings.Join(s.Healthcheck.Test, " "), ":"+port+"/readyz") {
			t.Errorf("%s: healthcheck %v does not probe /readyz on the TM_ADDR port %s", where, s.Healthcheck.Test, port)
		}
		flags.checkCluster(t, where, binary, env)
	}
	for _, s := range Shards {
		svc, ok := c.Services[s.Name()]
		if !ok {
			t.Errorf("compose: no service for shard %s", s.Name())
			continue
		}
		if svc.env()["TM_SHARD"] != s.Name() {
			t.Errorf("compose %s: TM_SHARD %q", s.Name(), svc.env()["TM_SHARD"])
		}
		if len(svc.Command) != 3 || !strings.HasPrefix(svc.Command[2], "exec "+s.Kind+" ") {
			t.Errorf("compose %s: command %q does not run %s", s.Name(), svc.Command, s.Kind)
		}
	}
	for _, name := range []string{"gateway", "rebalancer", "prometheus", "grafana"} {
		if _, ok := c.Services[name]; !ok {
			t.Errorf("compose: no %s service", name)
		}
	}
}

// --- Prometheus ------------------------------------------------------------------------------

// promConfig is the part of Prometheus' configuration these files use; decoding is strict, so a
// misspelt key fails here rather than in Prometheus.
type promConfig struct {
	Global struct {
		ScrapeInterval     string            `yaml:"scrape_interval"`
		EvaluationInterval string            `yaml:"evaluation_interval"`
		ExternalLabels     map[string]string `yaml:"external_labels"`
	} `yaml:"global"`
	ScrapeConfigs []struct {
		JobName       string `yaml:"job_name"`
		MetricsPath   string `yaml:"metrics_path"`
		StaticConfigs []struct {
			Targets []string          `yaml:"targets"`
			Labels  map[string]string `yaml:"labels"`
		} `yaml:"static_configs"`
		DNSSDConfigs []struct {
			Names           []string `yaml:"names"`
			Type            string   `yaml:"type"`
			Port            int      `yaml:"port"`
			RefreshInterval string   `yaml:"refresh_interval"`
		} `yaml:"dns_sd_configs"`
		KubernetesSDConfigs []struct {
			Role       string `yaml:"role"`
			Namespaces struct {
				Names []string `yaml:"names"`
			} `yaml:"namespaces"`
		} `yaml:"kubernetes_sd_configs"`
		RelabelConfigs []struct {
			SourceLabels []string `yaml:"source_labels"`
			Separator    string   `yaml:"separator"`
			Regex        string   `yaml:"regex"`
			TargetLabel  string   `yaml:"target_label"`
			Replacement  string   `yaml:"replacement"`
			Action       string   `yaml:"action"`
		} `yaml:"relabel_configs"`
	} `yaml:"scrape_configs"`
}

func loadProm(t *testing.T, path string) promConfig {
	t.Helper()
	var p promConfig
	strictYAML(t, path, &p)
	jobs := map[string]bool{}
	for _, sc := range p.ScrapeConfigs {
		if sc.JobName == "" || jobs[sc.JobName] {
			t.Errorf("%s: job_name %q empty or repeated", path, sc.JobName)
		}
		jobs[sc.JobName] = true
		for _, r := range sc.RelabelConfigs {
			switch r.Action {
			case "", "replace", "keep", "drop", "labelmap", "labeldrop", "labelkeep", "hashmod", "lowercase", "uppercase":
			default:
				t.Errorf("%s job %s: relabel action %q", path, sc.JobName, r.Action)
			}
			if r.Regex != "" {
				if _, err := regexp.Compile("^(?:" + r.Regex + ")$"); err != nil {
					t.Errorf("%s job %s: regex %q: %v", path, sc.JobName, r.Regex, err)
				}
			}
			if (r.Action == "" || r.Action == "replace") && r.TargetLabel == "" {
				t.Errorf("%s job %s: replace without target_label", path, sc.JobName)
			}
		}
	}
	return p
}

func TestPrometheusCompose(t *testing.T) {
	c := loadCompose(t)
	p := loadProm(t, "prometheus/prometheus.yml")
	scraped := map[string]bool{}
	for _, sc := range p.ScrapeConfigs {
		for _, st := range sc.StaticConfigs {
			for _, target := range st.Targets {
				host, port, ok := strings.Cut(target, ":")
				if !ok {
					t.Errorf("job %s: target %q without port", sc.JobName, target)
					continue
				}
				if host == "localhost" && sc.JobName == "prometheus" {
					continue
				}
				svc, exists := c.Services[host]
				if !exists {
					t.Errorf("job %s: target %s is not a compose service", sc.JobName, host)
					continue
				}
				if lp := listenPort(svc.Command, svc.env()); lp != port {
					t.Errorf("job %s: target %s, but %s listens on port %q", sc.JobName, target, host, lp)
				}
				scraped[host] = true
			}
		}
		for _, dns := range sc.DNSSDConfigs {
			if dns.Type != "A" || dns.Port == 0 {
				t.Errorf("job %s: dns_sd type %q port %d", sc.JobName, dns.Type, dns.Port)
			}
			for _, n := range dns.Names {
				svc, exists := c.Services[n]
				if !exists {
					t.Errorf("job %s: dns_sd name %s is not a compose service", sc.JobName, n)
					continue
				}
				if lp := listenPort(svc.Command, svc.env()); lp != strconv.Itoa(dns.Port) {
					t.Errorf("job %s: port %d, but %s listens on port %q", sc.JobName, dns.Port, n, lp)
				}
				if !strings.HasPrefix(n, sc.JobName+"-") {
					t.Errorf("job %s scrapes %s: the job is the shard's kind", sc.JobName, n)
				}
				scraped[n] = true
			}
		}
	}
	for name, s := range c.Services {
		if s.Image == "tenantmesh:dev" && !scraped[name] {
			t.Errorf("compose service %s is not scraped", name)
		}
	}
	// The compose prometheus service runs this file; Grafana's data source is that service.
	prom := c.Services["prometheus"]
	if !slices.Contains(prom.Volumes, "../prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro") {
		t.Errorf("compose prometheus does not mount deploy/prometheus/prometheus.yml: %v", prom.Volumes)
	}
}

func TestPrometheusKubernetes(t *testing.T) {
	objs := loadK8s(t)
	p := loadProm(t, "prometheus/prometheus-k8s.yml")
	if len(p.ScrapeConfigs) == 0 {
		t.Fatal("no scrape configs")
	}
	usedLabels := map[string]bool{}
	for _, sc := range p.ScrapeConfigs {
		if len(sc.KubernetesSDConfigs) == 0 {
			t.Errorf("job %s: no kubernetes_sd_configs", sc.JobName)
		}
		for _, k := range sc.KubernetesSDConfigs {
			if k.Role != "pod" || !slices.Equal(k.Namespaces.Names, []string{namespace}) {
				t.Errorf("job %s: role %q namespaces %v", sc.JobName, k.Role, k.Namespaces.Names)
			}
		}
		keepsAnnotated := false
		for _, r := range sc.RelabelConfigs {
			for _, l := range r.SourceLabels {
				if name, ok := strings.CutPrefix(l, "__meta_kubernetes_pod_label_"); ok {
					usedLabels[name] = true
				}
				if l == "__meta_kubernetes_pod_annotation_prometheus_io_scrape" && r.Action == "keep" {
					keepsAnnotated = true
				}
			}
		}
		if !keepsAnnotated {
			t.Errorf("job %s: does not keep only prometheus.io/scrape pods", sc.JobName)
		}
	}
	// Prometheus sanitizes label names: app.kubernetes.io/name -> app_kubernetes_io_name.
	sanitize := strings.NewReplacer(".", "_", "/", "_", "-", "_")
	for _, w := range byKind(objs, "Deployment", "StatefulSet") {
		labels := getMap(w.o, "spec", "template", "metadata", "labels")
		if getStr(w.o, "metadata", "name") == "nats" {
			continue
		}
		have := map[string]bool{}
		for k := range labels {
			have[sanitize.Replace(k)] = true
		}
		for l := range usedLabels {
			if l == "tenantmesh_io_shard" && w.kind() != "StatefulSet" {
				continue
			}
			if !have[l] {
				t.Errorf("%v: pods lack the label Prometheus reads as %s", w, l)
			}
		}
	}
}

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
	Panels []grafanaPanel `json:"panels"`
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
	"tm_runner_jobs_created_total", "tm_runner_effects_total",
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
	if err != nil || c.Services[u.Hostname()].Image == "" || !slices.Contains(c.Services[u.Hostname()].Ports, u.Port()+":"+u.Port()) {
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
