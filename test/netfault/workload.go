package netfault

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/gatesig"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
	"github.com/tenantmesh/tenantmesh/test/history"
)

// Workload is the ledger workload of test/history sent through the fleet's gateways (each
// tenant's client starts on gateway client%len), beside queries of the projection and
// webhook jobs of the runner whose effects land on a receiver on the host's address. Every
// answer is timed, so a test can say how long each tenant went without one.
type Workload struct {
	f        *Fleet
	C        *history.Client
	Tenants  []string
	accounts []string
	rcv      *history.Receiver
	hook     *http.Server

	jobsMu sync.Mutex
	jobs   map[string]string // job id -> tenant

	ansMu sync.Mutex
	ok    map[string][]time.Time // "<kind>/<tenant>" -> when successful answers came

	outMu sync.RWMutex
	out   map[string]bool // gateways out of rotation

	stop     chan struct{}
	wg       sync.WaitGroup
	stopOnce sync.Once
}

// OutOfRotation takes a gateway out of the workload's rotation (or puts it back), as a load
// balancer does around a gateway's replacement: requests under way finish, new ones go to
// the others.
func (w *Workload) OutOfRotation(g *Proc, out bool) {
	w.outMu.Lock()
	defer w.outMu.Unlock()
	w.out[g.URL] = out
}

func (w *Workload) isOut(url string) bool {
	w.outMu.RLock()
	defer w.outMu.RUnlock()
	return w.out[url]
}

// StartWorkload opens two accounts for each tenant and starts, per tenant, a ledger client
// (deposits, withdrawals, reads), a query client and a job client. gateways, if given, are the
// gateways it uses (default all). Stop ends it; Check judges it.
func (f *Fleet) StartWorkload(t testing.TB, tenants []string, gateways ...*Proc) *Workload {
	t.Helper()
	if len(gateways) == 0 {
		gateways = f.Gateways
	}
	var urls []string
	for _, g := range gateways {
		urls = append(urls, g.URL)
	}
	w := &Workload{f: f, Tenants: tenants, accounts: []string{"x", "y"}, rcv: history.NewReceiver(),
		jobs: map[string]string{}, ok: map[string][]time.Time{}, out: map[string]bool{}, stop: make(chan struct{})}
	w.C = &history.Client{Gateways: urls, HTTP: &http.Client{Timeout: 20 * time.Second}, Rec: history.NewRecorder(),
		OnAnswer: w.observe, Slow: 5 * time.Second, Logf: t.Logf, Authorize: f.Authorize, Out: w.isOut}
	ln, err := net.Listen("tcp", f.Net.HostIP()+":0")
	if err != nil {
		t.Fatal(err)
	}
	w.hook = &http.Server{Handler: w.rcv, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = w.hook.Serve(ln) }() // owned by the workload: ends at Stop's Shutdown
	hookURL := "http://" + ln.Addr().String()
	t.Cleanup(w.Stop)
	for i, tenant := range tenants {
		for _, acct := range w.accounts {
			if !w.C.Open(i, tenant, acct) {
				t.Fatalf("opening %s/%s: %v", tenant, acct, w.C.Failures())
			}
		}
	}
	loop := func(pause time.Duration, step func(n int)) {
		for n := 0; n < 1_000_000; n++ {
			select {
			case <-w.stop:
				return
			default:
			}
			step(n)
			time.Sleep(pause) // pace the load so the 2-core machine keeps up
		}
	}
	for i, tenant := range tenants {
		w.wg.Go(func() { w.C.Ledger(i, tenant, w.accounts, 10*time.Millisecond, w.stop, nil) })
		w.wg.Go(func() {
			loop(100*time.Millisecond, func(int) {
				w.C.Call(i, tenant, "projection", "POST", "/query/accounts", map[string]any{"limit": 5})
			})
		})
		w.wg.Go(func() {
			loop(150*time.Millisecond, func(n int) {
				status, b := w.C.Call(i, tenant, "runner", "POST", "/jobs", map[string]any{"type": "webhook",
					"idempotency_key": fmt.Sprintf("nf-job-%d", n),
					"payload":         map[string]any{"url": hookURL, "body": map[string]any{"tenant": tenant, "n": n}}})
				var run struct{ ID string }
				if status < 300 && json.Unmarshal(b, &run) == nil && run.ID != "" {
					w.jobsMu.Lock()
					w.jobs[run.ID] = tenant
					w.jobsMu.Unlock()
				}
			})
		})
	}
	return w
}

func (w *Workload) observe(tenant, kind string, ok bool, _, answered time.Time) {
	if !ok {
		return
	}
	w.ansMu.Lock()
	w.ok[kind+"/"+tenant] = append(w.ok[kind+"/"+tenant], answered)
	w.ansMu.Unlock()
}

// EffectsInDoubt says a runner instance could not record its deliveries between from and to
// (history.Receiver.InDoubt).
func (w *Workload) EffectsInDoubt(from, to time.Time) { w.rcv.InDoubt(from, to) }

// Outage is the longest time any tenant went without a successful answer, in any kind, over
// the window [from, to], and which tenant-kind it was: how long a fault kept someone from
// being served (0 when everyone was served throughout, up to the load's own pacing).
func (w *Workload) Outage(from, to time.Time) (time.Duration, string) {
	w.ansMu.Lock()
	defer w.ansMu.Unlock()
	var worst time.Duration
	var who string
	for k, times := range w.ok {
		prev := from
		for _, at := range times {
			if at.Before(from) {
				continue
			}
			if at.After(to) {
				break
			}
			if gap := at.Sub(prev); gap > worst {
				worst, who = gap, k
			}
			prev = at
		}
		if gap := to.Sub(prev); gap > worst {
			worst, who = gap, k
		}
	}
	return worst, who
}

