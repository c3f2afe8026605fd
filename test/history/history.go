// Package history is the project's history checker for whole-platform tests: a ledger
// workload sent through the gateway (deposits, withdrawals and reads of accounts), every
// operation recorded with its invocation and response times, and the history checked for
// linearizability with porcupine (github.com/anishathalye/porcupine), the checker Jepsen-style
// tests of etcd and others use.
//
// Each account is a register of its balance: a deposit adds, a withdrawal subtracts if the
// balance covers it and is rejected otherwise, a read returns the balance. A command is one
// operation from its first attempt to its final answer, however often the client sends it
// again (with the same idempotency key, so the ledger applies it once); an operation whose
// answer never came (the test's budget ran out) may have taken effect or not, anywhere after
// its invocation. A history is linearizable if the operations can be put in one order that
// respects real time (an operation that returned before another was invoked comes first) and
// that the register explains: no lost or doubled deposit, no read of a stale balance, no
// withdrawal decided on a balance that was not the current one.
package history

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/anishathalye/porcupine"
)

// Kind of an operation.
const (
	Deposit  = "deposit"
	Withdraw = "withdraw"
	Read     = "read"
)

// Input is an operation's request: on Tenant's Account, Amount for deposits and withdrawals.
type Input struct {
	Kind, Tenant, Account string
	Amount                int64
	Key                   string // the idempotency key of a command
}

// Output is an operation's answer: Known false when none came (it may have taken effect or
// not); OK false for a rejected withdrawal; Balance for a read.
type Output struct {
	Known, OK bool
	Balance   int64
}

// Recorder collects operations from concurrent clients.
type Recorder struct {
	start time.Time
	mu    sync.Mutex
	ops   []porcupine.Operation
}

// NewRecorder starts a history now.
func NewRecorder() *Recorder { return &Recorder{start: time.Now()} }

// Record adds one operation of client, invoked at call and answered at ret (ignored when the
// output is unknown: such an operation may take effect until the end of time).
func (r *Recorder) Record(client int, in Input, out Output, call, ret time.Time) {
	op := porcupine.Operation{ClientId: client, Input: in, Output: out, Call: call.Sub(r.start).Nanoseconds(), Return: ret.Sub(r.start).Nanoseconds()}
	if !out.Known {
		op.Return = math.MaxInt64
	}
	r.mu.Lock()
	r.ops = append(r.ops, op)
	r.mu.Unlock()
}

// Len is how many operations were recorded.
func (r *Recorder) Len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.ops)
}

// Model is the ledger as porcupine checks it: one register per account (the history is
// partitioned by tenant and account), nondeterministic for an operation whose answer is
// unknown (it took effect, or it did not).
var Model = porcupine.NondeterministicModel{
	Partition: func(history []porcupine.Operation) [][]porcupine.Operation {
		byAccount := map[string][]porcupine.Operation{}
		var order []string
		for _, op := range history {
			in := op.Input.(Input)
			k := in.Tenant + "/" + in.Account
			if _, ok := byAccount[k]; !ok {
				order = append(order, k)
			}
			byAccount[k] = append(byAccount[k], op)
		}
		out := make([][]porcupine.Operation, 0, len(order))
		for _, k := range order {
			out = append(out, byAccount[k])
		}
		return out
	},
	Init: func() []any { return []any{int64(0)} },
	Step: func(state, input, output any) []any {
		bal, in, out := state.(int64), input.(Input), output.(Output)
		switch in.Kind {
		case Deposit:
			switch {
			case !out.Known:
				return []any{bal, bal + in.Amount}
			case out.OK:
				return []any{bal + in.Amount}
			}
			return []any{bal} // refused: not applied
		case Withdraw:
			covered := bal >= in.Amount
			switch {
			case !out.Known && covered:
				return []any{bal, bal - in.Amount}
			case !out.Known:
				return []any{bal}
			case out.OK && covered:
				return []any{bal - in.Amount}
			case !out.OK && !covered:
				return []any{bal}
			}
			return nil // the answer contradicts the balance
		case Read:
			if !out.Known || out.Balance == bal {
				return []any{bal}
			}
		}
		return nil
	},
	DescribeOperation: func(input, output any) string {
		in, out := input.(Input), output.(Output)
		res := "?"
		if out.Known {
			switch in.Kind {
			case Read:
				res = strconv.FormatInt(out.Balance, 10)
			default:
				res = strconv.FormatBool(out.OK)
			}
		}
		if in.Kind == Read {
			return fmt.Sprintf("read %s/%s -> %s", in.Tenant, in.Account, res)
		}
		return fmt.Sprintf("%s %s/%s %d (%s) -> %s", in.Kind, in.Tenant, in.Account, in.Amount, in.Key, res)
	},
}

