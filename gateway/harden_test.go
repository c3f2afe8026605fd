package gateway

// Attacks from the security review (issue 34), each made against a real gateway on 127.0.0.1
// with an embedded NATS server; docs/security.md's threat model names each test.

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// rawClient is one client connection that writes request heads as given.
type rawClient struct {
	t  testing.TB
	c  net.Conn
	br *bufio.Reader
}

func dialRaw(t testing.TB, url string) *rawClient {
	t.Helper()
	c, err := net.DialTimeout("tcp", strings.TrimPrefix(url, "http://"), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &rawClient{t: t, c: c, br: bufio.NewReaderSize(c, 64<<10)}
}

// do sends req and reads the answer (its body read and dropped), within 10 s.
func (r *rawClient) do(req string) *http.Response {
	r.t.Helper()
	_ = r.c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(r.c, req); err != nil {
		r.t.Fatal(err)
	}
	resp, err := http.ReadResponse(r.br, &http.Request{Method: "GET"})
	if err != nil {
		r.t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp
}

// heapInUse is the live heap after a collection.
func heapInUse() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// TestAttackTenantHeaderMemory (item 1): 4,000 requests, each with a new 32 KiB x-tenant-id,
// used to grow the gateway by about 130 MB (every id was interned before it was checked, and
// kept). Each is answered 400 and the heap stays where it was.
func TestAttackTenantHeaderMemory(t *testing.T) {
	e := newEnv(t, Config{}, nil, nil)
	c := dialRaw(t, e.url)
	c.do("GET /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: warm\r\n\r\n")
	before := heapInUse()
	const n, size = 4000, 32 << 10
	pad := strings.Repeat("a", size-8)
	for i := range n {
		resp := c.do(fmt.Sprintf("GET /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: %08d%s\r\n\r\n", i, pad))
		if resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("request %d: status %d, want 400", i, resp.StatusCode)
		}
	}
	after := heapInUse()
	grew := int64(after) - int64(before)
	t.Logf("heap in use before %d MB, after %d unique %d KiB tenant ids %d MB (grew %+.1f MB)",
		before>>20, n, size>>10, after>>20, float64(grew)/(1<<20))
	if grew > 16<<20 {
		t.Fatalf("the heap grew by %.1f MB with %d invalid tenant ids; it must not keep them", float64(grew)/(1<<20), n)
	}
}

// slowEnv is a gateway with an aggregate instance that answers what handler says, tenant t1
// placed on it.
func slowEnv(t *testing.T, cfg Config, handler http.HandlerFunc) (*env, *backend) {
	t.Helper()
	var a *backend
	e := newEnv(t, cfg, nil, func(e *env) {
		a = newBackend(t, "aggregate", "aggregate-1", "i1")
		if handler != nil {
			a.setHandler(handler)
		}
		e.register(a, "", 1000, aggRoute)
		e.place("aggregate", "t1", "aggregate-1")
	})
	return e, a
}

// closedWithin waits until the gateway closes c (a read ends with EOF or a reset), within d.
func closedWithin(t *testing.T, c *rawClient, d time.Duration) {
	t.Helper()
	_ = c.c.SetReadDeadline(time.Now().Add(d))
	_, err := io.Copy(io.Discard, c.br)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("the connection is still open after %v", d)
	}
}

// servesOthers checks that the gateway still answers another client at once.
func servesOthers(t *testing.T, e *env) {
	t.Helper()
	resp, _ := e.do("GET", "/agg/other", "t1", "", nil)
	if resp.StatusCode != 200 {
		t.Fatalf("another client got %d while the attack ran", resp.StatusCode)
	}
}

