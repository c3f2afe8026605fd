package natsauth_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/tenantmesh/tenantmesh/internal/natsauth"
)

// TestAttackPlantedSecretFiles (low): the chain's seeds were written through a fixed
// temporary name (chain.json.tmp) that os.WriteFile follows if it is a symbolic link, so a
// local user who planted one received the seeds; and a credentials file that existed with a
// loose mode kept it when written again. Secrets now go through a new file made with O_EXCL
// (mode 0600) and renamed into place.
func TestAttackPlantedSecretFiles(t *testing.T) {
	dir := t.TempDir()
	stolen := filepath.Join(dir, "stolen")
	if err := os.WriteFile(stolen, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(stolen, filepath.Join(dir, "chain.json.tmp")); err != nil {
		t.Fatal(err)
	}
	c, err := natsauth.LoadOrCreate(dir)
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(stolen); len(b) > 0 {
		t.Fatalf("the chain's seeds went through a planted link: %d bytes in a world-readable file", len(b))
	}
	creds := filepath.Join(dir, "creds")
	if err := os.MkdirAll(creds, 0o755); err != nil {
		t.Fatal(err)
	}
	loose := filepath.Join(creds, "gateway.creds")
	if err := os.WriteFile(loose, []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}
	path, err := c.WriteCreds(creds, natsauth.Role{Name: "gateway", Pub: []string{">"}, Sub: []string{">"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{path, filepath.Join(dir, "chain.json")} {
		if fi, err := os.Stat(p); err != nil || fi.Mode().Perm() != 0o600 {
			t.Fatalf("%s: mode %v (%v), want 0600", p, fi.Mode().Perm(), err)
		}
	}
}
