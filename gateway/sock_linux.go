//go:build linux

package gateway

import (
	"io"
	"net"
	"os"
	"syscall"
	"unsafe"
)

// sock reads and writes a TCP connection's socket with raw system calls, inside the
// connection's syscall.RawConn: the netpoller's waits, deadlines and Close work as they do for
// net.Conn. What it leaves out is the runtime's bookkeeping around a system call
// (entersyscall/exitsyscall), which cost the gateway more than the call's own entry. A write to
// a loopback or LAN peer wakes the peer, and on a busy machine the kernel often switches to the
// woken task at the write's exit; the runtime saw that as a P stuck in a system call, took it
// from the thread, handed it to another thread it had to wake, and its monitor (sysmon), finding
// such Ps at every look, kept polling every 20 µs instead of backing off to 10 ms. Reads and
// writes of a non-blocking socket never block, so they need none of it: with sock the gateway
// makes 0.01 timer sleeps a request instead of 0.21, and 0.33 context switches instead of 0.61
// (docs/decisions.md, "The gateway's sockets are read and written raw").
//
// A sock serves one goroutine at a time for reads and one for writes, like the conn's own
// buffered reader and writer that sit on it.
type sock struct {
	rc    syscall.RawConn
	p     []byte
	iov   [2]syscall.Iovec
	first int // the first iov entry with bytes left
	n     int
	errno syscall.Errno

	// Write then wait (SendThenRead): what the next Read sends before it waits.
	later bool   // Write keeps p for the next Read instead of writing it
	out   []byte // kept by Write; sent by the next Read
	sent  int
	werr  syscall.Errno

	// The calls RawConn runs, bound once so that a read or write allocates nothing.
	readFn, writeFn, writevFn, sendReadFn func(uintptr) bool
}

// ioOf returns how to read and write c: its socket if c is a TCP connection, else c itself
// (TLS connections go through crypto/tls).
func ioOf(c net.Conn) socketIO {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return &connIO{Conn: c}
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return &connIO{Conn: c}
	}
	s := &sock{rc: rc}
	s.readFn, s.writeFn, s.writevFn, s.sendReadFn = s.read, s.write, s.writev, s.sendRead
	return s
}

// Read reads into p what the socket has, waiting until it has something. If a write was kept
// for it (SendThenRead), it sends that first.
func (s *sock) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if s.out != nil {
		if err := s.send(); err != nil {
			return 0, err
		}
	}
	s.p, s.n, s.errno = p, 0, 0
	err := s.rc.Read(s.readFn)
	s.p = nil
	switch {
	case err != nil:
		return 0, err
	case s.errno != 0:
		return 0, &net.OpError{Op: "read", Net: "tcp", Err: os.NewSyscallError("read", s.errno)}
	case s.n == 0:
		return 0, io.EOF
	}
	raceWroteBuf(p[:s.n])
	raceAfterRead()
	return s.n, nil
}

// read is one try of Read; false: nothing to read yet, wait.
func (s *sock) read(fd uintptr) bool {
	for {
		n, _, e := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&s.p[0])), uintptr(len(s.p)))
		switch e {
		case 0:
			s.n = int(n)
			return true
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			return false
		}
		s.errno = e
		return true
	}
}

// Write writes all of p, waiting while the socket's buffer is full; within SendThenRead it
// keeps p, which must not change before the next Read, for that Read to send.
func (s *sock) Write(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if s.later && s.out == nil {
		s.out = p
		return len(p), nil
	}
	raceReadBuf(p)
	raceBeforeWrite()
	s.p, s.n, s.errno = p, 0, 0
	err := s.rc.Write(s.writeFn)
	s.p = nil
	return s.n, s.writeErr(err)
}

// write is one try of Write; false: the socket's buffer is full, wait.
func (s *sock) write(fd uintptr) bool {
	n, e := writeAll(fd, s.p[s.n:])
	s.n += n
	switch e {
	case 0:
		return true
	case syscall.EAGAIN:
		return false
	}
	s.errno = e
	return true
}

