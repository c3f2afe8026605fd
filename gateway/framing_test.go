package gateway

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// TestFraming covers, through both front ends, what a proxy must get right about bodies and
// connections: Expect: 100-continue, HEAD, 204 and 304 answers on a kept-alive connection,
// chunked request bodies below and above the replay limit, responses streamed as they come,
// and protocol upgrades (WebSocket) joined end to end.
func TestFraming(t *testing.T) {
	t.Run("front end", func(t *testing.T) { testFraming(t, Config{MaxReplayBody: 1024}) })
	t.Run("net/http front end", func(t *testing.T) { testFraming(t, Config{MaxReplayBody: 1024, stdFrontEnd: true}) })
}

func testFraming(t *testing.T, cfg Config) {
	var a *backend
	e := newEnv(t, cfg, nil, func(e *env) {
		a = newBackend(t, "aggregate", "aggregate-1", "i1")
		e.register(a, "", 10, aggRoute)
		e.place("aggregate", "t1", "aggregate-1")
	})
	addr := strings.TrimPrefix(e.url, "http://")

	t.Run("Expect: 100-continue", func(t *testing.T) {
		tr := &http.Transport{ExpectContinueTimeout: 5 * time.Second}
		defer tr.CloseIdleConnections()
		req, _ := http.NewRequest("POST", e.url+"/agg/x", strings.NewReader("continued"))
		req.Header.Set(tmhttp.HeaderTenant, "t1")
		req.Header.Set("Expect", "100-continue")
		resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		_, bodies := a.requests()
		if resp.StatusCode != 200 || bodies[len(bodies)-1] != "continued" {
			t.Fatalf("status %d, shard got %q", resp.StatusCode, bodies[len(bodies)-1])
		}
	})

	t.Run("Expect: 100-continue refused before the body", func(t *testing.T) {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		_, _ = io.WriteString(c, "POST /nowhere HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, &http.Request{Method: "POST"})
		if err != nil || resp.StatusCode != http.StatusNotFound {
			t.Fatalf("answer %v %v, want 404 (no 100 Continue)", resp, err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		if rest, _ := io.ReadAll(br); strings.Contains(string(rest), "100 Continue") {
			t.Fatalf("100 Continue after the final answer: %q", rest)
		}
	})

	t.Run("HTTP/1.0 keep-alive", func(t *testing.T) {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		br := bufio.NewReader(c)
		for i := range 2 {
			_, _ = io.WriteString(c, "GET /agg/x HTTP/1.0\r\nx-tenant-id: t1\r\nConnection: keep-alive\r\n\r\n")
			resp, err := http.ReadResponse(br, &http.Request{Method: "GET"})
			if err != nil {
				t.Fatalf("request %d: %v", i, err)
			}
			body, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != 200 || string(body) != a.id.Key() || resp.Close {
				t.Fatalf("request %d: %d %q close %v", i, resp.StatusCode, body, resp.Close)
			}
		}
	})

	t.Run("HEAD, 204 and 304 keep the connection in step", func(t *testing.T) {
		a.setHandler(func(w http.ResponseWriter, r *http.Request) {
			switch r.URL.Path {
			case "/agg/204":
				w.WriteHeader(http.StatusNoContent)
			case "/agg/304":
				w.Header().Set("ETag", `"v1"`)
				w.WriteHeader(http.StatusNotModified)
			default:
				w.Header().Set("Content-Length", "5")
				_, _ = io.WriteString(w, "hello")
			}
		})
		defer a.setHandler(nil)
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		br := bufio.NewReader(c)
		for _, step := range []struct {
			method, path string
			status       int
			body, cl     string
		}{{"HEAD", "/agg/h", 200, "", "5"}, {"GET", "/agg/204", 204, "", ""}, {"GET", "/agg/304", 304, "", ""}, {"GET", "/agg/g", 200, "hello", "5"}} {
			_, _ = io.WriteString(c, step.method+" "+step.path+" HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\n\r\n")
			resp, err := http.ReadResponse(br, &http.Request{Method: step.method})
			if err != nil {
				t.Fatalf("%s %s: %v", step.method, step.path, err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != step.status || string(body) != step.body || resp.Header.Get("Content-Length") != step.cl {
				t.Fatalf("%s %s: %d %q Content-Length %q", step.method, step.path, resp.StatusCode, body, resp.Header.Get("Content-Length"))
			}
		}
	})

	t.Run("chunked request bodies", func(t *testing.T) {
		for _, size := range []int{100, 5000} { // below and above the replay limit (1 KiB)
			want := strings.Repeat("b", size)
			req, _ := http.NewRequest("POST", e.url+"/agg/x", io.MultiReader(strings.NewReader(want))) // unknown length: chunked
			req.Header.Set(tmhttp.HeaderTenant, "t1")
			resp, err := e.client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			reqs, bodies := a.requests()
			if resp.StatusCode != 200 || bodies[len(bodies)-1] != want || len(reqs[len(reqs)-1].TransferEncoding)+int(max(0, reqs[len(reqs)-1].ContentLength)) == 0 {
				t.Fatalf("size %d: status %d, shard got %d bytes", size, resp.StatusCode, len(bodies[len(bodies)-1]))
			}
		}
	})

	t.Run("responses stream as they come", func(t *testing.T) {
		more := make(chan struct{})
		a.setHandler(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.WriteString(w, "first;")
			http.NewResponseController(w).Flush()
			select {
			case <-more:
			case <-time.After(10 * time.Second):
			}
			_, _ = io.WriteString(w, "second")
		})
		defer a.setHandler(nil)
		req, _ := http.NewRequest("GET", e.url+"/agg/events", nil)
		req.Header.Set(tmhttp.HeaderTenant, "t1")
		resp, err := e.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		buf := make([]byte, 6)
		if _, err := io.ReadFull(resp.Body, buf); err != nil || string(buf) != "first;" {
			t.Fatalf("first part %q before the shard finished: %v", buf, err)
		}
		close(more)
		rest, _ := io.ReadAll(resp.Body)
		if string(rest) != "second" {
			t.Fatalf("rest %q", rest)
		}
	})

	t.Run("upgrade", func(t *testing.T) {
		a.setHandler(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("Upgrade") != "echo" || r.Header.Get(tmhttp.HeaderShard) != "aggregate-1" {
				w.WriteHeader(http.StatusBadRequest)
				return
			}
			c, brw, err := http.NewResponseController(w).Hijack()
			if err != nil {
				return
			}
			defer c.Close()
			_, _ = io.WriteString(c, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n")
			_, _ = io.Copy(c, brw) // echo until the client closes
		})
		defer a.setHandler(nil)
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		_, _ = io.WriteString(c, "GET /agg/ws HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, &http.Request{Method: "GET"})
		if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
			t.Fatalf("upgrade: %v %v", resp, err)
		}
		for _, msg := range []string{"ping", "pong!"} {
			_, _ = io.WriteString(c, msg)
			got := make([]byte, len(msg))
			if _, err := io.ReadFull(br, got); err != nil || string(got) != msg {
				t.Fatalf("echo %q: %q %v", msg, got, err)
			}
		}
	})
}

// TestClientTimeouts: the own front end closes a connection whose head stops half way after
// ReadHeaderTimeout, and an idle one after IdleTimeout; a head sent in pieces within the
// timeout is served, and so is a request on a connection that has been idle a while (its idle
// deadline is renewed coarsely, so this checks the renewal too).
func TestClientTimeouts(t *testing.T) {
	var a *backend
	e := newEnv(t, Config{ReadHeaderTimeout: 300 * time.Millisecond, IdleTimeout: 800 * time.Millisecond}, nil, func(e *env) {
		a = newBackend(t, "aggregate", "aggregate-1", "i1")
		e.register(a, "", 10, aggRoute)
		e.place("aggregate", "t1", "aggregate-1")
	})
	addr := strings.TrimPrefix(e.url, "http://")
	dial := func(t *testing.T) (net.Conn, *bufio.Reader) {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		return c, bufio.NewReader(c)
	}
	get := func(t *testing.T, c net.Conn, br *bufio.Reader, parts ...string) {
		t.Helper()
		for i, p := range parts {
			if i > 0 {
				time.Sleep(100 * time.Millisecond) // a slow client, within the head's timeout
			}
			if _, err := io.WriteString(c, p); err != nil {
				t.Fatal(err)
			}
		}
		resp, err := http.ReadResponse(br, &http.Request{Method: "GET"})
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("status %d, want 200", resp.StatusCode)
		}
	}
	// closedWithin: the gateway closes the connection, after at least min and well before 10 s.
	closedWithin := func(t *testing.T, br *bufio.Reader, start time.Time, min time.Duration) {
		t.Helper()
		if n, err := br.Read(make([]byte, 1)); err != io.EOF {
			t.Fatalf("read %d bytes, %v; want the connection closed", n, err)
		}
		if took := time.Since(start); took < min {
			t.Fatalf("closed after %v, before the timeout of %v", took, min)
		}
	}

	t.Run("head sent in pieces", func(t *testing.T) {
		c, br := dial(t)
		get(t, c, br, "GET /agg/x HTTP/1.1\r\nHost: g\r\n", "x-tenant-id: t1\r\n", "\r\n")
	})
	t.Run("head stalls", func(t *testing.T) {
		c, br := dial(t)
		get(t, c, br, "GET /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\n\r\n")
		start := time.Now()
		_, _ = io.WriteString(c, "GET /agg/x HTTP/1.1\r\nHost: g\r\n")
		closedWithin(t, br, start, 300*time.Millisecond)
	})
	t.Run("idle", func(t *testing.T) {
		c, br := dial(t)
		get(t, c, br, "GET /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\n\r\n")
		time.Sleep(400 * time.Millisecond) // idle for half the timeout: the next request renews it
		get(t, c, br, "GET /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\n\r\n")
		start := time.Now()
		closedWithin(t, br, start, 700*time.Millisecond) // IdleTimeout less the renewal's eighth
	})
}
