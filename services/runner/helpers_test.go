package runner

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

func openStore(t testing.TB) *schema.Store {
	st, _ := kittest.Store(t)
	return st
}

// startService builds and runs a runner instance; it stops when the test ends.
// testReceivers is the webhook allow-list of the tests' receivers (httptest, on loopback).
var testReceivers = []string{"127.0.0.0/8"}

func startService(t testing.TB, st *schema.Store, shard, instance string, cfg Config) *Service {
	t.Helper()
	s, _ := startStoppable(t, st, shard, instance, cfg)
	return s
}

// startStoppable is startService with a stop function that returns once Run returned.
func startStoppable(t testing.TB, st *schema.Store, shard, instance string, cfg Config) (*Service, func()) {
	t.Helper()
	cfg.Store = st
	cfg.ID = schema.InstanceID{Kind: Kind, Shard: shard, Instance: instance}
	if cfg.Sagas == nil {
		cfg.Sagas = []Saga{}
	}
	if cfg.WebhookAllow == nil {
		cfg.WebhookAllow = testReceivers // the tests' receivers listen on loopback
	}
	s, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Run(ctx) }()
	stop := func() { cancel(); <-done }
	t.Cleanup(stop)
	return s, stop
}

func place(t testing.TB, st *schema.Store, tenant, shard string) schema.Placement {
	t.Helper()
	p, err := st.Placements(Kind).Create(context.Background(), schema.Placement{Tenant: tenant, Shard: shard})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// waitUntil waits until cond holds (tmtest.WaitFor), for state no event announces.
func waitUntil(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	tmtest.WaitFor(t, d, tmtest.Until(what, cond))
}

// owning waits until s acquires tenant.
func owning(t testing.TB, s *Service, tenant string, want bool) {
	t.Helper()
	waitUntil(t, 5*time.Second, fmt.Sprintf("%s owning %s = %v", s.cfg.ID, tenant, want), func() bool {
		for _, o := range s.Owned() {
			if o == tenant {
				return want
			}
		}
		return !want
	})
}

// create enqueues n jobs of typ for tenant and returns their ids.
func create(t testing.TB, s *Service, tenant string, n int, nj NewJob) []string {
	t.Helper()
	ids := make([]string, n)
	var wg sync.WaitGroup
	errs := make(chan error, n)
	sem := make(chan struct{}, 8)
	for i := range n {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			r, _, err := s.Create(context.Background(), tenant, nj)
			if err != nil {
				errs <- err
				return
			}
			ids[i] = r.ID
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	return ids
}

// waitDone watches the runs bucket until every id of tenant is finished; it returns the runs.
func waitDone(t testing.TB, s *Service, tenant string, ids []string, d time.Duration) map[string]Run {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	want := map[string]bool{}
	for _, id := range ids {
		want[id] = true
	}
	w, err := s.store.runs.Watch(ctx, tenant+".*")
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	out := map[string]Run{}
	for {
		select {
		case e := <-w.Updates():
			if e == nil || e.Operation() != jetstream.KeyValuePut {
				continue
			}
			var r Run
			if json.Unmarshal(e.Value(), &r) != nil || !want[r.ID] {
				continue
			}
			if r.Status.done() {
				out[r.ID] = r
			} else {
				delete(out, r.ID)
			}
			if len(out) == len(want) {
				return out
			}
		case <-ctx.Done():
			t.Fatalf("after %v, %d of %d jobs of %s finished", d, len(out), len(want), tenant)
		}
	}
}

// receiver is a real webhook endpoint that counts deliveries per Idempotency-Key.
type receiver struct {
	*httptest.Server
	mu     sync.Mutex
	counts map[string]int
	total  int
	// failFirst answers 503 to the first n tries of each key; status answers that code always.
	failFirst int
	tries     map[string]int
	status    int
	delay     time.Duration
	notify    chan string
}

func newReceiver(t testing.TB) *receiver {
	rc := &receiver{counts: map[string]int{}, tries: map[string]int{}, notify: make(chan string, 100000)}
	rc.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		rc.mu.Lock()
		rc.tries[key]++
		fail := rc.tries[key] <= rc.failFirst
		status, delay := rc.status, rc.delay
		if !fail && status == 0 {
			rc.counts[key]++
			rc.total++
		}
		rc.mu.Unlock()
		if delay > 0 {
			time.Sleep(delay) // the receiver's own work, not a test wait
		}
		switch {
		case fail:
			w.WriteHeader(http.StatusServiceUnavailable)
		case status != 0:
			w.WriteHeader(status)
		default:
			w.WriteHeader(http.StatusNoContent)
			rc.notify <- key
		}
	}))
	t.Cleanup(rc.Close)
	return rc
}

func (rc *receiver) snapshot() (map[string]int, int) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	m := make(map[string]int, len(rc.counts))
	for k, v := range rc.counts {
		m[k] = v
	}
	return m, rc.total
}

// await waits for n more deliveries.
func (rc *receiver) await(t testing.TB, n int, d time.Duration) {
	t.Helper()
	deadline := time.NewTimer(d)
	defer deadline.Stop()
	for i := 0; i < n; i++ {
		select {
		case <-rc.notify:
		case <-deadline.C:
			t.Fatalf("receiver got %d of %d deliveries in %v", i, n, d)
		}
	}
}

func hookJob(url string, body any) NewJob {
	b, _ := json.Marshal(map[string]any{"url": url, "body": body})
	return NewJob{Type: "webhook", Payload: b}
}

var errTest = errors.New("test failure")

// testLogger writes debug logs to stderr when TM_TEST_LOG is set; otherwise nil (discarded).
func testLogger() *slog.Logger {
	if os.Getenv("TM_TEST_LOG") == "" {
		return nil
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
}
