package layering

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// module is the import path every rule is about; imports outside it are not checked.
const module = "github.com/tenantmesh/tenantmesh"

// Floors, from the bottom. A package may import a package on a lower floor, or one on its own
// floor in its own component; never one above, nor another component on its floor. Mains (cmd/
// directories and other package main) sit on their component's top floor.
const (
	floorBase     = iota // internal/ (helpers we don't support) and proto/ (generated API types)
	floorPlumbing        // shardkit's NATS plumbing: schema, jsx, kvwatch, natsconn, placement, tmhttp
	floorShardkit        // shardkit itself and the packages built on it (events, shardmain, ...)
	floorServices        // the components: gateway, rebalancer, services
	floorTop             // test/ (end-to-end tests, harnesses) and deploy/ (the dev stack, manifests)
)

var floorNames = [...]string{"internal/proto", "shardkit plumbing", "shardkit", "components", "top"}

// plumbing is shardkit's lower floor: what talks to NATS, with no notion of a shard.
var plumbing = []string{"schema", "jsx", "kvwatch", "natsconn", "placement", "tmhttp"}

// place is where a package sits: its component (its top-level directory) and its floor.
type place struct {
	component string
	floor     int
}

// placeOf returns where the package at path (module-relative, "" for the module root) sits.
func placeOf(path string) (place, error) {
	top, rest, _ := strings.Cut(path, "/")
	switch top {
	case "internal", "proto":
		return place{top, floorBase}, nil
	case "shardkit":
		sub, _, _ := strings.Cut(rest, "/")
		if slices.Contains(plumbing, sub) {
			return place{top, floorPlumbing}, nil
		}
		return place{top, floorShardkit}, nil
	case "gateway", "rebalancer", "services":
		return place{top, floorServices}, nil
	case "test", "deploy":
		return place{top, floorTop}, nil
	}
	return place{}, fmt.Errorf("%s has no floor: add its directory to the floors of internal/layering and docs/design.md", path)
}

// topOf is the highest floor of a component: its mains, and every test in it, sit there (an
// external test of shardkit/schema is a user of shardkit and may import shardkit/kittest).
func topOf(component string) int {
	switch component {
	case "internal", "proto":
		return floorBase
	case "shardkit":
		return floorShardkit
	case "gateway", "rebalancer", "services":
		return floorServices
	}
	return floorTop
}

// check says why from (at p) may not import to, or "" when it may.
func check(p place, to string) string {
	q, err := placeOf(to)
	if err != nil {
		return err.Error()
	}
	switch {
	case q.floor > p.floor:
		return fmt.Sprintf("floor %q imports floor %q above it", floorNames[p.floor], floorNames[q.floor])
	case q.floor == p.floor && q.component != p.component:
		return fmt.Sprintf("%s imports %s, another component on its floor (%q)", p.component, q.component, floorNames[p.floor])
	}
	return ""
}

// pkg is what go list says of a package.
type pkg struct {
	ImportPath   string
	Name         string
	Imports      []string
	TestImports  []string
	XTestImports []string
	Module       *struct{ Path string }
}

// list runs go list over the module the test sits in.
func list(t *testing.T) []pkg {
	t.Helper()
	if _, err := exec.LookPath("go"); err != nil {
		t.Fatalf("the layering check needs the go command: %v", err)
	}
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("go", "list", "-e", "-json=ImportPath,Name,Imports,TestImports,XTestImports,Module", "./...")
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, stderr.Bytes())
	}
	var pkgs []pkg
	for dec := json.NewDecoder(bytes.NewReader(out)); ; {
		var p pkg
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("go list output: %v", err)
		}
		if p.Module != nil && p.Module.Path == module { // not a workspace's other modules
			pkgs = append(pkgs, p)
		}
	}
	if len(pkgs) < 20 {
		t.Fatalf("go list found %d packages of %s: is the test run from its directory?", len(pkgs), module)
	}
	return pkgs
}

// rel is path relative to the module, ok false when it is not in the module.
func rel(path string) (string, bool) {
	if path == module {
		return "", true
	}
	r, ok := strings.CutPrefix(path, module+"/")
	return r, ok
}

// TestFloors fails for every import, of a package or of its tests, that breaks the floors.
func TestFloors(t *testing.T) {
	var broken []string
	for _, p := range list(t) {
		from, _ := rel(p.ImportPath)
		at, err := placeOf(from)
		if err != nil {
			broken = append(broken, err.Error())
			continue
		}
		if p.Name == "main" {
			at.floor = topOf(at.component)
		}
		tests := place{at.component, topOf(at.component)}
		for _, imp := range []struct {
			kind  string
			at    place
			paths []string
		}{{"imports", at, p.Imports}, {"tests import", tests, append(slices.Clone(p.TestImports), p.XTestImports...)}} {
			for _, path := range imp.paths {
				to, ok := rel(path)
				if !ok || path == p.ImportPath {
					continue
				}
				if why := check(imp.at, to); why != "" {
					broken = append(broken, fmt.Sprintf("%s %s %s: %s", from, imp.kind, to, why))
				}
			}
		}
	}
	slices.Sort(broken)
	broken = slices.Compact(broken)
	for _, b := range broken {
		t.Error(b)
	}
}
