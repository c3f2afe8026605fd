package gateway

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// smuggled is a request hidden in the body of another: a proxy that reads the framing one way
// and the instance another would let it through.
const smuggled = "GET /agg/smuggled HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\n\r\n"

// smuggleCases are requests whose framing or form is ambiguous or invalid. Each is answered
// 400 (431 over the head bounds) by the gateway's own front end and never forwarded.
// ambiguous: net/http's server (the front end of TLS connections) must refuse it too; the others
// it may accept, as long as it forwards them unambiguously. teOverCL: net/http reads the body as
// chunked (Transfer-Encoding over Content-Length, as RFC 9112 section 6.3 allows, and obs-fold
// unfolded), so what follows the body is
// the client's next request, which the gateway forwards framed anew (no desync is possible: the
// gateway never forwards the client's framing).
var smuggleCases = []struct {
	name, req string
	status    int
	ambiguous bool
	teOverCL  bool
}{
	{"CL and TE", "POST /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + smuggled, 400, true, true},
	{"TE and CL", "POST /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nTransfer-Encoding: chunked\r\nContent-Length: 60\r\n\r\n0\r\n\r\n" + smuggled, 400, true, true},
	{"two Content-Lengths", "POST /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nContent-Length: 0\r\nContent-Length: 57\r\n\r\n" + smuggled, 400, true, false},
	{"Content-Length list", "POST /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nContent-Length: 0, 57\r\n\r\n" + smuggled, 400, true, false},
	{"Content-Length sign", "POST /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nContent-Length: +57\r\n\r\n" + smuggled, 400, true, false},
	{"Content-Length garbage", "POST /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nContent-Length: 5x\r\n\r\n" + smuggled, 400, true, false},
	{"TE gzip, chunked", "POST /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n" + smuggled, 400, true, false},
	{"TE chunked, identity", "POST /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n" + smuggled, 400, true, false},
	{"TE twice", "POST /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + smuggled, 400, false, false},
	{"TE space before colon", "POST /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nTransfer-Encoding : chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n" + smuggled, 400, true, false},
	{"TE obs-fold", "POST /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nTransfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n" + smuggled, 400, true, true},
	{"obs-fold", "GET /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nX-A: a\r\n b\r\n\r\n", 400, false, false},
	{"bare LF", "GET /agg/x HTTP/1.1\nHost: g\nx-tenant-id: t1\n\n", 400, false, false},
	{"NUL in a value", "GET /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nX-A: a\x00b\r\n\r\n", 400, true, false},
	{"chunk size negative", "POST /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n" + smuggled, 400, true, false},
	{"chunk size 0x", "POST /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nTransfer-Encoding: chunked\r\n\r\n0x3\r\nabc\r\n0\r\n\r\n" + smuggled, 400, true, false},
	{"chunk size huge", "POST /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffffff\r\n" + smuggled, 400, true, false},
	{"chunk extension without name", "POST /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nTransfer-Encoding: chunked\r\n\r\n3;\r\nabc\r\n0\r\n\r\n" + smuggled, 400, false, false},
	{"chunk extension control byte", "POST /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nTransfer-Encoding: chunked\r\n\r\n3;a=\x01\r\nabc\r\n0\r\n\r\n" + smuggled, 400, false, false},
	{"chunk data overrun", "POST /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcdef\r\n0\r\n\r\n" + smuggled, 400, true, false},
	{"chunk bare LF", "POST /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nTransfer-Encoding: chunked\r\n\r\n3\nabc\n0\n\n" + smuggled, 400, false, false},
	{"absolute form", "GET http://evil.example/agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\n\r\n", 400, false, false},
	{"authority form", "CONNECT evil.example:443 HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\n\r\n", 400, false, false},
	{"no Host", "GET /agg/x HTTP/1.1\r\nx-tenant-id: t1\r\n\r\n", 400, true, false},
	{"two Hosts", "GET /agg/x HTTP/1.1\r\nHost: a\r\nHost: b\r\nx-tenant-id: t1\r\n\r\n", 400, true, false},
	{"version", "GET /agg/x HTTP/1.2\r\nHost: g\r\nx-tenant-id: t1\r\n\r\n", 400, false, false},
	{"too many fields", "GET /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\n" + strings.Repeat("X-A: b\r\n", 200) + "\r\n", 431, false, false},
	{"head too large", "GET /agg/x HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nX-A: " + strings.Repeat("b", 16<<10) + "\r\n\r\n", 431, true, false},
}

// TestSmuggling sends each case over a raw connection: the gateway's own front end answers it
// 400 (431) and closes the connection, and no request reaches the shard; net/http's front end
// refuses the ambiguous ones. (Where net/http accepts a case, it reads the body one way and the
// gateway forwards exactly what it read, framed anew, so a request after the body is the
// client's next request, not a desync with the shard.)
func TestSmuggling(t *testing.T) {
	for _, front := range []struct {
		name string
		cfg  Config
		own  bool
	}{{"front end", Config{MaxHeaderBytes: 8 << 10}, true}, {"net/http front end", Config{MaxHeaderBytes: 8 << 10, stdFrontEnd: true}, false}} {
		t.Run(front.name, func(t *testing.T) {
			var a *backend
			e := newEnv(t, front.cfg, nil, func(e *env) {
				a = newBackend(t, "aggregate", "aggregate-1", "i1")
				e.register(a, "", 10, aggRoute)
				e.place("aggregate", "t1", "aggregate-1")
			})
			addr := strings.TrimPrefix(e.url, "http://")
			for _, tc := range smuggleCases {
				before, _ := a.requests()
				status, rest := rawExchange(t, addr, tc.req)
				after, _ := a.requests()
				for _, r := range after[len(before):] {
					if r.URL.Path == "/agg/smuggled" && front.own {
						t.Fatalf("%s: the smuggled request reached the shard", tc.name)
					}
				}
				if strings.Contains(rest, "HTTP/1.1 200") && front.own {
					t.Fatalf("%s: a second answer came back: %q", tc.name, rest)
				}
				if front.own {
					if status != tc.status || len(after) != len(before) {
						t.Fatalf("%s: status %d, %d requests forwarded; want %d and none", tc.name, status, len(after)-len(before), tc.status)
					}
				} else if tc.ambiguous && !tc.teOverCL && status < 400 { // 4xx, or 501 for an unknown coding
					t.Fatalf("%s: net/http's front end answered %d", tc.name, status)
				}
			}
		})
	}
}

// rawExchange writes req on a fresh connection and returns the first answer's status and
// whatever follows it until the connection closes (bounded in time).
func rawExchange(t *testing.T, addr, req string) (int, string) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, req); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("reading the answer to %q: %v", truncate(req, 60), err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	_ = c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	rest, _ := io.ReadAll(br)
	return resp.StatusCode, string(rest)
}

// TestPipelinedFraming: requests pipelined on one connection, with a chunked body between
// them, are each framed right: the shard sees both with the right bodies.
func TestPipelinedFraming(t *testing.T) {
	var a *backend
	e := newEnv(t, Config{}, []schema.KindConfig{}, func(e *env) {
		a = newBackend(t, "aggregate", "aggregate-1", "i1")
		e.register(a, "", 10, aggRoute)
		e.place("aggregate", "t1", "aggregate-1")
	})
	addr := strings.TrimPrefix(e.url, "http://")
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	_, _ = io.WriteString(c, "POST /agg/1 HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nTransfer-Encoding: chunked\r\n\r\n3;x=1\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"+
		"POST /agg/2 HTTP/1.1\r\nHost: g\r\nx-tenant-id: t1\r\nContent-Length: 3\r\n\r\nxyz")
	br := bufio.NewReader(c)
	for i := range 2 {
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("answer %d: %v", i, err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("answer %d: %d", i, resp.StatusCode)
		}
	}
	reqs, bodies := a.requests()
	if len(reqs) != 2 || reqs[0].URL.Path != "/agg/1" || bodies[0] != "abcde" || reqs[1].URL.Path != "/agg/2" || bodies[1] != "xyz" {
		t.Fatalf("shard saw %d requests, bodies %q", len(reqs), bodies)
	}
}
