package gateway

import (
	"net"
)

// outBuf buffers what the front end writes to a client connection. Small writes are gathered;
// a large one (a body segment) goes out together with what is buffered in one writev, without
// being copied.
type outBuf struct {
	c    net.Conn
	buf  []byte
	bufs net.Buffers
	arr  [2][]byte
}

const outBufSize = 16 << 10

func (o *outBuf) reset(c net.Conn) {
	o.c = c
	if o.buf == nil {
		o.buf = make([]byte, 0, outBufSize)
	}
	o.buf = o.buf[:0]
}

func (o *outBuf) Write(p []byte) (int, error) {
	if len(p) >= 4<<10 {
		o.arr[0], o.arr[1] = o.buf, p
		o.bufs = o.arr[:]
		_, err := o.bufs.WriteTo(o.c)
		o.arr[0], o.arr[1], o.bufs = nil, nil, nil
		o.buf = o.buf[:0]
		return len(p), err
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
			return o.c.Write([]byte(s))
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
	_, err := o.c.Write(o.buf)
	o.buf = o.buf[:0]
	return err
}