// TestAttackSlowBody (item 2): a body that stops arriving, and one that trickles a byte at a
// time, used to hold their connection, goroutine and buffer for good (the head's read deadline
// was dropped once a body began). Both front ends now answer 408 within the body's bounds and
// close the connection, while serving other clients.
func TestAttackSlowBody(t *testing.T) {
	for _, front := range []struct {
		name string
		std  bool
	}{{"front end", false}, {"net/http front end", true}} {
		t.Run(front.name, func(t *testing.T) {
			e, a := slowEnv(t, Config{BodyReadTimeout: 500 * time.Millisecond, MinBodyRate: 100, stdFrontEnd: front.std}, nil)
			t.Run("stops", func(t *testing.T) {
				c := dialRaw(t, e.url)
				_, _ = io.WriteString(c.c, "POST /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nContent-Length: 100000\r\n\r\n0123456789")
				servesOthers(t, e)
				_ = c.c.SetReadDeadline(time.Now().Add(5 * time.Second))
				resp, err := http.ReadResponse(c.br, nil)
				if err != nil {
					t.Fatalf("no answer to a stalled body within 5 s: %v", err)
				}
				resp.Body.Close()
				if resp.StatusCode != http.StatusRequestTimeout {
					t.Fatalf("status %d, want 408", resp.StatusCode)
				}
				closedWithin(t, c, 5*time.Second)
			})
			t.Run("trickles", func(t *testing.T) {
				c := dialRaw(t, e.url)
				_, _ = io.WriteString(c.c, "POST /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nTransfer-Encoding: chunked\r\n\r\n")
				stop := make(chan struct{})
				go func() { // a byte every 100 ms: 10 B/s, a tenth of MinBodyRate
					tick := time.NewTicker(100 * time.Millisecond)
					defer tick.Stop()
					for {
						select {
						case <-tick.C:
							if _, err := io.WriteString(c.c, "1\r\nx\r\n"); err != nil {
								return
							}
						case <-stop:
							return
						}
					}
				}()
				defer close(stop)
				closedWithin(t, c, 10*time.Second)
			})
			if reqs, _ := a.requests(); len(reqs) != 2 { // the two servesOthers requests... and no slow body
				for _, r := range reqs {
					if r.URL.Path == "/agg/x" {
						t.Fatalf("a slow body reached the instance")
					}
				}
			}
		})
	}
}

// TestAttackBodyMemory (item 2): 200 connections that announce a 1 MiB body and send one byte
// used to make the gateway allocate 1 MiB each before any arrived (200 MB); its buffer now
// grows as the bytes come.
func TestAttackBodyMemory(t *testing.T) {
	e, _ := slowEnv(t, Config{BodyReadTimeout: 20 * time.Second}, nil)
	before := heapInUse()
	const n = 200
	for range n {
		c := dialRaw(t, e.url)
		_ = c.c.SetDeadline(time.Now().Add(10 * time.Second))
		_, _ = io.WriteString(c.c, "POST /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nContent-Length: 1048576\r\nExpect: 100-continue\r\n\r\n")
		// 100 Continue: the gateway has begun reading the body (its buffer is made by now).
		if line, err := c.br.ReadString('\n'); err != nil || !strings.HasPrefix(line, "HTTP/1.1 100") {
			t.Fatalf("want 100 Continue, got %q %v", line, err)
		}
		_, _ = io.WriteString(c.c, "x")
	}
	after := heapInUse()
	grew := int64(after) - int64(before)
	t.Logf("heap in use before %d MB, with %d bodies of 1 MiB announced and 1 byte sent %d MB (grew %+.1f MB)",
		before>>20, n, after>>20, float64(grew)/(1<<20))
	if grew > 32<<20 {
		t.Fatalf("the heap grew by %.1f MB for %d bodies that never came", float64(grew)/(1<<20), n)
	}
}