// Check checks the history for linearizability within timeout. On failure, if vizPath is set,
// porcupine's visualization of the smallest non-linearizable partition is written there.
func (r *Recorder) Check(timeout time.Duration, vizPath string) (porcupine.CheckResult, error) {
	r.mu.Lock()
	ops := append([]porcupine.Operation(nil), r.ops...)
	r.mu.Unlock()
	model := Model.ToModel()
	res, info := porcupine.CheckOperationsVerbose(model, ops, timeout)
	if res == porcupine.Illegal && vizPath != "" {
		if err := porcupine.VisualizePath(model, info, vizPath); err != nil {
			return res, err
		}
	}
	return res, nil
}

// Ledger runs client's share of the ledger workload on tenant's accounts until stop is closed:
// deposits (half), withdrawals and reads, one every pause. It returns how many it ran.
// onDeposit, if set, is called with each acknowledged deposit's amount.
func (c *Client) Ledger(client int, tenant string, accounts []string, pause time.Duration, stop <-chan struct{}, onDeposit func(int64)) int {
	rnd := rand.New(rand.NewPCG(uint64(client), uint64(time.Now().UnixNano())))
	n := 0
	for ; n < 1_000_000; n++ {
		select {
		case <-stop:
			return n
		default:
		}
		in := Input{Tenant: tenant, Account: accounts[rnd.IntN(len(accounts))]}
		switch r := rnd.IntN(10); {
		case r < 5:
			in.Kind, in.Amount = Deposit, int64(1+rnd.IntN(9))
		case r < 7:
			in.Kind, in.Amount = Withdraw, int64(1+rnd.IntN(9))
		default:
			in.Kind = Read
		}
		if out := c.Do(client, in); out.OK && in.Kind == Deposit && onDeposit != nil {
			onDeposit(in.Amount)
		}
		time.Sleep(pause) // pace the load so the 2-core machine keeps up
	}
	return n
}

// Client sends the ledger workload through a gateway, records it, and retries only what a
// client may: a 503 or a 429 with Retry-After and an error reaching the gateway (the same request, with
// the same idempotency key), until Budget.
type Client struct {
	Gateways []string
	HTTP     *http.Client
	Rec      *Recorder
	// Budget bounds one operation, retries included. Default 45s.
	Budget time.Duration
	// RetryPause is the pause before sending again. Default 100ms (a Retry-After asks for
	// more; this client asks sooner, to see the outage end).
	RetryPause time.Duration
	// OnAnswer, if set, is called with every answer: its tenant, the kind of service, whether it
	// succeeded, when the attempt was sent and when it was answered; a test measures with it
	// when a tenant answers again.
	OnAnswer func(tenant, kind string, ok bool, sent, answered time.Time)
	// Slow, if set with Logf, logs every operation that took longer than Slow to get its final
	// answer, with its attempts and what the last retried one got: where a test's time went.
	Slow time.Duration
	Logf func(format string, args ...any)
	// Authorize, if set, is called on every request before it is sent, with its tenant: a
	// gateway that checks edge identities wants a bearer token.
	Authorize func(req *http.Request, tenant string)
	// Out, if set, tells which gateways are out of rotation (a load balancer's view during a
	// rolling deploy): an attempt skips them while another one is in.
	Out func(gateway string) bool

	keys     atomic.Int64
	mu       sync.Mutex
	failures []string
}

// Failures are the operations that ended with an answer the contract does not allow (or none
// within the budget).
func (c *Client) Failures() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.failures...)
}

func (c *Client) fail(format string, a ...any) {
	c.mu.Lock()
	c.failures = append(c.failures, time.Now().Format("15:04:05.000 ")+fmt.Sprintf(format, a...))
	c.mu.Unlock()
}

// Open opens the account (once, idempotently) and records nothing: the register starts at 0.
func (c *Client) Open(client int, tenant, account string) bool {
	status, _ := c.Call(client, tenant, "aggregate", http.MethodPost, "/commands", map[string]any{"aggregate_type": "account",
		"aggregate_id": account, "command": "open", "payload": map[string]string{"owner": tenant}, "idempotency_key": "open-" + account})
	return status == http.StatusCreated || status == http.StatusOK
}

