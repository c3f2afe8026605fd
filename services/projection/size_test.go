package projection

import (
	"context"
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/services/aggregate"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// A tenant's stored views' size is in /admin/tenants and in the instance's load reports once
// its views are stored (the Cloudlysis PRD's "storage size per tenant" for projections).
func TestViewBytesInTelemetryAndAdmin(t *testing.T) {
	st := openStore(t)
	a := newAggregate(t, st)
	ctx := context.Background()
	if _, err := st.Placements(Kind).Create(ctx, schema.Placement{Tenant: "acme", Shard: "projection-1", Epoch: 1}); err != nil {
		t.Fatal(err)
	}
	in := startInstance(t, st, "projection-1")
	reports := make(chan schema.LoadReport, 64)
	sub, err := st.SubscribeLoad(Kind, func(r schema.LoadReport) {
		select {
		case reports <- r:
		default:
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	var last aggregate.Result
	for i := range 50 {
		c := command("acc1", aggregate.CmdDeposit, 1)
		if i == 0 {
			c = command("acc1", aggregate.CmdOpen, 0)
		}
		last = do(t, a, "acme", c)
	}
	warm(t, in.svc, "acme", last.Seq)
	if err := in.svc.flush(ctx, in.svc.lookup("acme")); err != nil {
		t.Fatal(err)
	}
	info, err := in.svc.st.views.GetInfo(ctx, "acme") // 49 transactions: the head holds them
	if err != nil {
		t.Fatal(err)
	}
	stored := info.Size
	deadline := time.After(10 * time.Second)
	for found := false; !found; {
		select {
		case r := <-reports:
			for _, z := range r.Sizes {
				found = found || z.Tenant == "acme" && z.ViewBytes == stored && r.StoredBytes >= stored
			}
		case <-deadline:
			t.Fatalf("no load report with acme's %d view bytes within 10s", stored)
		}
	}
	req, _ := http.NewRequest("GET", in.url+"/admin/tenants", nil)
	req.Header.Set("Authorization", "Bearer token")
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var body struct {
		Sizes []schema.TenantSize `json:"sizes"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil || len(body.Sizes) != 1 || body.Sizes[0].ViewBytes != stored || stored == 0 {
		t.Fatalf("/admin/tenants sizes %+v (%v), want acme with %d view bytes", body.Sizes, err, stored)
	}
}
