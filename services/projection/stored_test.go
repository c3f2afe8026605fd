package projection

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

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

// A store writes only the pages of transactions that became full since the last (the pages
// stored before keep their objects; the rows after the last full page are in the head), the
// stored size adds up, and a load returns the views as stored.
func TestStoredViewsWriteOnlyNewPages(t *testing.T) {
	st := openStore(t)
	p := newPublisher(t, st)
	ctx := context.Background()
	p.addN("acme", 2*txPageRows+500) // 10 accounts opened, the rest deposits: 2 pages and 490 rows
	s, ts := hostedViews(t, st, p, "acme")
	if err := s.flush(ctx, ts); err != nil {
		t.Fatal(err)
	}
	before := []string{objectNUID(t, s, pageName("acme", 0)), objectNUID(t, s, pageName("acme", 1))}
	p.addN("acme", 600) // page 2 fills
	warm(t, s, "acme", p.last["acme"])
	if err := s.flush(ctx, ts); err != nil {
		t.Fatal(err)
	}
	for page, was := range before {
		if objectNUID(t, s, pageName("acme", page)) != was {
			t.Errorf("page %d rewritten; only pages that became full are written", page)
		}
	}
	if _, err := s.st.views.GetInfo(ctx, pageName("acme", 3)); !errors.Is(err, jetstream.ErrObjectNotFound) {
		t.Fatalf("page 3 (partial): %v; want it not stored (its rows are in the head)", err)
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

// The head is the commit point: pages a store wrote before it stopped short of its head are
// not loaded, and a page without its rows is reported, not loaded short.
func TestStoredViewsAreTheHeads(t *testing.T) {
	st := openStore(t)
	p := newPublisher(t, st)
	ctx := context.Background()
	p.addN("acme", txPageRows+100)
	s, ts := hostedViews(t, st, p, "acme")
	if err := s.flush(ctx, ts); err != nil {
		t.Fatal(err)
	}
	stored := viewsOf(ts)
	p.addN("acme", 2*txPageRows)
	warm(t, s, "acme", p.last["acme"])
	now := viewsOf(ts)
	for page := 1; page <= 2; page++ { // the pages a store of now writes, without its head
		b, _ := json.Marshal(now.Transactions[page*txPageRows : (page+1)*txPageRows])
		if _, err := s.st.views.PutBytes(ctx, pageName("acme", page), b); err != nil {
			t.Fatal(err)
		}
	}
	l, err := s.st.load(ctx, "acme")
	if err != nil || l == nil {
		t.Fatalf("load: %v, %v", l, err)
	}
	sameViews(t, l.snapshot, stored, -1)

	if _, err := s.st.views.PutBytes(ctx, pageName("acme", 0), []byte(`[]`)); err != nil {
		t.Fatal(err)
	}
	if _, err := s.st.load(ctx, "acme"); err == nil || !strings.Contains(err.Error(), "page 0 has 0 rows, not 1024") {
		t.Fatalf("load with a short page: %v, want an error naming the page", err)
	}
}

// Views stored as one object (before pages) still load, and the next store writes them in
// pages.
func TestStoredViewsOfOneObjectLoad(t *testing.T) {
	st := openStore(t)
	p := newPublisher(t, st)
	ctx := context.Background()
	p.addN("old", txPageRows+100)
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
	if len(ts.stored.pages) != 0 || int(ts.viewBytes.Load()) != len(b) {
		t.Fatalf("loaded from one object: %d pages, %d bytes; want 0 and %d", len(ts.stored.pages), ts.viewBytes.Load(), len(b))
	}
	ts.mu.Lock()
	ts.flushed = 0 // as if changed
	ts.mu.Unlock()
	if err := s.flush(ctx, ts); err != nil {
		t.Fatal(err)
	}
	objectNUID(t, s, pageName("old", 0))
	if l, err = s.st.load(ctx, "old"); err != nil || len(l.stored.pages) != 1 {
		t.Fatalf("load after a store: %v, %v", l, err)
	}
	sameViews(t, l.snapshot, want, -1)
}
