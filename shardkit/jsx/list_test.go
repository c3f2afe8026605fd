package jsx_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
)

// TestListSeesKeysRewrittenWhileListed lists a bucket of history 1 while one of its keys is
// written again and again, as heartbeats do to the instance directory. Every list must hold
// every key. The consumer's count of what is left once read 0 when a write replaced the key
// it had yet to send (the old message leaves the count at once, the new one joins it a moment
// later), and the list stopped there without the key: 79 lists of 300 here, with -race.
func TestListSeesKeysRewrittenWhileListed(t *testing.T) {
	srv := natstest.Server(t)
	c, err := jsx.New(natstest.Connect(t, srv.URL()), jsx.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	type value struct{ N int }
	const lists = 100
	missed := 0
	for i := range lists {
		kv, err := c.EnsureSharedKV(ctx, jsx.KVSpec{Bucket: fmt.Sprintf("list%d", i), History: 1})
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range []string{"notes.notes-1.a", "notes.notes-2.a"} {
			if _, err := c.Records(kv).Put(ctx, k, value{}); err != nil {
				t.Fatal(err)
			}
		}
		wctx, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() {
			for n := 0; wctx.Err() == nil; n++ {
				if _, err := c.Records(kv).Put(wctx, "notes.notes-1.a", value{n}); err != nil && wctx.Err() == nil {
					done <- err
					return
				}
			}
			done <- nil
		}()
		got := map[string]bool{}
		_, err = jsx.ListJSON(ctx, c.Records(kv), "notes.>", func(k string, _ uint64, _ value) { got[k] = true })
		stop()
		if werr := <-done; werr != nil {
			t.Fatal(werr)
		}
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != 2 {
			missed++
			t.Errorf("list %d: got %v, want both keys", i, got)
		}
	}
	if missed > 0 {
		t.Errorf("%d lists of %d missed a key", missed, lists)
	}
}
