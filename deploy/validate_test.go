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
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

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
	return yamlDocsOf(t, path, b)
}

// yamlDocsOf parses every document of YAML b, read from path (for messages).
func yamlDocsOf(t *testing.T, path string, b []byte) []obj {
	t.Helper()
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
		globs = []string{"gateway/cmd/gateway/*.go", "gateway/flags.go"}
	case "rebalance":
		globs = []string{"rebalancer/cmd/rebalance/*.go", "rebalancer/cli/*.go"}
	case "aggregate", "projection", "runner":
		globs = []string{"services/" + binary + "/cmd/" + binary + "/*.go", "shardkit/shardmain/*.go"}
	default:
		t.Fatalf("unknown binary %q", binary)
	}
	globs = append(globs, "shardkit/natsconn/*.go") // every binary's --nats-* flags
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
		// Helm templates are not YAML until rendered (TestHelmChart renders them).
		if d.IsDir() && d.Name() == "templates" && strings.HasPrefix(path, "helm"+string(filepath.Separator)) {
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