// AwaitServed waits until every tenant had a successful answer in every kind after since,
// and returns when the last of them came.
func (w *Workload) AwaitServed(t testing.TB, since time.Time, within time.Duration) time.Time {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		last, missing := since, ""
		w.ansMu.Lock()
		for _, kind := range Kinds {
			for _, tenant := range w.Tenants {
				times := w.ok[kind+"/"+tenant]
				i := slices.IndexFunc(times, func(at time.Time) bool { return at.After(since) })
				if i < 0 {
					missing = kind + "/" + tenant
					continue
				}
				if times[i].After(last) {
					last = times[i]
				}
			}
		}
		w.ansMu.Unlock()
		if missing == "" {
			return last
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not served again within %s of %s", missing, within, since.Format("15:04:05.000"))
		}
		time.Sleep(50 * time.Millisecond) // polling the load's answers: they have no event to await
	}
}

// Stop ends the load and waits for it.
func (w *Workload) Stop() {
	w.stopOnce.Do(func() {
		close(w.stop)
		w.wg.Wait()
	})
}

// Check stops the load and judges it: no request failed that the contract does not allow,
// the ledger history is linearizable, every view converged to the ledger, every job ran and
// its effect arrived exactly once, and every placement ended with one owner.
func (w *Workload) Check(t testing.TB, st *schema.Store) {
	t.Helper()
	w.Stop()
	if f := w.C.Failures(); len(f) > 0 {
		t.Errorf("%d requests failed:\n%s", len(f), strings.Join(f[:min(len(f), 20)], "\n"))
	}
	w.C.Rec.RequireLinearizable(t, "TM_FAULT_LOGS", t.Name())
	ctx := context.Background()
	for i, tenant := range w.Tenants {
		status, b := w.C.Call(i, tenant, "aggregate", "GET", "/ledger/totals", nil)
		var tot struct{ Balances int64 }
		if status != http.StatusOK || json.Unmarshal(b, &tot) != nil {
			t.Errorf("totals of %s: %d %s", tenant, status, b)
			continue
		}
		history.AwaitView(t, w.caller(i), tenant, tot.Balances)
		for _, kind := range Kinds {
			// A move committed during the fault may still be finishing (its former owner's
			// drained, within the drain timeout): settled means it ends with one owner.
			var p schema.Placement
			var err error
			for deadline := time.Now().Add(60 * time.Second); ; {
				p, err = st.Placements(kind).Latest(ctx, tenant)
				if settled := err == nil && p.Phase == schema.PhaseActive && p.Target == "" && p.Source == ""; settled || time.Now().After(deadline) {
					break
				}
				time.Sleep(200 * time.Millisecond) // polling the placement; a move finishes on its own
			}
			if err != nil || p.Phase != schema.PhaseActive || p.Target != "" || p.Source != "" {
				t.Errorf("placement %s/%s not settled with one owner within 60 s: %+v %v", kind, tenant, p, err)
			}
		}
	}
	w.jobsMu.Lock()
	history.AwaitJobs(t, w.caller(0), w.jobs)
	w.jobsMu.Unlock()
	if err := w.hook.Close(); err != nil {
		t.Log(err)
	}
	w.rcv.CheckOnce(t, len(w.jobs))
}

// caller sends requests as client number client of the ledger workload, with its retries.
func (w *Workload) caller(client int) history.Caller {
	return func(tenant, kind, method, path string, body any) (int, []byte) {
		return w.C.Call(client, tenant, kind, method, path, body)
	}
}

// Direct sends GET path for tenant straight to a shard's instance with a gateway's proof at
// epoch, as a gateway routing by an old view would, and returns the status (0: no answer)
// and the body's start.
func (f *Fleet) Direct(kind, shard, tenant string, epoch uint64, path string, proof *gatesig.Signer) (int, string) {
	p := f.Shards[shard]
	req, _ := http.NewRequest("GET", p.URL+path, nil)
	fields := gatesig.Fields{Method: "GET", Target: path, Kind: kind, Shard: shard, Tenant: tenant, Epoch: strconv.FormatUint(epoch, 10)}
	req.Header.Set(tmhttp.HeaderTenant, tenant)
	req.Header.Set(tmhttp.HeaderKind, kind)
	req.Header.Set(tmhttp.HeaderShard, shard)
	req.Header.Set(tmhttp.HeaderEpoch, fields.Epoch)
	req.Header.Set(tmhttp.HeaderProof, string(proof.Append(nil, time.Now().Unix(), &fields)))
	resp, err := directClient.Do(req)
	if err != nil {
		return 0, err.Error()
	}
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	resp.Body.Close()
	return resp.StatusCode, string(b)
}

var directClient = &http.Client{Timeout: 2 * time.Second}

// Admin calls the rebalancer's API with the admin token: method, path, a JSON body or nil.
func (f *Fleet) Admin(method, path string, body any) (int, []byte, error) {
	var r io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		r = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, f.Rebalancer.URL+path, r)
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+AdminToken)
	resp, err := adminClient.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return resp.StatusCode, b, nil
}

var adminClient = &http.Client{Timeout: 30 * time.Second}
