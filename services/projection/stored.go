package projection

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"
)

// A tenant's stored views are objects in tm_projection_views:
//
//	<tenant>        the head: applied sequence, accounts, how many transactions there are
//	<tenant>/tx/<n> transactions n*txPageRows up to (n+1)*txPageRows, in stream order
//
// Transactions are append-only, so a full page never changes again: a store writes the pages
// from the last partial one on, then the head. The head is the commit point: a load reads the
// head, then its pages, and takes the first tx_count rows, so pages written by a store that
// stopped before its head are ignored, and a page rewritten later holds the same rows below the
// head's count (every owner builds them from the same stream, in order). A tenant's stored
// views once were one object holding every transaction, rewritten whole each time: in a long
// run that was megabytes per tenant every 10 s, and NATS's memory and the projection's CPU grew
// with the run (2026-11-26).

// txPageRows is how many transactions one page holds (about 110 KiB of JSON).
const txPageRows = 1024

// loadWorkers bounds the pages a load reads at once.
const loadWorkers = 8

// storedHead is the object <tenant>.
type storedHead struct {
	Tenant   string        `json:"tenant"`
	Applied  uint64        `json:"applied"`
	Accounts []*AccountRow `json:"accounts"`
	TxCount  int           `json:"tx_count"`
	PageRows int           `json:"page_rows"`
	// Transactions holds every transaction in views stored as one object, before pages: read
	// (so views stored then still load), never written.
	Transactions []TxRow `json:"transactions,omitempty"`
}

// storedViews is what a tenant's stored views hold: the first tx transactions, in pages of
// the sizes in bytes, and a head of head bytes.
type storedViews struct {
	tx    int
	head  int
	pages []int
}

// size is the stored views' size in bytes.
func (v storedViews) size() int {
	n := v.head
	for _, b := range v.pages {
		n += b
	}
	return n
}

// loaded is a tenant's stored views as loaded.
type loaded struct {
	snapshot
	stored storedViews
}

func pageName(tenant string, page int) string { return tenant + "/tx/" + strconv.Itoa(page) }

// save stores snap, given that prev is stored already: the pages from the last partial one of
// prev on, then the head, then the tenant's checkpoint. It returns what is stored and how many
// bytes it wrote.
func (s *store) save(ctx context.Context, snap snapshot, prev storedViews) (next storedViews, wrote int, err error) {
	n := len(snap.Transactions)
	first := min(prev.tx, n) / txPageRows
	if first > len(prev.pages) { // prev's sizes do not reach its count: rewrite them
		first = 0
	}
	next = storedViews{tx: n, pages: prev.pages[:first:first]}
	for p := first; p*txPageRows < n; p++ {
		b, err := json.Marshal(snap.Transactions[p*txPageRows : min((p+1)*txPageRows, n)])
		if err != nil {
			return prev, wrote, fmt.Errorf("projection: encode views of %s: %w", snap.Tenant, err)
		}
		if _, err := s.views.PutBytes(ctx, pageName(snap.Tenant, p), b); err != nil {
			return prev, wrote, fmt.Errorf("projection: store views of %s (transactions page %d): %w", snap.Tenant, p, err)
		}
		next.pages = append(next.pages, len(b))
		wrote += len(b)
	}
	head, err := json.Marshal(storedHead{Tenant: snap.Tenant, Applied: snap.Applied, Accounts: snap.Accounts, TxCount: n, PageRows: txPageRows})
	if err != nil {
		return prev, wrote, fmt.Errorf("projection: encode views of %s: %w", snap.Tenant, err)
	}
	if _, err := s.views.PutBytes(ctx, snap.Tenant, head); err != nil {
		return prev, wrote, fmt.Errorf("projection: store views of %s: %w", snap.Tenant, err)
	}
	next.head = len(head)
	wrote += len(head)
	cp, _ := json.Marshal(Checkpoint{Tenant: snap.Tenant, Applied: snap.Applied, Bytes: next.size(), At: time.Now().UTC()})
	if _, err := s.checks.Put(ctx, snap.Tenant, cp); err != nil {
		return next, wrote, fmt.Errorf("projection: store checkpoint of %s: %w", snap.Tenant, err)
	}
	return next, wrote, nil
}

// load returns the tenant's stored views, or nil if it has none.
func (s *store) load(ctx context.Context, tenant string) (*loaded, error) {
	b, err := s.views.GetBytes(ctx, tenant)
	if errors.Is(err, jetstream.ErrObjectNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("projection: load views of %s: %w", tenant, err)
	}
	var h storedHead
	if err := json.Unmarshal(b, &h); err != nil || h.Tenant != tenant {
		return nil, fmt.Errorf("projection: stored views of %s are corrupt: %v", tenant, err)
	}
	l := &loaded{snapshot: snapshot{Tenant: tenant, Applied: h.Applied, Accounts: h.Accounts}, stored: storedViews{head: len(b)}}
	if h.PageRows == 0 { // stored as one object: the next store writes every page
		l.Transactions = h.Transactions
		return l, nil
	}
	if h.TxCount < 0 {
		return nil, fmt.Errorf("projection: stored views of %s are corrupt: %d transactions", tenant, h.TxCount)
	}
	pages := (h.TxCount + h.PageRows - 1) / h.PageRows
	rows := make([][]TxRow, pages)
	sizes := make([]int, pages)
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(loadWorkers)
	for p := range pages {
		g.Go(func() error {
			b, err := s.views.GetBytes(gctx, pageName(tenant, p))
			if err != nil {
				return fmt.Errorf("projection: load views of %s (transactions page %d): %w", tenant, p, err)
			}
			want := min(h.PageRows, h.TxCount-p*h.PageRows)
			if err := json.Unmarshal(b, &rows[p]); err != nil || len(rows[p]) < want {
				return fmt.Errorf("projection: stored views of %s are corrupt: transactions page %d has %d of %d rows (%v)", tenant, p, len(rows[p]), want, err)
			}
			rows[p], sizes[p] = rows[p][:want], len(b)
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	l.Transactions = make([]TxRow, 0, h.TxCount)
	for p, r := range rows {
		if len(r) > 0 && len(l.Transactions) > 0 && r[0].Seq <= l.Transactions[len(l.Transactions)-1].Seq {
			return nil, fmt.Errorf("projection: stored views of %s are corrupt: transactions page %d is out of order", tenant, p)
		}
		l.Transactions = append(l.Transactions, r...)
	}
	l.stored.pages = sizes
	if h.PageRows == txPageRows { // the next store rewrites only the last page on
		l.stored.tx = h.TxCount
	}
	return l, nil
}
