package runner

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// listenOn serves h on ip (a loopback address) and counts the requests it gets.
func listenOn(t *testing.T, ip string, h http.HandlerFunc) (*httptest.Server, *atomic.Int32) {
	t.Helper()
	ln, err := net.Listen("tcp", ip+":0")
	if err != nil {
		t.Fatal(err)
	}
	var hits atomic.Int32
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { hits.Add(1); h(w, r) }))
	srv.Listener.Close()
	srv.Listener = ln
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, &hits
}

// TestAttackWebhookSSRF (item 10): a webhook's URL comes from a tenant's job, and the runner
// posted wherever it said, following redirects: a tenant could reach the cloud's metadata
// service or anything on the private network (a blind SSRF). A real runner instance now
// refuses loopback, private and link-local destinations at dial time (a name that resolves to
// one too), follows no redirect, and reaches private addresses only on its allow-list.
func TestAttackWebhookSSRF(t *testing.T) {
	internal, hits := listenOn(t, "127.0.0.1", func(w http.ResponseWriter, _ *http.Request) {}) // say, a metadata service
	port := internal.Listener.Addr().(*net.TCPAddr).Port
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	// The runner's own default: public addresses only.
	st := openStore(t)
	place(t, st, "acme", "runner-1")
	s := startService(t, st, "runner-1", "a", Config{WebhookAllow: []string{PublicAddresses}})
	owning(t, s, "acme", true)
	for _, url := range []string{internal.URL + "/latest/meta-data", "http://localhost:" + strconv.Itoa(port) + "/x",
		"http://[::ffff:127.0.0.1]:" + strconv.Itoa(port) + "/x", "http://169.254.169.254/latest/meta-data", "http://10.0.0.1/x"} {
		ids := create(t, s, "acme", 1, hookJob(url, "x"))
		r := waitDone(t, s, "acme", ids, 15*time.Second)[ids[0]]
		if r.Status != StatusFailed || !strings.Contains(r.Error, "not allowed") {
			t.Errorf("a job's webhook to %s: %+v; want it refused", url, r)
		}
	}
	if n := hits.Load(); n != 0 {
		t.Fatalf("the internal service received %d webhook posts", n)
	}

	// An allowed receiver that redirects to the internal service: the redirect is not followed.
	receiver, got := listenOn(t, "127.0.0.2", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, internal.URL+"/latest/meta-data", http.StatusFound)
	})
	w := &Webhook{Allow: []string{"127.0.0.2"}, Attempts: 2, Backoff: time.Millisecond}
	_, err := w.Do(ctx, Request{Effect: "webhook", To: receiver.URL, Key: "k1", Tenant: "acme"})
	if !errors.Is(err, ErrPermanent) || got.Load() != 1 || hits.Load() != 0 {
		t.Fatalf("a redirect to the internal service: err %v, receiver %d, internal %d; want a permanent failure and no post to the internal service", err, got.Load(), hits.Load())
	}
	// On the allow-list by CIDR: delivered.
	ok, okHits := listenOn(t, "127.0.0.3", func(w http.ResponseWriter, _ *http.Request) {})
	w = &Webhook{Allow: []string{"public", "127.0.0.3/32"}, Attempts: 1}
	if _, err := w.Do(ctx, Request{Effect: "webhook", To: ok.URL, Key: "k2", Tenant: "acme"}); err != nil || okHits.Load() != 1 {
		t.Fatalf("an allowed private receiver: %v, %d posts", err, okHits.Load())
	}
}
