package gateway

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// closingServer answers one request per connection with a keep-alive response and then closes
// the connection, so every reused connection is found closed.
func closingServer(t *testing.T) (addr string, conns *atomic.Int64, closed chan struct{}) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	conns = &atomic.Int64{}
	closed = make(chan struct{}, 16)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns.Add(1)
			go func() {
				defer func() { c.Close(); closed <- struct{}{} }()
				_ = c.SetDeadline(time.Now().Add(5 * time.Second))
				req, err := http.ReadRequest(bufio.NewReader(c))
				if err != nil {
					return
				}
				_, _ = io.Copy(io.Discard, req.Body)
				_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
			}()
		}
	}()
	return ln.Addr().String(), conns, closed
}

// TestH1ClientRetriesClosedIdleConn: a pooled connection the server closed is replaced by a fresh
// one, for GET and for a POST whose body can be rebuilt.
func TestH1ClientRetriesClosedIdleConn(t *testing.T) {
	addr, conns, closed := closingServer(t)
	c := newH1Client(Config{ConnectTimeout: time.Second, MaxIdleConnsPerHost: 4})
	defer c.closeIdle(true)
	for i, method := range []string{"GET", "GET", "POST", "GET"} {
		var body io.Reader
		if method == "POST" {
			body = strings.NewReader("payload")
		}
		req, _ := http.NewRequestWithContext(context.Background(), method, "http://"+addr+"/x", body)
		resp, err := c.RoundTrip(req)
		if err != nil {
			t.Fatalf("request %d (%s): %v", i, method, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || string(b) != "ok" {
			t.Fatalf("request %d: %d %q", i, resp.StatusCode, b)
		}
		select {
		case <-closed:
		case <-time.After(5 * time.Second):
			t.Fatal("server did not close the connection")
		}
	}
	if n := conns.Load(); n != 4 {
		t.Fatalf("server saw %d connections, want 4 (one per request)", n)
	}
}

// TestH1ClientContext: a request whose context ends while the instance is silent fails with the
// context's error and its connection is not reused.
func TestH1ClientContext(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		if c, err := ln.Accept(); err == nil {
			accepted <- c
		}
	}()
	c := newH1Client(Config{ConnectTimeout: time.Second, MaxIdleConnsPerHost: 4})
	defer c.closeIdle(true)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", "http://"+ln.Addr().String()+"/", nil)
	_, err = c.RoundTrip(req)
	if err != context.DeadlineExceeded {
		t.Fatalf("err = %v, want context.DeadlineExceeded", err)
	}
	select {
	case conn := <-accepted:
		conn.Close()
	case <-time.After(5 * time.Second):
		t.Fatal("no connection accepted")
	}
	c.mu.Lock()
	idle := len(c.idle)
	c.mu.Unlock()
	if idle != 0 {
		t.Fatal("a connection whose exchange timed out went back to the pool")
	}
}
