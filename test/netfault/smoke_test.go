package netfault_test

import (
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/tenantmesh/tenantmesh/test/netfault"
)

var (
	buildOnce sync.Once
	binDir    string
	buildErr  error
)

// bin builds the fleet's binaries once per test process.
func bin(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		binDir, buildErr = os.MkdirTemp("", "netfault-bin-")
		if buildErr == nil {
			root, _ := filepath.Abs("../..")
			buildErr = netfault.Build(root, binDir)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binDir
}

func TestMain(m *testing.M) {
	code := m.Run()
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	os.Exit(code)
}

func TestFleetStarts(t *testing.T) {
	if testing.Short() {
		t.Skip("a whole fleet")
	}
	if err := netfault.Requirements(); err != nil {
		t.Skip(err)
	}
	f := netfault.Start(t, netfault.Options{Bin: bin(t)})
	t.Logf("fleet up: %s", f.NATSURLs())
}
