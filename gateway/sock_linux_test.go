//go:build linux

package gateway

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"
)

// tcpPair returns both ends of a loopback TCP connection.
func tcpPair(t *testing.T) (local, remote net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		accepted <- c
	}()
	remote, err = net.DialTimeout("tcp", ln.Addr().String(), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case local = <-accepted:
	case <-time.After(5 * time.Second):
		t.Fatal("no connection accepted")
	}
	if local == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { local.Close(); remote.Close() })
	return local, remote
}

func pattern(n int, seed byte) []byte {
	p := make([]byte, n)
	for i := range p {
		p[i] = seed + byte(i%251)
	}
	return p
}

func TestSockIsRawForTCPOnly(t *testing.T) {
	c, _ := tcpPair(t)
	if _, ok := ioOf(c).(*sock); !ok {
		t.Fatalf("ioOf(TCP conn) = %T, want *sock", ioOf(c))
	}
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if _, ok := ioOf(a).(*connIO); !ok {
		t.Fatalf("ioOf(pipe) = %T, want *connIO", ioOf(a))
	}
}

// Writes larger than the socket's buffers wait for the reader and arrive whole and in order,
// for Write and for Writev whatever the split.
func TestSockWritesWaitForTheReader(t *testing.T) {
	c, peer := tcpPair(t)
	s := ioOf(c)
	a, b := pattern(3<<20+17, 1), pattern(5<<20+3, 7)
	want := bytes.Join([][]byte{a, b, a, b, b}, nil) // what the writes below send, in order
	got := make(chan []byte, 1)
	go func() {
		_ = peer.SetReadDeadline(time.Now().Add(20 * time.Second))
		p, _ := io.ReadAll(io.LimitReader(peer, int64(len(want))))
		got <- p
	}()
	_ = c.SetWriteDeadline(time.Now().Add(20 * time.Second))
	if n, err := s.Write(a); n != len(a) || err != nil {
		t.Fatalf("Write = %d, %v; want %d", n, err, len(a))
	}
	if n, err := s.Writev(b, a); n != len(a)+len(b) || err != nil {
		t.Fatalf("Writev = %d, %v; want %d", n, err, len(a)+len(b))
	}
	if n, err := s.Writev(b, nil); n != len(b) || err != nil {
		t.Fatalf("Writev(b, nil) = %d, %v", n, err)
	}
	if n, err := s.Writev(nil, b); n != len(b) || err != nil {
		t.Fatalf("Writev(nil, b) = %d, %v", n, err)
	}
	if n, err := s.Writev(nil, nil); n != 0 || err != nil {
		t.Fatalf("Writev(nil, nil) = %d, %v", n, err)
	}
	c.Close()
	p := <-got
	if !bytes.Equal(p, want) {
		t.Fatalf("the peer read %d bytes, want %d in order", len(p), len(want))
	}
}

func TestSockReads(t *testing.T) {
	c, peer := tcpPair(t)
	s := ioOf(c)
	buf := make([]byte, 64)

	// A read waits for data (and for the rest of the test, for a deadline or a close).
	go peer.Write([]byte("hello"))
	n, err := s.Read(buf)
	if err != nil || string(buf[:n]) != "hello" {
		t.Fatalf("Read = %q, %v", buf[:n], err)
	}
	if n, err := s.Read(buf[:0]); n != 0 || err != nil {
		t.Fatalf("Read(empty) = %d, %v", n, err)
	}

	// The connection's deadline ends a wait as a timeout.
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	_, err = s.Read(buf)
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Read past the deadline = %v, want a timeout", err)
	}
	_ = c.SetReadDeadline(time.Time{})

	// The peer's close is EOF, after what it sent.
	peer.Write([]byte("bye"))
	peer.Close()
	n, err = s.Read(buf)
	if err != nil || string(buf[:n]) != "bye" {
		t.Fatalf("Read = %q, %v", buf[:n], err)
	}
	if _, err := s.Read(buf); err != io.EOF {
		t.Fatalf("Read after the peer closed = %v, want EOF", err)
	}
}

// Close ends a read that waits, and a write to a reset connection fails as a net.OpError.
func TestSockCloseAndReset(t *testing.T) {
	c, _ := tcpPair(t)
	s := ioOf(c)
	done := make(chan error, 1)
	go func() {
		_, err := s.Read(make([]byte, 8))
		done <- err
	}()
	c.Close() // the read is waiting or has not started: both end in net.ErrClosed
	select {
	case err := <-done:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Read on a closed conn = %v, want net.ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not end the read")
	}

	c2, peer2 := tcpPair(t)
	peer2.(*net.TCPConn).SetLinger(0)
	peer2.Close() // RST
	s2 := ioOf(c2)
	deadline := time.Now().Add(5 * time.Second)
	var err error
	for err == nil && time.Now().Before(deadline) {
		_, err = s2.Write([]byte("x"))
	}
	var oe *net.OpError
	if !errors.As(err, &oe) || oe.Op != "write" {
		t.Fatalf("Write to a reset conn = %v, want a write OpError", err)
	}
	if _, err := s2.Read(make([]byte, 8)); err == nil {
		t.Fatal("Read of a reset conn: no error")
	}
}

// SendThenRead: the kept write goes out with the next Read, which returns the peer's answer.
func TestSockSendThenRead(t *testing.T) {
	c, peer := tcpPair(t)
	s := ioOf(c).(*sock)
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	_ = peer.SetDeadline(time.Now().Add(10 * time.Second))
	for i, req := range [][]byte{[]byte("ping"), pattern(8<<20, 3)} { // the second fills the socket's buffers
		err := s.SendThenRead(func() error {
			_, err := s.Write(req)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		got := make(chan []byte, 1)
		go func() {
			p := make([]byte, len(req))
			_, _ = io.ReadFull(peer, p)
			got <- p
			peer.Write([]byte("pong"))
		}()
		buf := make([]byte, 16)
		n, err := s.Read(buf)
		if err != nil || string(buf[:n]) != "pong" {
			t.Fatalf("exchange %d: Read = %q, %v; want pong", i, buf[:n], err)
		}
		if p := <-got; !bytes.Equal(p, req) {
			t.Fatalf("exchange %d: the peer read other bytes than were written", i)
		}
	}

	// An answer that does not come ends at the deadline.
	_ = s.SendThenRead(func() error { _, err := s.Write([]byte("ping")); return err })
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	if _, err := s.Read(make([]byte, 8)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Read with no answer = %v, want a timeout", err)
	}
}

// A peer that closed an idle connection before the write: the read that sends the request
// learns it from the peer's reset and does not wait for an answer that cannot come. This is
// the instance that closed a pooled connection; the engine sends once more on a fresh one.
func TestSockSendThenReadToAClosedPeer(t *testing.T) {
	c, peer := tcpPair(t)
	s := ioOf(c).(*sock)
	peer.Close()
	// Let the FIN arrive and be seen before the write, as for an idle pooled connection.
	buf := make([]byte, 8)
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := s.Read(buf); err != io.EOF {
		t.Fatalf("Read after the peer closed = %v, want EOF", err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_ = s.SendThenRead(func() error { _, err := s.Write([]byte("GET / HTTP/1.1\r\n\r\n")); return err })
	_, err := s.Read(buf)
	if err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Read after a write to a closed peer = %v, want the reset (or EOF) at once", err)
	}
}
