package placement_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// A placement record of a newer format than this binary reads is refused, never misread:
// reads of it fail with schema.ErrNewerFormat (a listing too), and the watcher drops the
// tenant's entry (nothing routes or serves by the view it can no longer follow) instead of
// keeping the old one or guessing at the new. A record of before formats is format 1.
func TestNewerFormatRefused(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	ctx := context.Background()
	if _, err := st.Placements("aggregate").Create(ctx, schema.Placement{Tenant: "t1", Shard: "aggregate-1"}); err != nil {
		t.Fatal(err)
	}
	kv, err := st.Placements("aggregate").KV(ctx)
	if err != nil {
		t.Fatal(err)
	}
	e, err := kv.Get(ctx, "t1")
	if err != nil || !strings.HasPrefix(string(e.Value()), `{"format":1,`) {
		t.Fatalf("a placement this binary wrote: %s %v (want it to lead with its format)", e.Value(), err)
	}
	// A record of before formats (no "format" key) reads as format 1.
	if _, err := kv.Put(ctx, "old", []byte(`{"shard":"aggregate-2","epoch":3,"phase":"active"}`)); err != nil {
		t.Fatal(err)
	}
	ch, onChange := changes(16)
	w := startWatcher(t, placement.Config{Store: st, Kinds: []string{"aggregate"}, OnChange: onChange})
	if e, ok := w.Lookup("aggregate", "old"); !ok || e.Shard != "aggregate-2" || e.Epoch != 3 {
		t.Fatalf("a record of before formats: %+v %v", e, ok)
	}
	if p, err := st.Placements("aggregate").Get(ctx, "old"); err != nil || p.Epoch != 3 {
		t.Fatalf("a record of before formats: %+v %v", p, err)
	}

	// A newer binary rewrites t1 in format 2, with a field this one does not know.
	if _, err := kv.Put(ctx, "t1", []byte(`{"format":2,"shard":"aggregate-1","epoch":2,"phase":"active","owner_set":["aggregate-3"]}`)); err != nil {
		t.Fatal(err)
	}
	waitChange(t, ch, "t1", func(c placement.Change) bool { return !c.NewOK && c.OldOK })
	if e, ok := w.Lookup("aggregate", "t1"); ok {
		t.Fatalf("the watcher kept routing t1 by a record it cannot read: %+v", e)
	}
	for name, read := range map[string]func() error{
		"Get":    func() error { _, err := st.Placements("aggregate").Get(ctx, "t1"); return err },
		"Latest": func() error { _, err := st.Placements("aggregate").Latest(ctx, "t1"); return err },
		"List":   func() error { _, _, err := st.Placements("aggregate").List(ctx); return err },
	} {
		err := read()
		if !errors.Is(err, schema.ErrNewerFormat) || !strings.Contains(err.Error(), "format 2") || !strings.Contains(err.Error(), "upgrade") {
			t.Errorf("%s of a format-2 record: %v, want a refusal naming the format (schema.ErrNewerFormat)", name, err)
		}
	}
	// Nor does an update write over it on a guess: the compare-and-set needs a read first.
	if _, err := st.Placements("aggregate").Update(ctx, schema.Placement{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-1", Epoch: 1, Phase: schema.PhaseActive, Revision: 1}, schema.Placement{Kind: "aggregate", Tenant: "t1", Shard: "aggregate-2", Epoch: 2, Phase: schema.PhaseActive}); err == nil {
		t.Error("an update over a format-2 record at a stale revision succeeded")
	}
}
