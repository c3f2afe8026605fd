package aggregate

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/tenantmesh/tenantmesh/services/ledger"
)

// The ledger is the aggregate service's domain: accounts that are opened, credited, debited
// (never below zero) and closed (only when empty). It makes loss visible: for every tenant,
// the sum of deposits minus the sum of withdrawals equals the sum of the balances.

// AccountType is the only aggregate type of the ledger (package ledger holds the event
// contract the projection and runner read).
const AccountType = ledger.AccountType

// Commands.
const (
	CmdOpen     = "open"
	CmdDeposit  = "deposit"
	CmdWithdraw = "withdraw"
	CmdClose    = "close"
)

// Events (the "event" field of an Event).
const (
	EvOpened    = ledger.EvOpened
	EvDeposited = ledger.EvDeposited
	EvWithdrawn = ledger.EvWithdrawn
	EvClosed    = ledger.EvClosed
)

// MaxAmount bounds one deposit or withdrawal (in minor units).
const MaxAmount = 1_000_000_000_000

// Domain errors, mapped to HTTP in one place (httpError).
var (
	ErrUnknownCommand   = errors.New("unknown command")
	ErrBadPayload       = errors.New("bad payload")
	ErrNoAccount        = errors.New("no such account")
	ErrAccountExists    = errors.New("account already open")
	ErrAccountClosed    = errors.New("account closed")
	ErrInsufficient     = errors.New("insufficient funds")
	ErrNotEmpty         = errors.New("account not empty")
	ErrVersionConflict  = errors.New("version conflict")
	ErrUnknownAggregate = errors.New("unknown aggregate type")
)

// Command is what a client asks for (POST /commands).
type Command struct {
	AggregateType   string          `json:"aggregate_type"`
	AggregateID     string          `json:"aggregate_id"`
	Command         string          `json:"command"`
	Payload         json.RawMessage `json:"payload,omitempty"`
	ExpectedVersion *uint64         `json:"expected_version,omitempty"`
	IdempotencyKey  string          `json:"idempotency_key"`
}

// Event is one stored fact (ledger.Event).
type Event = ledger.Event

type amountPayload struct {
	Amount int64 `json:"amount"`
}

type openPayload struct {
	Owner string `json:"owner"`
}

// Account is one aggregate's state.
type Account struct {
	ID      string `json:"id"`
	Owner   string `json:"owner,omitempty"`
	Balance int64  `json:"balance"`
	Closed  bool   `json:"closed,omitempty"`
	// Version is the number of events applied; LastSeq the stream sequence of the last one.
	Version uint64 `json:"version"`
	LastSeq uint64 `json:"last_seq"`
}

// Totals are a tenant's ledger figures; Deposits - Withdrawals == Balances always.
type Totals struct {
	Accounts    int   `json:"accounts"`
	Deposits    int64 `json:"deposits"`
	Withdrawals int64 `json:"withdrawals"`
	Balances    int64 `json:"balances"`
}

// decide validates cmd against the account (nil if it does not exist) and returns the event to
// append, without its version or sequence.
func decide(acc *Account, cmd Command) (Event, error) {
	if cmd.AggregateType != AccountType {
		return Event{}, fmt.Errorf("%w %q: the ledger has only %q", ErrUnknownAggregate, cmd.AggregateType, AccountType)
	}
	if cmd.ExpectedVersion != nil {
		var have uint64
		if acc != nil {
			have = acc.Version
		}
		if *cmd.ExpectedVersion != have {
			return Event{}, fmt.Errorf("%w: expected version %d, the account is at %d", ErrVersionConflict, *cmd.ExpectedVersion, have)
		}
	}
	ev := Event{AggregateType: cmd.AggregateType, AggregateID: cmd.AggregateID, CommandKey: cmd.IdempotencyKey}
	switch cmd.Command {
	case CmdOpen:
		if acc != nil {
			return Event{}, fmt.Errorf("%w: %s", ErrAccountExists, cmd.AggregateID)
		}
		var p openPayload
		if len(cmd.Payload) > 0 {
			if err := json.Unmarshal(cmd.Payload, &p); err != nil || len(p.Owner) > 200 {
				return Event{}, fmt.Errorf("%w: open takes {\"owner\": string of at most 200 bytes}", ErrBadPayload)
			}
		}
		ev.Event = EvOpened
		ev.Data, _ = json.Marshal(p)
	case CmdDeposit, CmdWithdraw:
		if acc == nil {
			return Event{}, fmt.Errorf("%w: %s; open it first", ErrNoAccount, cmd.AggregateID)
		}
		if acc.Closed {
			return Event{}, fmt.Errorf("%w: %s", ErrAccountClosed, cmd.AggregateID)
		}
		var p amountPayload
		if err := json.Unmarshal(cmd.Payload, &p); err != nil || p.Amount <= 0 || p.Amount > MaxAmount {
			return Event{}, fmt.Errorf("%w: %s takes {\"amount\": integer from 1 to %d}", ErrBadPayload, cmd.Command, int64(MaxAmount))
		}
		if cmd.Command == CmdWithdraw && p.Amount > acc.Balance {
			return Event{}, fmt.Errorf("%w: balance %d, withdrawal %d", ErrInsufficient, acc.Balance, p.Amount)
		}
		ev.Event = EvDeposited
		if cmd.Command == CmdWithdraw {
			ev.Event = EvWithdrawn
		}
		ev.Data, _ = json.Marshal(p)
	case CmdClose:
		if acc == nil {
			return Event{}, fmt.Errorf("%w: %s", ErrNoAccount, cmd.AggregateID)
		}
		if acc.Closed {
			return Event{}, fmt.Errorf("%w: %s", ErrAccountClosed, cmd.AggregateID)
		}
		if acc.Balance != 0 {
			return Event{}, fmt.Errorf("%w: balance is %d; withdraw it first", ErrNotEmpty, acc.Balance)
		}
		ev.Event = EvClosed
	default:
		return Event{}, fmt.Errorf("%w %q: use open, deposit, withdraw or close", ErrUnknownCommand, cmd.Command)
	}
	return ev, nil
}

// evolve applies ev to acc (nil for a new account) and the totals, returning the new state.
// It trusts the event: events are facts.
func evolve(acc *Account, ev Event, t *Totals) *Account {
	if acc == nil {
		acc = &Account{ID: ev.AggregateID}
		t.Accounts++
	}
	switch ev.Event {
	case EvOpened:
		var p openPayload
		_ = json.Unmarshal(ev.Data, &p)
		acc.Owner = p.Owner
	case EvDeposited:
		var p amountPayload
		_ = json.Unmarshal(ev.Data, &p)
		acc.Balance += p.Amount
		t.Deposits += p.Amount
		t.Balances += p.Amount
	case EvWithdrawn:
		var p amountPayload
		_ = json.Unmarshal(ev.Data, &p)
		acc.Balance -= p.Amount
		t.Withdrawals += p.Amount
		t.Balances -= p.Amount
	case EvClosed:
		acc.Closed = true
	}
	acc.Version = ev.Version
	acc.LastSeq = ev.Seq
	return acc
}
