package deploy

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

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
