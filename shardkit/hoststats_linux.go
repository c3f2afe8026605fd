package shardkit

import (
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
)

// readHostStats reads them; a figure that cannot be read is 0.
func readHostStats(diskPath string) hostStats {
	var h hostStats
	h.MemBytes = residentBytes()
	var si syscall.Sysinfo_t
	if syscall.Sysinfo(&si) == nil {
		if total := uint64(si.Totalram) * uint64(si.Unit); total > 0 {
			h.MemPercent = 100 * float64(h.MemBytes) / float64(total)
		}
	}
	var fs syscall.Statfs_t
	if syscall.Statfs(diskPath, &fs) == nil && fs.Blocks > 0 {
		h.DiskPercent = 100 * float64(fs.Blocks-fs.Bfree) / float64(fs.Blocks)
		h.DiskFreeBytes = fs.Bavail * uint64(fs.Bsize)
	}
	return h
}

// residentBytes is the process's resident set (/proc/self/statm), or what the Go runtime holds
// from the system where that cannot be read.
func residentBytes() uint64 {
	if b, err := os.ReadFile("/proc/self/statm"); err == nil {
		if f := strings.Fields(string(b)); len(f) > 1 {
			if pages, err := strconv.ParseUint(f[1], 10, 64); err == nil {
				return pages * uint64(os.Getpagesize())
			}
		}
	}
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.Sys
}
