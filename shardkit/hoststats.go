package shardkit

// hostStats are the process's memory and its disk's use, for load reports and the directory
// entry's last metrics (the multi-host design's "last CPU/RAM/disk from heartbeat"). They are
// read once a heartbeat: a file read and two system calls.
type hostStats struct {
	// MemBytes is the process's resident memory; MemPercent that share of the machine's.
	MemBytes   uint64
	MemPercent float64
	// DiskPercent is how full the filesystem holding DiskPath is; DiskFreeBytes what is left
	// to an unprivileged writer.
	DiskPercent   float64
	DiskFreeBytes uint64
}
