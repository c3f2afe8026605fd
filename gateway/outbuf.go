package gateway

import (
	"io"
	"net"
)

// outBuf buffers what the front end writes to a client connection. Small writes are gathered;
// a large one (a body segment) goes out together with what is buffered in one writev, without
// being copied.
type outBuf struct {
	w   socketIO
	buf []byte
	dl  *writeDeadline // renewed before each write to the socket; nil: none
}

const outBufSize = 16 << 10

func (o *outBuf) reset(w socketIO) {
	o.w, o.dl = w, nil
	if o.buf == nil {
		o.buf = make([]byte, 0, outBufSize)
	}
	o.buf = o.buf[:0]
}

func (o *outBuf) Write(p []byte) (int, error) {
	if len(p) >= 4<<10 {
		o.dl.renew()
		_, err := o.w.Writev(o.buf, p)
		o.buf = o.buf[:0]
		return len(p), o.dl.check(err)
	}
	if len(o.buf)+len(p) > cap(o.buf) {
		if err := o.Flush(); err != nil {
			return 0, err
		}
	}
	o.buf = append(o.buf, p...)
	return len(p), nil
}

func (o *outBuf) WriteString(s string) (int, error) {
	if len(o.buf)+len(s) > cap(o.buf) {
		if err := o.Flush(); err != nil {
			return 0, err
		}
		if len(s) > cap(o.buf) {
			o.dl.renew()
			n, err := o.w.Write([]byte(s))
			return n, o.dl.check(err)
		}
	}
	o.buf = append(o.buf, s...)
	return len(s), nil
}

func (o *outBuf) WriteByte(b byte) error {
	if len(o.buf) == cap(o.buf) {
		if err := o.Flush(); err != nil {
			return err
		}
	}
	o.buf = append(o.buf, b)
	return nil
}

// Flush writes what is buffered.
func (o *outBuf) Flush() error {
	if len(o.buf) == 0 {
		return nil
	}
	o.dl.renew()
	_, err := o.w.Write(o.buf)
	o.buf = o.buf[:0]
	return o.dl.check(err)
}

// socketIO is how the front end and the engine read and write a connection: its socket with
// raw system calls where the system allows (sock_linux.go), else the net.Conn.
type socketIO interface {
	io.Reader
	io.Writer
	// Writev writes a, then b, without copying them together.
	Writev(a, b []byte) (int, error)
	// SendThenRead runs write so that what it writes last may be sent by the next Read, which
	// then waits for the answer without a read that finds nothing (sock_linux.go); elsewhere
	// it just runs write.
	SendThenRead(write func() error) error
}

// connIO reads and writes through a net.Conn (TLS connections, other systems).
type connIO struct {
	net.Conn
	arr [2][]byte
}

func (c *connIO) Writev(a, b []byte) (int, error) {
	c.arr = [2][]byte{a, b}
	bufs := net.Buffers(c.arr[:])
	n, err := bufs.WriteTo(c.Conn) // writev where the conn has it
	c.arr = [2][]byte{}
	return int(n), err
}

func (c *connIO) SendThenRead(write func() error) error { return write() }
