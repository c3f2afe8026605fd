package gateway

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
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

// engineCase is an exchange and an instance for the engine alone.
func engineCase(addr, method, body string) (*exchange, *instance) {
	in := &instance{key: "k.s.i"}
	in.url.Store(&url.URL{Scheme: "http", Host: addr})
	x := getExchange()
	x.method, x.target, x.host, x.path = method, []byte("/x"), []byte(addr), "/x"
	x.ke, x.inst = &kindEntry{name: "k"}, in
	x.entry.Epoch, x.entry.Shard = 1, "s"
	if body != "" {
		x.bodyBuf = []byte(body)
	}
	return x, in
}

// TestEngineRetriesClosedIdleConn: a pooled connection the server closed is replaced by a fresh
// one, for GET and for a POST whose body is buffered.
func TestEngineRetriesClosedIdleConn(t *testing.T) {
	addr, conns, closed := closingServer(t)
	e := newEngine(Config{ConnectTimeout: time.Second, MaxIdleConnsPerHost: 4})
	defer e.closeIdle(true)
	for i, method := range []string{"GET", "GET", "POST", "GET"} {
		body := ""
		if method == "POST" {
			body = "payload"
		}
		x, in := engineCase(addr, method, body)
		up, err := e.roundTrip(context.Background(), time.Now(), x, in)
		if err != nil {
			t.Fatalf("request %d (%s): %v", i, method, err)
		}
		b, _ := io.ReadAll(up)
		up.release(true)
		if up.resp.Status != 200 || string(b) != "ok" {
			t.Fatalf("request %d: %d %q", i, up.resp.Status, b)
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

// TestEngineContext: a request whose context ends while the instance is silent fails with the
// context's error and its connection is not reused.
func TestEngineContext(t *testing.T) {
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
	e := newEngine(Config{ConnectTimeout: time.Second, MaxIdleConnsPerHost: 4})
	defer e.closeIdle(true)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	x, in := engineCase(ln.Addr().String(), "GET", "")
	x.cancelable = true
	_, err = e.roundTrip(ctx, time.Now(), x, in)
	if err != context.DeadlineExceeded {
		t.Fatalf("err = %v, want context.DeadlineExceeded", err)
	}
	select {
	case conn := <-accepted:
		conn.Close()
	case <-time.After(5 * time.Second):
		t.Fatal("no connection accepted")
	}
	e.mu.Lock()
	idle := len(e.idle)
	e.mu.Unlock()
	if idle != 0 {
		t.Fatal("a connection whose exchange timed out went back to the pool")
	}
}

// TestEngineReleaseOnce: an answer without a body (204) hands its connection back to the pool
// once, however often the exchange is released; a connection pooled twice would be given to
// two requests at the same time.
func TestEngineReleaseOnce(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) }))
	defer srv.Close()
	e := newEngine(Config{ConnectTimeout: time.Second, MaxIdleConnsPerHost: 4})
	defer e.closeIdle(true)
	addr := strings.TrimPrefix(srv.URL, "http://")
	for range 3 {
		x, in := engineCase(addr, "GET", "")
		up, err := e.roundTrip(context.Background(), time.Now(), x, in)
		if err != nil {
			t.Fatal(err)
		}
		if up.resp.Status != http.StatusNoContent || up.left != 0 {
			t.Fatalf("status %d, body left %d", up.resp.Status, up.left)
		}
		up.release(true)
		up.release(true)
		e.mu.Lock()
		n := len(e.idle[addr])
		e.mu.Unlock()
		if n != 1 {
			t.Fatalf("%d idle connections after one exchange, want 1", n)
		}
	}
}
