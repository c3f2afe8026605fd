package netfault_test

import (
	"os"
	"testing"

	"github.com/tenantmesh/tenantmesh/test/netfault"
)

func TestMain(m *testing.M) {
	code := m.Run()
	netfault.RemoveBinaries()
	os.Exit(code)
}

func TestFleetStarts(t *testing.T) {
	if testing.Short() {
		t.Skip("a whole fleet")
	}
	if err := netfault.Requirements(); err != nil {
		t.Skip(err)
	}
	f := netfault.Start(t, netfault.Options{Bin: netfault.Binaries(t)})
	t.Logf("fleet up: %s", f.NATSURLs())
}
