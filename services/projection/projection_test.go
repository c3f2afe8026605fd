package projection

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/services/aggregate"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

func openStore(t testing.TB) *schema.Store {
	st, _ := kittest.Store(t)
	return st
}

// newService starts a projection service; the returned stop ends its Run (storing every
// changed tenant's views) and is also called at cleanup.
func newService(t testing.TB, st *schema.Store, cfg Config) (*Service, func()) {
	t.Helper()
	cfg.Store = st
	s, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Run(ctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			select {
			case <-done:
			case <-time.After(30 * time.Second):
				t.Error("projection service did not stop within 30s")
			}
		})
	}
	t.Cleanup(stop)
	return s, stop
}

func newAggregate(t testing.TB, st *schema.Store) *aggregate.Service {
	t.Helper()
	a, err := aggregate.New(context.Background(), aggregate.Config{Store: st})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = a.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return a
}

var keys atomic.Int64

func command(id, name string, amount int64) aggregate.Command {
	c := aggregate.Command{AggregateType: aggregate.AccountType, AggregateID: id, Command: name,
		IdempotencyKey: fmt.Sprintf("k%d", keys.Add(1))}
	switch {
	case amount > 0:
		c.Payload = json.RawMessage(fmt.Sprintf(`{"amount":%d}`, amount))
	case name == aggregate.CmdOpen:
		c.Payload = json.RawMessage(fmt.Sprintf(`{"owner":"owner-of-%s"}`, id))
	}
	return c
}

func do(t testing.TB, a *aggregate.Service, tenant string, c aggregate.Command) aggregate.Result {
	t.Helper()
	r, err := a.Handle(context.Background(), tenant, c)
	if err != nil {
		t.Fatalf("%s %s %s: %v", tenant, c.Command, c.AggregateID, err)
	}
	return r
}

// warm waits (with a deadline) until s has applied tenant's events up to seq (0: its last).
func warm(t testing.TB, s *Service, tenant string, seq uint64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := s.Warm(ctx, tenant, seq); err != nil {
		t.Fatalf("warm %s to %d: %v", tenant, seq, err)
	}
}

func query(t testing.TB, s *Service, tenant, view string, q Query) Result {
	t.Helper()
	res, err := s.Query(context.Background(), tenant, view, q)
	if err != nil {
		t.Fatalf("query %s %s: %v", tenant, view, err)
	}
	return res
}

// all reads a whole view, page by page, checking that pages neither skip nor repeat rows.
func all[T any](t testing.TB, s *Service, tenant, view string, q Query) []T {
	t.Helper()
	var out []T
	for page := 0; ; page++ {
		res := query(t, s, tenant, view, q)
		for _, it := range res.Items {
			out = append(out, it.(T))
		}
		if res.NextCursor == "" {
			return out
		}
		if page > 10000 {
			t.Fatal("pagination does not end")
		}
		q.Cursor = res.NextCursor
	}
}

// burst runs concurrent ledger commands on tenant: opens, deposits, withdrawals (some rejected
// for want of funds) and a close. It signals half once half the commands are done.
func burst(t *testing.T, a *aggregate.Service, tenant string, accounts, workers, each int, half chan<- struct{}) {
	for i := range accounts {
		do(t, a, tenant, command(fmt.Sprintf("acc%02d", i), aggregate.CmdOpen, 0))
	}
	var n atomic.Int64
	var once sync.Once
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(w), 7))
			for j := range each {
				id := fmt.Sprintf("acc%02d", r.IntN(accounts))
				c := command(id, aggregate.CmdDeposit, int64(r.IntN(500)+1))
				if j%3 == 2 {
					c = command(id, aggregate.CmdWithdraw, int64(r.IntN(400)+1))
				}
				if _, err := a.Handle(context.Background(), tenant, c); err != nil && c.Command == aggregate.CmdDeposit {
					t.Errorf("deposit: %v", err)
				}
				if n.Add(1) == int64(workers*each/2) && half != nil {
					once.Do(func() { close(half) })
				}
			}
		})
	}
	wg.Wait()
	// Empty and close one account, so every event kind occurs.
	acc, err := a.Account(context.Background(), tenant, "acc00")
	if err != nil {
		t.Fatal(err)
	}
	if acc.Balance > 0 {
		do(t, a, tenant, command("acc00", aggregate.CmdWithdraw, acc.Balance))
	}
	do(t, a, tenant, command("acc00", aggregate.CmdClose, 0))
}

