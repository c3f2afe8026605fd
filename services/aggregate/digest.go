package aggregate

import (
	"strings"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// AppendSubject is the ledger's part of a move's state digest for one subject (shardkit/events'
// Digester): the account's fields, so a target whose accounts differ from the source's at the
// fence is caught however it came to differ (a corrupt snapshot, a skipped event).
func (st *ledgerState) AppendSubject(e schema.RowEncoder, subject string) schema.RowEncoder {
	a := st.Accounts[strings.TrimPrefix(subject, AccountType+".")]
	if a == nil {
		return e.Bool(false)
	}
	return e.Bool(true).String(a.ID).String(a.Owner).Int(a.Balance).Bool(a.Closed).Uint(a.Version).Uint(a.LastSeq)
}

// AppendRest is the ledger's state that belongs to no account: the account count and totals.
func (st *ledgerState) AppendRest(e schema.RowEncoder) schema.RowEncoder {
	t := st.Totals
	return e.Int(int64(len(st.Accounts))).Int(int64(t.Accounts)).Int(t.Deposits).Int(t.Withdrawals).Int(t.Balances)
}