// TestAttackSlowRead (item 2): a client that asks for a large answer and never reads it used to
// hold the gateway's goroutine and the instance's connection for good (no write deadline):
// the instance's handler stayed blocked in its write. Now the gateway cuts the client after
// WriteTimeout and lets the instance go, while serving other clients.
func TestAttackSlowRead(t *testing.T) {
	released := make(chan struct{}, 1)
	big := bytes.Repeat([]byte("x"), 1<<20)
	e, _ := slowEnv(t, Config{WriteTimeout: 500 * time.Millisecond}, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/agg/big" {
			_, _ = io.WriteString(w, "ok")
			return
		}
		for range 64 { // 64 MiB
			if _, err := w.Write(big); err != nil {
				released <- struct{}{}
				return
			}
		}
	})
	d := net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
		return c.Control(func(fd uintptr) { _ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
	}}
	c, err := d.Dial("tcp", strings.TrimPrefix(e.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, _ = io.WriteString(c, "GET /agg/big HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\n\r\n") // and never read
	servesOthers(t, e)
	select {
	case <-released:
	case <-time.After(15 * time.Second):
		t.Fatal("the instance is still blocked writing to a client that does not read, after 15 s")
	}
	servesOthers(t, e)
}

// TestAttackConnectionFlood (item 2): connections over MaxConnsPerIP from one address, or over
// MaxConns, are closed as soon as they are accepted (they used to be kept, each with its
// goroutine, until the head's timeout); another address is still served.
func TestAttackConnectionFlood(t *testing.T) {
	e, _ := slowEnv(t, Config{MaxConnsPerIP: 20, MaxConns: 30}, nil)
	addr := strings.TrimPrefix(e.url, "http://")
	dialFrom := func(src string) net.Conn {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 5 * time.Second}
		c, err := d.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	// served: a request on c is answered, so the gateway holds c.
	served := func(c net.Conn) {
		t.Helper()
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		_, _ = io.WriteString(c, "GET /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\n\r\n")
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("a connection within the bounds: %v %v", resp, err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
	}
	for range 20 {
		served(dialFrom("127.0.0.1"))
	}
	over := dialFrom("127.0.0.1")
	_ = over.SetReadDeadline(time.Now().Add(3 * time.Second))
	if n, err := over.Read(make([]byte, 1)); err == nil || isTimeout(err) {
		t.Fatalf("the 21st connection from one address: read %d, %v; want it closed", n, err)
	}
	// Another address is served, until the gateway holds MaxConns.
	for range 10 {
		served(dialFrom("127.0.0.2"))
	}
	full := dialFrom("127.0.0.4")
	_ = full.SetReadDeadline(time.Now().Add(3 * time.Second))
	if n, err := full.Read(make([]byte, 1)); err == nil || isTimeout(err) {
		t.Fatalf("a connection over MaxConns: read %d, %v; want it closed", n, err)
	}
}

// TestAttackIdleTunnel (low): an upgraded connection (WebSocket) on which neither side sends a
// byte used to stay open for good, holding two connections and two goroutines; it is closed
// after TunnelIdleTimeout, on both sides. A tunnel that carries bytes one way only stays open.
func TestAttackIdleTunnel(t *testing.T) {
	ended := make(chan string, 4)
	e, _ := slowEnv(t, Config{TunnelIdleTimeout: 400 * time.Millisecond}, func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Upgrade") == "" {
			_, _ = io.WriteString(w, "ok")
			return
		}
		c, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = io.WriteString(c, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n")
		if r.URL.Path == "/agg/ticker" { // sends a byte every 100 ms for a second, never reads
			for range 10 {
				time.Sleep(100 * time.Millisecond) // the stream's own pace
				if _, err := c.Write([]byte{'.'}); err != nil {
					ended <- "ticker cut"
					return
				}
			}
			ended <- "ticker done"
			return
		}
		_, _ = io.Copy(io.Discard, brw) // silent: until the gateway closes
		ended <- "silent closed"
	})
	upgrade := func(path string) *rawClient {
		c := dialRaw(t, e.url)
		_ = c.c.SetDeadline(time.Now().Add(5 * time.Second))
		_, _ = io.WriteString(c.c, "GET "+path+" HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
		resp, err := http.ReadResponse(c.br, nil)
		if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
			t.Fatalf("upgrade: %v %v", resp, err)
		}
		return c
	}
	silent := upgrade("/agg/silent")
	closedWithin(t, silent, 5*time.Second)
	select {
	case what := <-ended:
		if what != "silent closed" {
			t.Fatalf("got %q", what)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the instance's side of an idle tunnel is still open after 5 s")
	}
	ticker := upgrade("/agg/ticker")
	_ = ticker.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, _ := io.ReadAll(ticker.br)
	if len(got) != 10 {
		t.Fatalf("a one-way stream was cut after %d bytes", len(got))
	}
	if what := <-ended; what != "ticker done" {
		t.Fatalf("got %q", what)
	}
}

// placed counts the kind's placements in NATS.
func placed(t *testing.T, e *env, kind string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ps, _, err := e.st.Placements(kind).List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return len(ps)
}

// getFrom sends GET path for tenant from the local address src and returns the status.
func getFrom(t *testing.T, e *env, src, path, tenant string) int {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 5 * time.Second}
	c, err := d.Dial("tcp", strings.TrimPrefix(e.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	rc := &rawClient{t: t, c: c, br: bufio.NewReader(c)}
	return rc.do("GET " + path + " HTTP/1.1\r\nHost: g\r\nx-tenant-id: " + tenant + "\r\n\r\n").StatusCode
}

// TestAttackPlacementByAnyone (item 3): with the default unplaced rule, one client naming 100
// made-up tenants used to get 100 placements (and 100 audit entries), and could go on until
// every shard was full. Now one client address gets its burst and then 429, another address
// its own, and the kind stops at its cap; with identity at the edge, a request without a
// verified token places nothing at all.
func TestAttackPlacementByAnyone(t *testing.T) {
	t.Run("rates", func(t *testing.T) {
		e, _ := slowEnv(t, Config{Assign: AssignLimits{PerClient: 0.01, PerClientBurst: 10, PerKind: 0.01, PerKindBurst: 15}}, nil)
		for i := range 100 {
			if code := getFrom(t, e, "127.0.0.1", "/agg/x", fmt.Sprintf("made-up-%d", i)); code != 200 && code != http.StatusTooManyRequests {
				t.Fatalf("status %d", code)
			}
		}
		if n := placed(t, e, "aggregate"); n != 1+10 { // t1 and the client's burst
			t.Fatalf("one client address placed %d made-up tenants, want its burst of 10", n-1)
		}
		if code := getFrom(t, e, "127.0.0.1", "/agg/x", "t1"); code != 200 {
			t.Fatalf("a placed tenant of the same client: status %d", code)
		}
		// A tenant placed a moment ago, which the gateway's view may not hold yet (or ever, cut
		// off from the bucket's stream), is not a new one: the same client is served once the
		// gateway's budget for reads of such placements (spent by the flood above, which made
		// each refused made-up tenant one) has refilled.
		eventually(t, 5*time.Second, "the unseen reads' budget refilled", func() bool { return e.gw.unseen.TokensAt(time.Now()) >= 20 })
		for i := range 20 {
			tenant := fmt.Sprintf("placed-%d", i)
			e.place("aggregate", tenant, "aggregate-1")
			if code := getFrom(t, e, "127.0.0.1", "/agg/x", tenant); code != 200 {
				t.Fatalf("a tenant placed while the client had no assignments left: status %d", code)
			}
		}
		for i := range 100 {
			getFrom(t, e, "127.0.0.2", "/agg/x", fmt.Sprintf("other-%d", i))
		}
		if n := placed(t, e, "aggregate"); n != 1+20+15 { // t1, placed-*, and the kind's burst of 15
			t.Fatalf("two client addresses placed %d made-up tenants, want the kind's burst of 15", n-1)
		}
	})
	t.Run("cap", func(t *testing.T) {
		e, _ := slowEnv(t, Config{Assign: AssignLimits{PerClient: -1, PerKind: -1, MaxPlacements: 6}}, nil)
		ke := e.gw.reg.snap.Load().kinds["aggregate"]
		for i := range 20 {
			tenant := fmt.Sprintf("made-up-%d", i)
			code := getFrom(t, e, "127.0.0.1", "/agg/x", tenant)
			if code == 200 { // the next request's count must include it
				eventually(t, 5*time.Second, tenant+" in the gateway's view", func() bool { _, ok := ke.lookup(tenant); return ok })
			}
		}
		if n := placed(t, e, "aggregate"); n != 6 {
			t.Fatalf("the kind holds %d placements, want its cap of 6", n)
		}
	})
	t.Run("edge identity", func(t *testing.T) {
		v, _ := testVerifier(t)
		e, _ := slowEnv(t, Config{Auth: v, Assign: AssignLimits{PerClient: -1, PerKind: -1}}, nil)
		for i := range 50 {
			if code := getFrom(t, e, "127.0.0.1", "/agg/x", fmt.Sprintf("made-up-%d", i)); code != http.StatusUnauthorized {
				t.Fatalf("status %d, want 401", code)
			}
		}
		if n := placed(t, e, "aggregate"); n != 1 {
			t.Fatalf("requests without a token placed %d tenants", n-1)
		}
	})
}

// A client's burst of requests for one new tenant is one assignment: the requests that arrive
// while it is under way wait for it and take none of the client's budget (16 concurrent
// requests for a new tenant used to take 16 of a 50-tenant burst, and a page's parallel calls
// could be refused 429 for a single tenant).
func TestConcurrentRequestsForANewTenantAssignOnce(t *testing.T) {
	e, _ := slowEnv(t, Config{Assign: AssignLimits{PerClient: 0.001, PerClientBurst: 2, PerKind: -1}}, nil)
	// An assignment of "burst" under way, finished by the test once the requests wait on it.
	c := &assignCall{done: make(chan struct{})}
	k := holdKey{"aggregate", "burst"}
	e.gw.assignMu.Lock()
	e.gw.assigning[k] = c
	e.gw.assignMu.Unlock()
	codes := make(chan int, 5)
	for range 5 {
		go func() { codes <- getFrom(t, e, "127.0.0.1", "/agg/x", "burst") }()
	}
	eventually(t, 10*time.Second, "five requests waiting on the assignment", func() bool {
		return testutil.ToFloat64(e.gw.metrics.assignJoined.WithLabelValues("aggregate")) >= 5
	})
	c.entry = placement.Entry{Shard: "aggregate-1", Epoch: 1}
	e.gw.assignMu.Lock()
	delete(e.gw.assigning, k)
	e.gw.assignMu.Unlock()
	close(c.done)
	for range 5 {
		if code := <-codes; code != http.StatusOK {
			t.Fatalf("a request waiting on the tenant's assignment: status %d", code)
		}
	}
	// The client's burst of two is whole: two more new tenants are placed, the third refused.
	for i, want := range []int{http.StatusOK, http.StatusOK, http.StatusTooManyRequests} {
		if code := getFrom(t, e, "127.0.0.1", "/agg/x", fmt.Sprintf("new-%d", i)); code != want {
			t.Fatalf("new tenant %d: status %d, want %d", i, code, want)
		}
	}
}

// TestAssignmentStandsUntilTheViewHasIt: an assignment that ended answers for its tenant until
// the gateway's view applies the placement, so requests in that gap join it instead of
// spending the client's budget on a second one; the sweep forgets it once the view has the
// tenant, and a finished assignment older than assignedKeep no longer stands.
func TestAssignmentStandsUntilTheViewHasIt(t *testing.T) {
	e, _ := slowEnv(t, Config{Assign: AssignLimits{PerClient: 0.001, PerClientBurst: 2, PerKind: -1}}, nil)
	if code := getFrom(t, e, "127.0.0.1", "/agg/x", "fresh"); code != http.StatusOK {
		t.Fatalf("a new tenant's first request: status %d", code)
	}
	c := e.gw.assignUnderWay("aggregate", "fresh")
	if c == nil {
		t.Fatal("the ended assignment was forgotten before the view applied it")
	}
	if c.err != nil || c.entry.Shard != "aggregate-1" {
		t.Fatalf("the assignment kept: %+v, %v", c.entry, c.err)
	}
	eventually(t, 10*time.Second, "the view to apply the assignment", func() bool {
		_, ok := e.gw.reg.snap.Load().kinds["aggregate"].lookup("fresh")
		return ok
	})
	e.gw.sweepAssigned(e.gw.reg.snap.Load(), time.Now())
	if e.gw.assignUnderWay("aggregate", "fresh") != nil {
		t.Fatal("the sweep kept an assignment the view has")
	}
	// One that ended longer ago than assignedKeep stands for nothing, swept or not.
	old := &assignCall{done: make(chan struct{}), entry: placement.Entry{Shard: "aggregate-1", Epoch: 1},
		ended: time.Now().Add(-assignedKeep - time.Second)}
	close(old.done)
	e.gw.assignMu.Lock()
	e.gw.assigning[holdKey{"aggregate", "gone"}] = old
	e.gw.assignMu.Unlock()
	if e.gw.assignUnderWay("aggregate", "gone") != nil {
		t.Fatal("an assignment older than assignedKeep still stands")
	}
}

// lastRequest is the last request the backend received (nil if none).
func lastRequest(b *backend) *http.Request {
	reqs, _ := b.requests()
	if len(reqs) == 0 {
		return nil
	}
	return reqs[len(reqs)-1]
}

// TestAttackSubjectInjection (item 7): a token whose sub holds CR LF used to write its own
// header fields into the request the shard receives (x-tm-subject is written from the claim).
// Such a token is now refused 401 and nothing reaches the shard.
func TestAttackSubjectInjection(t *testing.T) {
	v, sign := testVerifier(t)
	e, a := slowEnv(t, Config{Auth: v}, nil)
	tok := sign(jwt.MapClaims{"sub": "user-7\r\nX-Injected: yes\r\nX-Tm-Epoch: 99", "tenant_id": "t1"})
	resp, body := e.do("GET", "/agg/x", "t1", "", map[string]string{"Authorization": "Bearer " + tok})
	if r := lastRequest(a); r != nil && r.Header.Get("X-Injected") != "" {
		t.Fatalf("the token's sub wrote fields into the shard's request: %v", r.Header)
	}
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("status %d (%s), want 401", resp.StatusCode, body)
	}
}

// TestAttackUnderscoreHeaders (item 8): x_tenant_id and X_Tm_Subject passed the x-tm-* strip and
// reached the shard, where CGI, WSGI and PHP read them as HTTP_X_TENANT_ID and
// HTTP_X_TM_SUBJECT: a client could name another tenant or subject to an application behind the
// sidecar. Fields with an underscore in their name are dropped, as nginx does.
func TestAttackUnderscoreHeaders(t *testing.T) {
	for _, std := range []bool{false, true} {
		e, a := slowEnv(t, Config{stdFrontEnd: std}, nil)
		resp, _ := e.do("GET", "/agg/x", "t1", "", map[string]string{"x_tenant_id": "victim", "X_Tm_Subject": "admin", "X_Tm_Epoch": "99"})
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		for k := range lastRequest(a).Header {
			if strings.Contains(k, "_") {
				t.Fatalf("the shard received %s (std front end %v)", k, std)
			}
		}
	}
}

// TestAttackForwardedBy (low): a client's X-Forwarded-By reached the shard, where shardkit's
// forward mode reads it as its loop guard and refuses the request (421, 508): a client could
// make any forwarded request fail. The gateway drops it.
func TestAttackForwardedBy(t *testing.T) {
	e, a := slowEnv(t, Config{}, nil)
	e.do("GET", "/agg/x", "t1", "", map[string]string{"X-Forwarded-By": "aggregate.aggregate-1.i1"})
	if got := lastRequest(a).Header.Get("X-Forwarded-By"); got != "" {
		t.Fatalf("the shard received X-Forwarded-By %q from the client", got)
	}
}

// TestAttackConnectionNamesTenant (low): Connection: x-tenant-id made the gateway drop the
// tenant on the way, after admitting the request for it, so the instance got a request with
// no tenant. It is refused 400 and never forwarded.
func TestAttackConnectionNamesTenant(t *testing.T) {
	e, a := slowEnv(t, Config{}, nil)
	c := dialRaw(t, e.url)
	resp := c.do("GET /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nConnection: keep-alive, x-tenant-id\r\n\r\n")
	if r := lastRequest(a); r != nil {
		t.Fatalf("forwarded with x-tenant-id %q", r.Header.Get("X-Tenant-Id"))
	}
	if resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("status %d, want 400", resp.StatusCode)
	}
}

// TestAttackAuthorizationToShard (low): with identity at the edge, the user's bearer token went
// on to every shard, where any instance could keep and replay it. Only the kinds named in
// ForwardAuthorization receive it now.
func TestAttackAuthorizationToShard(t *testing.T) {
	v, sign := testVerifier(t)
	tok := "Bearer " + sign(jwt.MapClaims{"sub": "user-7", "tenant_id": "t1"})
	for _, fwd := range []bool{false, true} {
		cfg := Config{Auth: v}
		if fwd {
			cfg.ForwardAuthorization = []string{"aggregate"}
		}
		e, a := slowEnv(t, cfg, nil)
		if resp, _ := e.do("GET", "/agg/x", "t1", "", map[string]string{"Authorization": tok}); resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		if got := lastRequest(a).Header.Get("Authorization"); (got != "") != fwd {
			t.Fatalf("forward %v: the shard received Authorization %q", fwd, got)
		}
	}
}

// TestAttackBadTokenFlood (low): each token that fails costs the gateway a signature check, so
// a client sending made-up tokens could keep its processors busy. A client whose tokens keep
// failing gets 429 without a check, while a verified tenant goes on being served.
func TestAttackBadTokenFlood(t *testing.T) {
	v, sign := testVerifier(t)
	_, other := testVerifier(t) // another identity provider's key: the signature fails
	e, _ := slowEnv(t, Config{Auth: v, FailedTokens: 0.01, FailedTokensBurst: 20}, nil)
	good := "Bearer " + sign(jwt.MapClaims{"sub": "user-7", "tenant_id": "t1"})
	if resp, _ := e.do("GET", "/agg/x", "t1", "", map[string]string{"Authorization": good}); resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	checked := 0
	for i := range 300 {
		bad := "Bearer " + other(jwt.MapClaims{"sub": "x", "tenant_id": "t1", "jti": fmt.Sprint(i)})
		resp, _ := e.do("GET", "/agg/x", "t1", "", map[string]string{"Authorization": bad})
		switch resp.StatusCode {
		case http.StatusUnauthorized:
			checked++
		case http.StatusTooManyRequests:
		default:
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	t.Logf("of 300 tokens that do not verify, %d were checked", checked)
	if checked > 21 {
		t.Fatalf("%d of 300 bad tokens were checked, want at most the burst of 20", checked)
	}
	if resp, _ := e.do("GET", "/agg/x", "t1", "", map[string]string{"Authorization": good}); resp.StatusCode != 200 {
		t.Fatalf("a verified tenant of the same client: status %d", resp.StatusCode)
	}
}

// TestAttackRoutePrefixBoundary (low): a route's prefix matched inside a path segment, so
// /jobs also sent /jobsadmin and /jobs-internal/ to the runner. Prefixes match on segment
// boundaries now.
func TestAttackRoutePrefixBoundary(t *testing.T) {
	var r *backend
	e := newEnv(t, Config{}, nil, func(e *env) {
		r = newBackend(t, "runner", "runner-1", "i1")
		e.register(r, "", 1000, schema.Route{Method: "GET", Prefix: "/jobs", Kind: "runner"})
		e.place("runner", "t1", "runner-1")
	})
	for path, want := range map[string]int{"/jobs": 200, "/jobs/7": 200, "/jobs?x=1": 200, "/jobsadmin": 404, "/jobs-internal/x": 404} {
		if resp, _ := e.do("GET", path, "t1", "", nil); resp.StatusCode != want {
			t.Errorf("GET %s: status %d, want %d", path, resp.StatusCode, want)
		}
	}
}

// TestAttackRouteHijack (item 5): a shard of another kind that publishes the aggregate's route
// used to take it over (the key had no kind, and the newest publisher's kind won), and its
// instances then received the aggregate's tenants' requests. Routes are keyed by kind now, and
// a route two kinds publish is routed to neither (logged, tm_gateway_route_conflicts_total):
// the intruder gets nothing, and the aggregate's route comes back when the intruder's goes.
func TestAttackRouteHijack(t *testing.T) {
	var a, p *backend
	e := newEnv(t, Config{}, nil, func(e *env) {
		a = newBackend(t, "aggregate", "aggregate-1", "i1")
		p = newBackend(t, "projection", "projection-1", "evil")
		e.register(a, "", 1000, aggRoute)
		e.place("aggregate", "t1", "aggregate-1")
		e.place("projection", "t1", "projection-1")
	})
	e.waitServedBy("/agg/x", "t1", a.id.Key())
	hijack := aggRoute
	hijack.Kind = "projection"
	e.register(p, "", 1000, hijack)
	eventually(t, 10*time.Second, "the intruder's route seen", func() bool {
		resp, _ := e.do("GET", "/agg/x", "t1", "", nil)
		return resp.StatusCode == http.StatusNotFound || resp.Header.Get(tmhttp.HeaderServedBy) == p.id.Key()
	})
	for range 20 {
		e.do("GET", "/agg/x", "t1", "", nil)
	}
	if reqs, _ := p.requests(); len(reqs) > 0 {
		t.Fatalf("the projection instance that published the aggregate's route received %d of its requests", len(reqs))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := e.st.Routes().RemoveInstance(ctx, hijack, p.id); err != nil {
		t.Fatal(err)
	}
	e.waitServedBy("/agg/x", "t1", a.id.Key())
}
