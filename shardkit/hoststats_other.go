//go:build !linux

package shardkit

import "runtime"

// readHostStats, off Linux: the memory the Go runtime holds from the system; no machine or
// disk figures.
func readHostStats(string) hostStats {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return hostStats{MemBytes: ms.Sys}
}
