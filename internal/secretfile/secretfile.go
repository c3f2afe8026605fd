// Package secretfile writes files that hold secrets (keys, seeds, credentials): always mode
// 0600, through a new file created with O_EXCL beside the target and renamed over it. A file
// or symbolic link planted at a predictable temporary name cannot receive the secret, and an
// existing target with a looser mode is replaced, not rewritten in place (os.WriteFile keeps
// an existing file's mode, so a 0644 file stayed readable by everyone).
package secretfile

import (
	"fmt"
	"os"
	"path/filepath"
)

// Write writes data to path with mode 0600.
func Write(path string, data []byte) error {
	dir, base := filepath.Split(path)
	if dir == "" {
		dir = "."
	}
	f, err := os.CreateTemp(dir, "."+base+".*.tmp") // O_RDWR|O_CREATE|O_EXCL, mode 0600
	if err != nil {
		return fmt.Errorf("secretfile: %w", err)
	}
	tmp := f.Name()
	_, werr := f.Write(data)
	if err := f.Sync(); werr == nil {
		werr = err
	}
	if err := f.Close(); werr == nil {
		werr = err
	}
	if werr == nil {
		werr = os.Rename(tmp, path)
	}
	if werr != nil {
		os.Remove(tmp)
		return fmt.Errorf("secretfile: write %s: %w", path, werr)
	}
	return nil
}
