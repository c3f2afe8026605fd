package jsx

import (
	"context"
	"testing"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
)

// Two processes open a new bucket with per-key TTLs at once: the one that finds it missing
// and then creates it after the other did sends the same config, which must not try to turn
// the TTLs off (a CI failure: "message TTL status can not be disabled").
func TestPerKeyTTLBucketCreatedTwice(t *testing.T) {
	srv := natstest.Server(t)
	nc := natstest.Connect(t, srv.URL())
	ctx := context.Background()
	c, err := New(nc, Options{})
	if err != nil {
		t.Fatal(err)
	}
	spec := KVSpec{Bucket: "tm_test_ttl", Description: "test", PerKeyTTL: true}
	if _, err := c.EnsureKV(ctx, spec); err != nil {
		t.Fatal(err)
	}
	// What the other process sends after its open found no bucket.
	if _, err := c.js.CreateOrUpdateKeyValue(ctx, c.kvConfig(spec)); err != nil {
		t.Fatalf("creating the bucket a second time: %v", err)
	}
	info, err := c.js.Stream(ctx, KVStream(spec.Bucket))
	if err != nil || !info.CachedInfo().Config.AllowMsgTTL {
		t.Fatalf("per-message TTLs not allowed: %v", err)
	}
}
