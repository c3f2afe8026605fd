// Package ledgertest holds the test helpers that drive the aggregate's ledger: a command, and a
// writer that keeps commands coming while a test moves a tenant. It is for tests: the
// projection's (package projection, which may import it: it does not import the projection) and
// test/components'.
package ledgertest

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/services/aggregate"
)

// Command is the ledger command name on account with idempotency key key; amount, if above 0,
// is its payload's.
func Command(account, name string, amount int64, key string) aggregate.Command {
	c := aggregate.Command{AggregateType: aggregate.AccountType, AggregateID: account, Command: name, IdempotencyKey: key}
	if amount > 0 {
		c.Payload, _ = json.Marshal(map[string]int64{"amount": amount})
	}
	return c
}

// Writer runs ledger commands for tenant on a (8 accounts opened, then deposits and
// withdrawals, keyed by tenant and count) until stop closes; after each it sends its count on
// progress when someone listens. The returned channel closes when it has stopped. A failed open
// or deposit fails the test and stops it; a withdrawal may be refused (the account is short).
func Writer(t testing.TB, a *aggregate.Service, tenant string, stop <-chan struct{}, progress chan<- int) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 8 {
			if _, err := a.Handle(context.Background(), tenant, Command(fmt.Sprintf("acc%d", i), aggregate.CmdOpen, 0, fmt.Sprintf("%s-open-%d", tenant, i))); err != nil {
				t.Errorf("open: %v", err)
				return
			}
		}
		for n := 1; ; n++ {
			select {
			case <-stop:
				return
			default:
			}
			c := Command(fmt.Sprintf("acc%d", n%8), aggregate.CmdDeposit, int64(n%97+1), fmt.Sprintf("%s-%d", tenant, n))
			if n%4 == 0 {
				c = Command(fmt.Sprintf("acc%d", (n+1)%8), aggregate.CmdWithdraw, int64(n%13+1), fmt.Sprintf("%s-%d", tenant, n))
			}
			if _, err := a.Handle(context.Background(), tenant, c); err != nil && c.Command == aggregate.CmdDeposit {
				t.Errorf("deposit: %v", err)
				return
			}
			select {
			case progress <- n:
			default:
			}
		}
	}()
	return done
}

// WaitProgress waits (up to 20 s) until the writer reports at least atLeast commands.
func WaitProgress(t testing.TB, progress <-chan int, atLeast int) {
	t.Helper()
	deadline := time.After(20 * time.Second)
	for {
		select {
		case n := <-progress:
			if n >= atLeast {
				return
			}
		case <-deadline:
			t.Fatalf("the writer did not reach %d commands in 20s", atLeast)
		}
	}
}
