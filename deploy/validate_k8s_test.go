package deploy

import (
	"bytes"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

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
	"Secret":                  "v1",
	"ServiceMonitor":          "monitoring.coreos.com/v1",
	"PrometheusRule":          "monitoring.coreos.com/v1",
	"NetworkPolicy":           "networking.k8s.io/v1",
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
		objs = append(objs, k8sObjectsOf(t, "k8s/"+f, yamlDocs(t, filepath.Join("k8s", f)), seen)...)
	}
	if !seen["Namespace/"+namespace] {
		t.Errorf("no Namespace %s", namespace)
	}
	return objs
}

// k8sObjectsOf checks each document's header (the apiVersion of its kind, a name, the
// tenantmesh namespace, a spec or data) and that no kind/name is in seen yet, and returns the
// documents as objects of file.
func k8sObjectsOf(t *testing.T, file string, docs []obj, seen map[string]bool) []k8sObject {
	t.Helper()
	var objs []k8sObject
	for _, o := range docs {
		k := k8sObject{file: file, o: o}
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
	checkK8sObjects(t, objs, allFlags(t))
	checkK8sPlatform(t, objs)
}

// checkK8sObjects checks a set of objects for consistency with each other and with the
// binaries' flags: workloads (pods, probes, security, environment), Services, PDBs and HPAs.
// The Kubernetes manifests and the Helm chart's rendered output both go through it.
func checkK8sObjects(t *testing.T, objs []k8sObject, flags flagSets) {
	t.Helper()
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
