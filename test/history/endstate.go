package history

import (
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

// What a whole-platform test checks once its workload stopped: the ledger history is
// linearizable (RequireLinearizable), the projection's views converged to the ledger
// (AwaitView), every job finished (AwaitJobs), and each job's effect reached the webhook
// receiver once (Receiver).

// Caller sends one request of a kind of service for tenant through the platform and returns
// its status and body: Client.Call with a client number, or a test's own load client.
type Caller func(tenant, kind, method, path string, body any) (int, []byte)

// RequireLinearizable fails t unless r's history is linearizable, checked within 2 minutes.
// On an illegal history, porcupine's visualization is kept as <name>-history.html in the
// directory the environment variable logsEnv names, if it is set.
func (r *Recorder) RequireLinearizable(t testing.TB, logsEnv, name string) {
	t.Helper()
	viz := filepath.Join(t.TempDir(), "history.html")
	res, err := r.Check(2*time.Minute, viz)
	if err != nil {
		t.Fatal(err)
	}
	switch res {
	case porcupine.Ok:
	case porcupine.Illegal:
		if dir := os.Getenv(logsEnv); dir != "" {
			if b, err := os.ReadFile(viz); err == nil {
				_ = os.WriteFile(filepath.Join(dir, strings.ReplaceAll(name, "/", "_")+"-history.html"), b, 0o644)
			}
		}
		t.Errorf("the ledger history of %d operations is not linearizable (%s=dir keeps porcupine's visualization)", r.Len(), logsEnv)
	default:
		t.Errorf("the linearizability check of %d operations did not finish in 2 minutes", r.Len())
	}
}

// AwaitView waits up to 30 s until tenant's projection view sums to balances (the ledger's
// total) with no lag, and fails t with what it saw otherwise.
func AwaitView(t testing.TB, call Caller, tenant string, balances int64) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, b := call(tenant, "projection", "POST", "/query/accounts", map[string]any{"limit": 100})
		var v struct {
			Items []struct{ Balance int64 } `json:"items"`
			Lag   uint64                    `json:"lag"`
		}
		var sum int64
		if json.Unmarshal(b, &v) == nil {
			for _, it := range v.Items {
				sum += it.Balance
			}
			if sum == balances && v.Lag == 0 {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Errorf("%s: view sums to %d (lag %d), ledger %d", tenant, sum, v.Lag, balances)
			return
		}
		time.Sleep(100 * time.Millisecond) // the projection catches up asynchronously
	}
}

// AwaitJobs waits up to 60 s in all until every job (id -> tenant) succeeded, and fails t for
// each that failed or had not finished.
func AwaitJobs(t testing.TB, call Caller, jobs map[string]string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for id, tenant := range jobs {
		for {
			_, b := call(tenant, "runner", "GET", "/jobs/"+id, nil)
			var run struct{ Status string }
			_ = json.Unmarshal(b, &run)
			if run.Status == "succeeded" {
				break
			}
			if run.Status == "failed" || time.Now().After(deadline) {
				t.Errorf("job %s of %s: %s", id, tenant, b)
				break
			}
			time.Sleep(50 * time.Millisecond) // jobs run asynchronously
		}
	}
}

// Receiver is a webhook endpoint counting deliveries per effect (Idempotency-Key).
type Receiver struct {
	mu    sync.Mutex
	byKey map[string]int
	first map[string]time.Time // when each effect was first delivered
	doubt [][2]time.Time       // InDoubt's windows
}

// NewReceiver returns a Receiver that has seen nothing.
func NewReceiver() *Receiver {
	return &Receiver{byKey: map[string]int{}, first: map[string]time.Time{}}
}

// ServeHTTP counts one delivery and answers 204.
func (r *Receiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	_, _ = io.Copy(io.Discard, req.Body)
	key := req.Header.Get("Idempotency-Key")
	r.mu.Lock()
	if r.byKey[key]++; r.byKey[key] == 1 {
		r.first[key] = time.Now()
	}
	r.mu.Unlock()
	w.WriteHeader(http.StatusNoContent)
}

// InDoubt says that between from and to a runner instance could not record its deliveries (it
// was frozen, cut off from NATS, or killed): an effect first delivered then may arrive once
// more, with its key, after the delivery's marker lease (the runner's documented window,
// services/runner/README.md, "what exactly once means here"). From is widened by a second for
// the exchange in flight when the fault began.
func (r *Receiver) InDoubt(from, to time.Time) {
	r.mu.Lock()
	r.doubt = append(r.doubt, [2]time.Time{from.Add(-time.Second), to})
	r.mu.Unlock()
}

// CheckOnce requires every effect delivered exactly once, and one effect per job; an effect
// first delivered within an InDoubt window may have been delivered twice (never more), and
// how many were is logged.
func (r *Receiver) CheckOnce(t testing.TB, jobs int) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	repeats := 0
	for key, n := range r.byKey {
		inDoubt := slices.ContainsFunc(r.doubt, func(w [2]time.Time) bool {
			return !r.first[key].Before(w[0]) && !r.first[key].After(w[1])
		})
		switch {
		case n == 2 && inDoubt:
			repeats++
		case n != 1:
			t.Errorf("effect %s delivered %d times (first at %s)", key, n, r.first[key].Format("15:04:05.000"))
		}
	}
	if repeats > 0 {
		t.Logf("%d effects delivered by an instance that could not record it before a fault, and again after its lease (allowed)", repeats)
	}
	if len(r.byKey) != jobs {
		t.Errorf("%d effects delivered for %d jobs", len(r.byKey), jobs)
	}
}

// CheckApplied requires one effect per job, each delivered at least once, and returns how many
// deliveries repeated an Idempotency-Key the receiver had seen: an idempotent receiver (the
// runner's contract) applies each effect once. A repeat is the runner's documented window: an
// instance killed after the receiver accepted an effect and before it recorded the delivery
// (services/runner/README.md, "what exactly once means here").
func (r *Receiver) CheckApplied(t testing.TB, jobs int) (repeats int) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, n := range r.byKey {
		repeats += n - 1
	}
	if len(r.byKey) != jobs {
		t.Errorf("%d effects delivered for %d jobs", len(r.byKey), jobs)
	}
	return repeats
}
