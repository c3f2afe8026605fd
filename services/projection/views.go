package projection

import (
	"encoding/json"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tenantmesh/tenantmesh/services/ledger"
)

// AccountRow is one row of the "accounts" view.
type AccountRow struct {
	ID      string `json:"id"`
	Owner   string `json:"owner"`
	Balance int64  `json:"balance"`
	Closed  bool   `json:"closed"`
	// Version is the account's event count; LastSeq the stream sequence of its last event.
	Version   uint64    `json:"version"`
	LastSeq   uint64    `json:"last_seq"`
	OpenedAt  time.Time `json:"opened_at"`
	UpdatedAt time.Time `json:"updated_at"`
}

// TxRow is one row of the "transactions" view: a deposit or a withdrawal.
type TxRow struct {
	Seq     uint64    `json:"seq"`
	Account string    `json:"account"`
	Kind    string    `json:"kind"` // deposit or withdraw
	Amount  int64     `json:"amount"`
	At      time.Time `json:"at"`
}

// Transaction kinds.
const (
	TxDeposit  = "deposit"
	TxWithdraw = "withdraw"
)

// tenantPhase is where a tenant's views stand on this instance.
type tenantPhase int

const (
	phaseLoading tenantPhase = iota // loading its snapshot and catching up from the stream
	phaseLive                       // applied by the shared tail consumer
	phaseDropped                    // released: no longer consumed
)

// tenantState holds one tenant's views and its applied sequence.
type tenantState struct {
	tenant string
	// caught is closed once the tenant's first catch-up finished (or failed: see err).
	caught chan struct{}

	mu    sync.RWMutex
	phase tenantPhase
	err   error
	// refused is why the views stopped: an event in a newer format than this binary reads
	// (jsx.ErrNewerFormat). Nothing after it is applied; queries are answered 503 until an
	// upgraded instance serves the tenant.
	refused  error
	applied  uint64 // stream sequence of the last event applied
	accounts map[string]*AccountRow
	txs      []TxRow // in stream order
	// flushed is the applied sequence of the last stored snapshot; since counts events after it.
	flushed uint64
	since   int
	waiters []waiter
	// stored is what the tenant's stored views hold (as last loaded or stored): which pages a
	// store need not write again.
	stored storedViews
	// viewBytes is the size of the tenant's stored views (last loaded or stored).
	viewBytes atomic.Uint64
	// dig is the views' digest, kept as rows change, and its history while the tenant moves
	// (digest.go).
	dig viewDigest
}

type waiter struct {
	seq uint64
	ch  chan struct{}
}

func newTenantState(tenant string) *tenantState {
	return &tenantState{tenant: tenant, caught: make(chan struct{}), accounts: map[string]*AccountRow{}}
}

// apply applies ev (with ev.Seq > ts.applied) to the views. The caller holds ts.mu.
func (ts *tenantState) apply(ev ledger.Event) {
	if ev.AggregateType == ledger.AccountType {
		ts.applyAccount(ev)
	}
	ts.advance(ev.Seq)
}

// advance records seq as applied and wakes the waiters it satisfies. The caller holds ts.mu.
func (ts *tenantState) advance(seq uint64) {
	if seq <= ts.applied {
		return
	}
	ts.applied = seq
	ts.since++
	ts.dig.advanced(seq)
	if len(ts.waiters) == 0 {
		return
	}
	kept := ts.waiters[:0]
	for _, w := range ts.waiters {
		if w.seq <= seq {
			close(w.ch)
		} else {
			kept = append(kept, w)
		}
	}
	ts.waiters = kept
}

func (ts *tenantState) applyAccount(ev ledger.Event) {
	acc := ts.accounts[ev.AggregateID]
	if acc == nil {
		acc = &AccountRow{ID: ev.AggregateID, OpenedAt: ev.At}
		ts.accounts[ev.AggregateID] = acc
	} else {
		ts.dig.removeAccount(acc)
	}
	var p struct {
		Amount int64  `json:"amount"`
		Owner  string `json:"owner"`
	}
	if len(ev.Data) > 0 {
		_ = json.Unmarshal(ev.Data, &p) // events are facts: a field that does not parse is zero
	}
	switch ev.Event {
	case ledger.EvOpened:
		acc.Owner, acc.OpenedAt = p.Owner, ev.At
	case ledger.EvDeposited:
		acc.Balance += p.Amount
		ts.addTx(TxRow{Seq: ev.Seq, Account: ev.AggregateID, Kind: TxDeposit, Amount: p.Amount, At: ev.At})
	case ledger.EvWithdrawn:
		acc.Balance -= p.Amount
		ts.addTx(TxRow{Seq: ev.Seq, Account: ev.AggregateID, Kind: TxWithdraw, Amount: p.Amount, At: ev.At})
	case ledger.EvClosed:
		acc.Closed = true
	}
	acc.Version, acc.LastSeq, acc.UpdatedAt = ev.Version, ev.Seq, ev.At
	ts.dig.addAccount(acc)
}

// addTx appends a row to the transactions view.
func (ts *tenantState) addTx(tx TxRow) {
	ts.txs = append(ts.txs, tx)
	ts.dig.addTx(&ts.txs[len(ts.txs)-1])
}

// waitApplied returns a channel closed once the tenant's applied sequence reaches seq.
func (ts *tenantState) waitApplied(seq uint64) <-chan struct{} {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	ch := make(chan struct{})
	if ts.applied >= seq {
		close(ch)
		return ch
	}
	ts.waiters = append(ts.waiters, waiter{seq: seq, ch: ch})
	return ch
}

// snapshot is a tenant's views at one applied sequence: the unit that is stored, so views and
// checkpoint are always consistent (stored.go has how: pages of transactions and a head).
type snapshot struct {
	Tenant       string
	Applied      uint64
	Accounts     []*AccountRow
	Transactions []TxRow
}

// views copies the tenant's views for encoding, in O(accounts): the accounts' rows (apply
// changes them in place) and the transactions' slice as it stands (append-only: the rows below
// its length never change again). The caller holds ts.mu (read) and encodes after releasing
// it: marshalling every transaction under the lock held the tenant's tail, and with it every
// tenant that tail applies, for as long as the encoding took, which grows with the views (tens
// of milliseconds late in a 1,000-move run, a move's target among the tenants held).
func (ts *tenantState) views() snapshot {
	rows := make([]AccountRow, 0, len(ts.accounts))
	for _, a := range ts.accounts {
		rows = append(rows, *a)
	}
	s := snapshot{Tenant: ts.tenant, Applied: ts.applied, Accounts: make([]*AccountRow, len(rows)),
		Transactions: ts.txs[:len(ts.txs):len(ts.txs)]}
	for i := range rows {
		s.Accounts[i] = &rows[i]
	}
	return s
}

// restore loads l into an empty tenant state.
func (ts *tenantState) restore(l *loaded) {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	for _, a := range l.Accounts {
		ts.accounts[a.ID] = a
	}
	ts.txs = l.Transactions
	ts.applied, ts.flushed = l.Applied, l.Applied
	ts.dig.reset(ts)
	ts.stored = l.stored
	ts.viewBytes.Store(uint64(l.stored.size()))
}
