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
//	<tenant>/tx/<n> page n: transactions n*txPageRows up to (n+1)*txPageRows, in stream order
//	<tenant>        the head: applied sequence, accounts, how many full pages there are, and
//	                the transactions after them (fewer than a page)
//
// Transactions are append-only and every owner builds them from the same stream in order, so a
// full page's rows never change: a page is written once it is full, by whichever instance
// stores first, and any later write of it holds the same rows. A store writes the pages that
// became full since its last store, then the head; the head is the commit point. A load reads
// the head, then the pages it names. So a load never sees a page half as long as its head says
// (pages are never written partial: two instances of a shard storing one tenant at once cannot
// shorten a page under the other's head), and pages a store wrote before it stopped short of
// its head are ignored. A tenant's stored views once were one object holding every transaction,
// rewritten whole at every store: in a long run, megabytes per tenant every 10 s, and NATS's
// memory and the projection's CPU grew with the run (2026-11-26). Those objects are heads with
// no pages, and load as such.

// txPageRows is how many transactions one page holds (about 110 KiB of JSON).
const txPageRows = 1024

// loadWorkers bounds the pages a load reads at once.
const loadWorkers = 8

// storedHead is the object <tenant>.
type storedHead struct {
	Tenant   string        `json:"tenant"`
	Applied  uint64        `json:"applied"`
	Accounts []*AccountRow `json:"accounts"`
	// Pages is how many full pages of PageRows transactions come first.
	Pages    int `json:"pages,omitempty"`
	PageRows int `json:"page_rows,omitempty"`
	// Transactions are the ones after the pages.
	Transactions []TxRow `json:"transactions"`
}

// storedViews is what a tenant's stored views hold: pages full pages, of the sizes in bytes,
// and a head of head bytes.
type storedViews struct {
	pages []int
	head  int
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

// save stores snap, given that prev is stored already: the pages that became full since, then
// the head, then the tenant's checkpoint. It returns what is stored and how many bytes it
// wrote.
func (s *store) save(ctx context.Context, snap snapshot, prev storedViews) (next storedViews, wrote int, err error) {
	full := len(snap.Transactions) / txPageRows
	first := min(len(prev.pages), full)
	next = storedViews{pages: prev.pages[:first:first]}
	for p := first; p < full; p++ {
		b, err := json.Marshal(snap.Transactions[p*txPageRows : (p+1)*txPageRows])
		if err != nil {
			return prev, wrote, fmt.Errorf("projection: encode views of %s: %w", snap.Tenant, err)
		}
		if _, err := s.views.PutBytes(ctx, pageName(snap.Tenant, p), b); err != nil {
			return prev, wrote, fmt.Errorf("projection: store views of %s (transactions page %d): %w", snap.Tenant, p, err)
		}
		next.pages = append(next.pages, len(b))
		wrote += len(b)
	}
	head, err := json.Marshal(storedHead{Tenant: snap.Tenant, Applied: snap.Applied, Accounts: snap.Accounts,
		Pages: full, PageRows: txPageRows, Transactions: snap.Transactions[full*txPageRows:]})
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
	if h.Pages < 0 || h.Pages > 0 && h.PageRows <= 0 {
		return nil, fmt.Errorf("projection: stored views of %s are corrupt: %d pages of %d transactions", tenant, h.Pages, h.PageRows)
	}
	rows := make([][]TxRow, h.Pages+1)
	sizes := make([]int, h.Pages)
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(loadWorkers)
	for p := range h.Pages {
		g.Go(func() error {
			b, err := s.views.GetBytes(gctx, pageName(tenant, p))
			if err != nil {
				return fmt.Errorf("projection: load views of %s (transactions page %d): %w", tenant, p, err)
			}
			if err := json.Unmarshal(b, &rows[p]); err != nil || len(rows[p]) != h.PageRows {
				return fmt.Errorf("projection: stored views of %s are corrupt: transactions page %d has %d rows, not %d (%v)", tenant, p, len(rows[p]), h.PageRows, err)
			}
			sizes[p] = len(b)
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	rows[h.Pages] = h.Transactions
	l := &loaded{snapshot: snapshot{Tenant: tenant, Applied: h.Applied, Accounts: h.Accounts,
		Transactions: make([]TxRow, 0, h.Pages*h.PageRows+len(h.Transactions))}}
	for p, r := range rows {
		if len(r) > 0 && len(l.Transactions) > 0 && r[0].Seq <= l.Transactions[len(l.Transactions)-1].Seq {
			return nil, fmt.Errorf("projection: stored views of %s are corrupt: transactions page %d is out of order", tenant, p)
		}
		l.Transactions = append(l.Transactions, r...)
	}
	l.stored = storedViews{pages: sizes, head: len(b)}
	if h.PageRows != txPageRows { // laid out otherwise (or one object): the next store writes every page
		l.stored = storedViews{head: l.stored.size()}
	}
	return l, nil
}
