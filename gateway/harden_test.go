package gateway

// Attacks from the security review (issue 34), each made against a real gateway on 127.0.0.1
// with an embedded NATS server; docs/security.md's threat model names each test.

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"strings"
	"testing"
	"time"
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
