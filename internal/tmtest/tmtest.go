// Package tmtest holds test helpers every floor shares: a goroutine-leak check, a bounded wait
// for a condition, and a bounded HTTP client. It imports no tenantmesh package above internal/,
// so shardkit's own tests can use it; helpers that need a store or a shard are in
// shardkit/kittest.
package tmtest

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"strconv"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// ResourceCheck fails the test if it leaves goroutines behind: at the very end of the test
// (after every other cleanup, which stops what the test started), the goroutines that did not
// exist when ResourceCheck was called must be gone within a few seconds (go.uber.org/goleak;
// Tailscale's tstest.ResourceCheck is the same idea). Idle keep-alive connections of HTTP
// clients are not counted: net/http owns and reaps them. Nor is the one goroutine nats.go
// (v1.55.0) can strand per object-store Put: ObjectStore.Put starts a private publisher whose
// resetPendingAcksOnReconnect goroutine reads its status channel under a lock, and the Put's
// deferred cleanup may clear that channel first, leaving the goroutine on a nil channel for
// good. It is a library race, not ours; it showed in CI once under load.
func ResourceCheck(t testing.TB) {
	t.Helper()
	opts := []goleak.Option{goleak.IgnoreCurrent(),
		goleak.IgnoreAnyFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreAnyFunction("net/http.(*persistConn).writeLoop"),
		goleak.IgnoreTopFunction("github.com/nats-io/nats.go/jetstream.(*jetStream).resetPendingAcksOnReconnect")}
	t.Cleanup(func() {
		if t.Failed() {
			return // the failure says more than the goroutines it left
		}
		var err error
		for deadline := time.Now().Add(leakWait); time.Now().Before(deadline); {
			if err = goleak.Find(opts...); err == nil { // Find itself retries for about 2 s
				return
			}
		}
		t.Errorf("goroutines left behind by the test:\n%v", err)
	})
}

// leakWait is how long ResourceCheck waits for a test's goroutines to end.
var leakWait = 10 * time.Second

// WaitFor polls cond until it returns nil or within passes, then fails the test with cond's
// last error, so a timeout says what was still missing. It is for state no event announces
// (snapshots of NATS state, a process's view); every wait has its deadline. It polls every
// 5 ms (a condition may count consecutive observations).
func WaitFor(t testing.TB, within time.Duration, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("still waiting after %v: %v", within, err)
			return
		}
		time.Sleep(5 * time.Millisecond) // polling: the condition has no event to await
	}
}

// Until is WaitFor's condition for a bool: what names the state waited for.
func Until(what string, cond func() bool) func() error {
	return func() error {
		if cond() {
			return nil
		}
		return errors.New(what + ": not yet")
	}
}

// HTTP is the client tests use for the servers they start: every call is bounded, so a server
// that hangs fails the test at the bound, with the call named, instead of at go test's timeout.
// A stream that stays open longer (server-sent events) takes a request context instead.
var HTTP = &http.Client{Timeout: 30 * time.Second}

// Unaccepted returns the address (host:port) of a listener that never accepts and whose accept
// queue is full: the kernel drops further SYNs, so a connect there hangs until the dialer gives
// up (a peer that is frozen, or behind a partition) rather than being refused. Linux only.
func Unaccepted(t testing.TB) string {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(sa.(*syscall.SockaddrInet4).Port))
	for i := 0; ; i++ { // fill the accept queue (backlog 0 holds one): until a connect times out
		if i == 16 {
			t.Fatalf("every connect to %s's full queue was accepted: no black hole here", addr)
		}
		c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err != nil {
			break
		}
		t.Cleanup(func() { _ = c.Close() })
	}
	return addr
}

// CallJSON sends method url with body as JSON (nil: no body) and token as its bearer ("": no
// Authorization), decodes the answer into out (nil: not read), and returns its status and
// header. A transport error or an answer out cannot hold fails the test.
func CallJSON(t testing.TB, token, method, url string, body, out any) (int, http.Header) {
	t.Helper()
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			t.Fatal(err)
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, url, rd)
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := HTTP.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if out != nil {
		if err := json.Unmarshal(raw, out); err != nil {
			t.Fatalf("%s %s: %d %s: %v", method, url, resp.StatusCode, raw, err)
		}
	}
	return resp.StatusCode, resp.Header
}