// sameAsAggregate checks the projection's views of tenant against the aggregate's state.
func sameAsAggregate(t *testing.T, a *aggregate.Service, s *Service, tenant string) {
	t.Helper()
	ctx := context.Background()
	tot, last, err := a.Totals(ctx, tenant)
	if err != nil {
		t.Fatal(err)
	}
	warm(t, s, tenant, last)
	rows := all[AccountRow](t, s, tenant, "accounts", Query{Limit: 7})
	if len(rows) != tot.Accounts {
		t.Fatalf("%s: %d account rows, the aggregate has %d accounts", tenant, len(rows), tot.Accounts)
	}
	var balances int64
	for _, row := range rows {
		acc, err := a.Account(ctx, tenant, row.ID)
		if err != nil {
			t.Fatal(err)
		}
		if row.Balance != acc.Balance || row.Owner != acc.Owner || row.Closed != acc.Closed || row.Version != acc.Version || row.LastSeq != acc.LastSeq {
			t.Fatalf("%s: view row %+v, aggregate account %+v", tenant, row, acc)
		}
		balances += row.Balance
	}
	txs := all[TxRow](t, s, tenant, "transactions", Query{Limit: MaxLimit})
	var dep, wd int64
	for i, tx := range txs {
		if i > 0 && tx.Seq <= txs[i-1].Seq {
			t.Fatalf("%s: transactions out of order or repeated at %d: %d after %d", tenant, i, tx.Seq, txs[i-1].Seq)
		}
		if tx.Kind == TxDeposit {
			dep += tx.Amount
		} else {
			wd += tx.Amount
		}
	}
	got := aggregate.Totals{Accounts: len(rows), Deposits: dep, Withdrawals: wd, Balances: balances}
	want := tot
	if got != want {
		t.Fatalf("%s: view totals %+v, aggregate totals %+v", tenant, got, want)
	}
	if s.Applied(tenant) != last || s.Lag(tenant) != 0 {
		t.Fatalf("%s: applied %d lag %d, want %d and 0", tenant, s.Applied(tenant), s.Lag(tenant), last)
	}
}

// TestViewsEqualAggregateState: after a burst of concurrent commands on several tenants, the
// views equal the aggregate's state, whether the tenant was hosted before the burst (tail
// consumer), added in the middle of it (catch-up, then a switch to the tail under load) or added
// after it (catch-up only); another tenant's events never leak in.
// The small config spreads tenants over three tail consumers and makes them switch between
// filter subjects and events.> as they fall behind and catch up, and batches catch-ups; with
// events.> the tail reads every event and tenants join without a new consumer.
func TestViewsEqualAggregateState(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"defaults", Config{}},
		{"small", Config{TailPartitions: 3, MaxFilters: 2, FilterBacklog: 20, CatchUpBatch: 2, TailBatch: 16}},
		{"events.>", Config{MaxFilters: 1, CatchUpBatch: 1}},
	} {
		t.Run(tc.name, func(t *testing.T) { testViewsEqualAggregateState(t, tc.cfg) })
	}
}

func testViewsEqualAggregateState(t *testing.T, cfg Config) {
	st := openStore(t)
	a := newAggregate(t, st)
	s, _ := newService(t, st, cfg)
	warm(t, s, "acme", 0)
	warm(t, s, "globex", 0)
	half := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { burst(t, a, "acme", 12, 6, 60, nil) })
	wg.Go(func() { burst(t, a, "globex", 8, 4, 50, nil) })
	wg.Go(func() { burst(t, a, "hooli", 10, 6, 80, half) })
	wg.Go(func() { burst(t, a, "initech", 5, 2, 40, nil) })
	<-half
	warm(t, s, "hooli", 0) // joins while hooli's commands keep coming
	wg.Wait()
	if t.Failed() {
		return
	}
	warm(t, s, "initech", 0)
	for _, tenant := range []string{"acme", "globex", "hooli", "initech"} {
		sameAsAggregate(t, a, s, tenant)
	}
	if got := s.Tenants(); !slices.Equal(got, []string{"acme", "globex", "hooli", "initech"}) {
		t.Fatalf("hosted %v", got)
	}
}
