package projection

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// hostedViews starts a service that stores views only when told and warms tenant to the
// publisher's last event of it.
func hostedViews(t *testing.T, st *schema.Store, p *publisher, tenant string) (*Service, *tenantState) {
	t.Helper()
	s, _ := newService(t, st, Config{CheckpointInterval: time.Hour, CheckpointEvery: 1 << 30})
	s.host(tenant)
	warm(t, s, tenant, p.last[tenant])
	return s, s.lookup(tenant)
}

func viewsOf(ts *tenantState) snapshot {
	ts.mu.RLock()
	defer ts.mu.RUnlock()
	return ts.views()
}

// sameViews fails unless got and want hold the same applied sequence, accounts and
// transactions (their first n transactions, when n >= 0).
func sameViews(t *testing.T, got, want snapshot, n int) {
	t.Helper()
	if n >= 0 {
		want.Transactions = want.Transactions[:n]
	}
	enc := func(s snapshot) string {
		accs := slices.Clone(s.Accounts)
		slices.SortFunc(accs, func(a, b *AccountRow) int { return strings.Compare(a.ID, b.ID) })
		b, _ := json.Marshal(snapshot{Tenant: s.Tenant, Applied: s.Applied, Accounts: accs, Transactions: s.Transactions})
		return string(b)
	}
	if g, w := enc(got), enc(want); g != w {
		t.Fatalf("views differ: %d transactions at applied %d, want %d at %d", len(got.Transactions), got.Applied, len(want.Transactions), want.Applied)
	}
}

func objectNUID(t *testing.T, s *Service, name string) string {
	t.Helper()
	info, err := s.st.views.GetInfo(context.Background(), name)
	if err != nil {
		t.Fatalf("object %s: %v", name, err)
	}
	return info.NUID
}

// A store rewrites only the transactions' pages that changed (the full ones keep their
// objects), the stored size adds up, and a load returns the views as stored.
func TestStoredViewsRewriteOnlyChangedPages(t *testing.T) {
	st := openStore(t)
	p := newPublisher(t, st)
	ctx := context.Background()
	for range 2*txPageRows + 510 { // 10 accounts opened, the rest deposits: 3 pages
		p.add("acme")
	}
	p.wait()
	s, ts := hostedViews(t, st, p, "acme")
	if err := s.flush(ctx, ts); err != nil {
		t.Fatal(err)
	}
	before := []string{objectNUID(t, s, pageName("acme", 0)), objectNUID(t, s, pageName("acme", 1)), objectNUID(t, s, pageName("acme", 2))}
	for range 30 {
		p.add("acme")
	}
	p.wait()
	warm(t, s, "acme", p.last["acme"])
	if err := s.flush(ctx, ts); err != nil {
		t.Fatal(err)
	}
	for page, was := range before {
		now := objectNUID(t, s, pageName("acme", page))
		if changed := now != was; changed != (page == 2) {
			t.Errorf("page %d rewritten: %v, want %v (only the last, partial page changes)", page, changed, page == 2)
		}
	}
	l, err := s.st.load(ctx, "acme")
	if err != nil || l == nil {
		t.Fatalf("load: %v, %v", l, err)
	}
	sameViews(t, l.snapshot, viewsOf(ts), -1)

	size := 0
	for _, name := range []string{"acme", pageName("acme", 0), pageName("acme", 1), pageName("acme", 2)} {
		info, err := s.st.views.GetInfo(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		size += int(info.Size)
	}
	cp, err := s.Checkpoint(ctx, "acme")
	if err != nil {
		t.Fatal(err)
	}
	if cp.Bytes != size || int(ts.viewBytes.Load()) != size || l.stored.size() != size {
		t.Fatalf("stored size: checkpoint %d, reported %d, loaded %d; objects hold %d", cp.Bytes, ts.viewBytes.Load(), l.stored.size(), size)
	}
}

// A store that stopped after writing pages and before its head leaves the stored views as the
// head says: a load takes the head's count of transactions, not what the pages hold beyond it.
func TestStoredViewsAreTheHeads(t *testing.T) {
	st := openStore(t)
	p := newPublisher(t, st)
	ctx := context.Background()
	for range txPageRows + 100 {
		p.add("acme")
	}
	p.wait()
	s, ts := hostedViews(t, st, p, "acme")
	if err := s.flush(ctx, ts); err != nil {
		t.Fatal(err)
	}
	stored := viewsOf(ts)
	for range 2 * txPageRows {
		p.add("acme")
	}
	p.wait()
	warm(t, s, "acme", p.last["acme"])
	now := viewsOf(ts)
	for page := 1; page <= 2; page++ { // the pages a store of now writes, without its head
		b, _ := json.Marshal(now.Transactions[page*txPageRows : min((page+1)*txPageRows, len(now.Transactions))])
		if _, err := s.st.views.PutBytes(ctx, pageName("acme", page), b); err != nil {
			t.Fatal(err)
		}
	}
	l, err := s.st.load(ctx, "acme")
	if err != nil || l == nil {
		t.Fatalf("load: %v, %v", l, err)
	}
	sameViews(t, l.snapshot, stored, -1)
	sameViews(t, snapshot{Transactions: l.Transactions}, snapshot{Transactions: now.Transactions}, len(stored.Transactions))

	if _, err := s.st.views.PutBytes(ctx, pageName("acme", 1), []byte(`[]`)); err != nil {
		t.Fatal(err)
	}
	if _, err := s.st.load(ctx, "acme"); err == nil || !strings.Contains(err.Error(), "page 1 has 0 of") {
		t.Fatalf("load with a short page: %v, want an error naming the page", err)
	}
}

// Views stored as one object (before pages) still load, and the next store writes them in
// pages.
func TestStoredViewsOfOneObjectLoad(t *testing.T) {
	st := openStore(t)
	p := newPublisher(t, st)
	ctx := context.Background()
	for range txPageRows + 100 {
		p.add("old")
	}
	p.wait()
	a, ta := hostedViews(t, st, p, "old")
	want := viewsOf(ta)
	b, _ := json.Marshal(struct {
		Tenant       string        `json:"tenant"`
		Applied      uint64        `json:"applied"`
		Accounts     []*AccountRow `json:"accounts"`
		Transactions []TxRow       `json:"transactions"`
	}{"old", want.Applied, want.Accounts, want.Transactions})
	if _, err := a.st.views.PutBytes(ctx, "old", b); err != nil {
		t.Fatal(err)
	}
	l, err := a.st.load(ctx, "old")
	if err != nil || l == nil {
		t.Fatalf("load: %v, %v", l, err)
	}
	sameViews(t, l.snapshot, want, -1)

	s, ts := hostedViews(t, st, p, "old") // resumes from the object: nothing later to replay
	sameViews(t, viewsOf(ts), want, -1)
	if ts.stored.tx != 0 || int(ts.viewBytes.Load()) != len(b) {
		t.Fatalf("loaded from one object: %d transactions in pages, %d bytes; want 0 and %d", ts.stored.tx, ts.viewBytes.Load(), len(b))
	}
	ts.mu.Lock()
	ts.flushed = 0 // as if changed
	ts.mu.Unlock()
	if err := s.flush(ctx, ts); err != nil {
		t.Fatal(err)
	}
	objectNUID(t, s, pageName("old", 1))
	if l, err = s.st.load(ctx, "old"); err != nil || l.stored.tx != len(want.Transactions) {
		t.Fatalf("load after a store: %v, %v", l, err)
	}
	sameViews(t, l.snapshot, want, -1)
}