// writeAll writes p until all of it is written, the socket's buffer is full (EAGAIN) or an
// error stops it; it returns the bytes written and what stopped it (0: nothing).
func writeAll(fd uintptr, p []byte) (int, syscall.Errno) {
	n := 0
	for n < len(p) {
		q := p[n:]
		m, _, e := syscall.RawSyscall(syscall.SYS_WRITE, fd, uintptr(unsafe.Pointer(&q[0])), uintptr(len(q)))
		switch {
		case e == 0 && m > 0:
			n += int(m)
		case e == 0: // a stream socket never writes nothing; do not spin if one does
			return n, syscall.EIO
		case e != syscall.EINTR:
			return n, e
		}
	}
	return n, 0
}

// Writev writes a, then b, without copying them together; it returns the bytes written of both.
func (s *sock) Writev(a, b []byte) (int, error) {
	s.n, s.errno, s.first = 0, 0, 2
	for _, p := range [2][]byte{b, a} {
		if len(p) > 0 {
			s.first--
			s.iov[s.first] = syscall.Iovec{Base: &p[0]}
			s.iov[s.first].SetLen(len(p))
		}
	}
	var err error
	if s.first < 2 {
		raceReadBuf(a)
		raceReadBuf(b)
		raceBeforeWrite()
		err = s.rc.Write(s.writevFn)
	}
	s.iov = [2]syscall.Iovec{} // no pointers kept to the caller's buffers
	return s.n, s.writeErr(err)
}

// writev is one try of Writev; false: the socket's buffer is full, wait.
func (s *sock) writev(fd uintptr) bool {
	for s.first < 2 {
		iov := s.iov[s.first:]
		n, _, e := syscall.RawSyscall(syscall.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&iov[0])), uintptr(len(iov)))
		switch e {
		case 0:
			if n == 0 { // as in writeAll
				s.errno = syscall.EIO
				return true
			}
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			return false
		default:
			s.errno = e
			return true
		}
		s.n += int(n)
		for left := uint64(n); s.first < 2; s.first++ {
			v := &s.iov[s.first]
			if l := uint64(v.Len); left < l {
				v.Base = (*byte)(unsafe.Add(unsafe.Pointer(v.Base), left))
				v.SetLen(int(l - left))
				break
			} else {
				left -= l
			}
		}
	}
	return true
}

func (s *sock) writeErr(err error) error {
	switch {
	case err != nil:
		return err
	case s.errno != 0:
		return &net.OpError{Op: "write", Net: "tcp", Err: os.NewSyscallError("write", s.errno)}
	}
	return nil
}

// SendThenRead runs write (a flush of the request) so that what it writes last is sent by the
// next Read, which then waits for the answer without reading first. A Read of a socket that has
// nothing yet costs a system call that fails with EAGAIN (about 0.6 µs here) before the
// netpoller waits; the engine makes one per request, since the instance has not answered when
// the request is just written. Here the read readiness is reset before the write, inside
// RawConn.Read, so the first readiness the netpoller reports is the answer's, or the
// connection's end: an instance that had closed the connection answers the write with a reset.
func (s *sock) SendThenRead(write func() error) error {
	s.later = true
	err := write()
	s.later = false
	return err
}

// send sends what Write kept and waits until the socket has something to read.
func (s *sock) send() error {
	s.sent, s.werr = 0, 0
	raceReadBuf(s.out)
	raceBeforeWrite()
	err := s.rc.Read(s.sendReadFn)
	out := s.out
	s.out = nil
	switch {
	case err != nil:
		return err
	case s.werr != 0:
		return &net.OpError{Op: "write", Net: "tcp", Err: os.NewSyscallError("write", s.werr)}
	case out != nil: // the socket's buffer was full: the rest goes as a plain write
		_, err = s.Write(out[s.sent:])
	}
	return err
}

// sendRead is send's call inside RawConn.Read: the first call writes (after RawConn.Read has
// reset the read readiness) and asks to wait; the next, once readable, is done.
func (s *sock) sendRead(fd uintptr) bool {
	if s.out == nil {
		return true
	}
	n, e := writeAll(fd, s.out[s.sent:])
	s.sent += n
	switch e {
	case 0:
		s.out = nil
		return false // sent: wait for the answer
	case syscall.EAGAIN:
		return true // the rest is written by send
	}
	s.werr = e
	return true
}