// Do runs one operation and records it.
func (c *Client) Do(client int, in Input) Output {
	call := time.Now()
	var out Output
	switch in.Kind {
	case Deposit, Withdraw:
		if in.Key == "" {
			in.Key = fmt.Sprintf("%s-%d-%d", in.Kind, client, c.keys.Add(1))
		}
		status, body, known := c.send(client, in.Tenant, "aggregate", http.MethodPost, "/commands", map[string]any{"aggregate_type": "account",
			"aggregate_id": in.Account, "command": in.Kind, "payload": map[string]int64{"amount": in.Amount}, "idempotency_key": in.Key})
		out.OK = status == http.StatusCreated || status == http.StatusOK
		rejected := status == http.StatusConflict && bytes.Contains(body, []byte(`/problems/rejected"`))
		out.Known = known && (out.OK || rejected)
		switch {
		case rejected && in.Kind == Withdraw:
		case known && !out.OK:
			c.fail("%s %s %s/%s %d (%s): %d %s", in.Tenant, in.Kind, in.Tenant, in.Account, in.Amount, in.Key, status, bytes.TrimSpace(body))
		}
	case Read:
		status, body, known := c.send(client, in.Tenant, "aggregate", http.MethodGet, "/aggregates/account/"+in.Account, nil)
		var acc struct{ Balance int64 }
		out.Known = known && status == http.StatusOK && json.Unmarshal(body, &acc) == nil
		out.Balance, out.OK = acc.Balance, out.Known
		if known && !out.Known {
			c.fail("%s read %s: %d %s", in.Tenant, in.Account, status, bytes.TrimSpace(body))
		}
	}
	c.Rec.Record(client, in, out, call, time.Now())
	return out
}

// Call sends one request of another kind of service (a query, a job) with the same retries,
// unrecorded: a final answer that is not 2xx is a failure.
func (c *Client) Call(client int, tenant, kind, method, path string, body any) (int, []byte) {
	status, b, known := c.send(client, tenant, kind, method, path, body)
	if known && status >= 300 {
		c.fail("%s %s %s: %d %s", tenant, method, path, status, bytes.TrimSpace(b))
	}
	return status, b
}

// send sends one request until a final answer or the budget; known reports whether a final
// answer came (any status but a 503 or 429 with Retry-After, or a transport error).
func (c *Client) send(client int, tenant, kind, method, path string, body any) (status int, out []byte, known bool) {
	budget, pause := c.Budget, c.RetryPause
	if budget <= 0 {
		budget = 45 * time.Second
	}
	if pause <= 0 {
		pause = 100 * time.Millisecond
	}
	var raw []byte
	key := ""
	if body != nil {
		raw, _ = json.Marshal(body)
		if m, ok := body.(map[string]any); ok {
			key, _ = m["idempotency_key"].(string)
		}
	}
	began := time.Now()
	deadline := began.Add(budget)
	gw := client
	last := ""
	attempts := 0
	if c.Slow > 0 && c.Logf != nil {
		defer func() {
			if took := time.Since(began); took > c.Slow {
				c.Logf("slow: %s %s %s %s took %s over %d attempts (final %d; last retried: %s)", tenant, kind, method, path,
					took.Round(time.Millisecond), attempts, status, last)
			}
		}()
	}
	for attempt := 0; time.Now().Before(deadline) && attempt < 2000; attempt++ {
		attempts = attempt + 1
		for i := 0; c.Out != nil && i < len(c.Gateways) && c.Out(c.Gateways[gw%len(c.Gateways)]); i++ {
			gw++
		}
		req, _ := http.NewRequest(method, c.Gateways[gw%len(c.Gateways)]+path, bytes.NewReader(raw))
		req.Header.Set("x-tenant-id", tenant)
		req.Header.Set("content-type", "application/json")
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		if c.Authorize != nil {
			c.Authorize(req, tenant)
		}
		sent := time.Now()
		resp, err := c.HTTP.Do(req)
		if err != nil {
			last = err.Error()
			gw++
			time.Sleep(pause) // another gateway, after a pause
			continue
		}
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
		if c.OnAnswer != nil {
			c.OnAnswer(tenant, kind, resp.StatusCode < 300, sent, time.Now())
		}
		if (resp.StatusCode == http.StatusServiceUnavailable || resp.StatusCode == http.StatusTooManyRequests) && resp.Header.Get("Retry-After") != "" {
			last = fmt.Sprintf("503 %s", bytes.TrimSpace(b))
			time.Sleep(pause) // the server asked for a retry
			continue
		}
		return resp.StatusCode, b, true // judged by the caller
	}
	c.fail("%s %s %s: no answer within %s: %s", tenant, method, path, budget, last)
	return 0, nil, false
}
