//go:build linux && race

package gateway

import (
	"runtime"
	"unsafe"
)

// The race detector does not see the memory a raw system call reads or writes; sock tells it,
// as syscall.Read and syscall.Write do for net.Conn's calls, so -race checks the buffers the
// gateway reads into and writes from as it did before.

// ioSync orders a sock's writes before the reads of what they sent (syscall keeps its own).
var ioSync int64

func raceReadBuf(p []byte) {
	if len(p) > 0 {
		runtime.RaceReadRange(unsafe.Pointer(&p[0]), len(p))
	}
}

func raceWroteBuf(p []byte) {
	if len(p) > 0 {
		runtime.RaceWriteRange(unsafe.Pointer(&p[0]), len(p))
	}
}

func raceBeforeWrite() { runtime.RaceReleaseMerge(unsafe.Pointer(&ioSync)) }
func raceAfterRead()   { runtime.RaceAcquire(unsafe.Pointer(&ioSync)) }
