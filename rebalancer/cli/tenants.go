package cli

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"time"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
)

// TenantsCommand is `rebalance tenants`.
type TenantsCommand struct {
	m *Main
	common
	kind   string
	limit  int
	listen time.Duration
}

const tenantsAbout = `Shows the largest tenants by stored size (the Cloudlysis PRD's storage size per tenant), as the
instances report them in telemetry: events and their bytes and the snapshot (aggregate),
stored views (projection), queued jobs, undelivered effects and due schedules (runner), and
BYTES, what a move of the tenant carries (the planner's second dimension beside load). It
listens to the load reports for --listen; each instance reports its largest tenants.`

const tenantsExamples = `  rebalance tenants
  rebalance tenants --kind runner --limit 50 --output json
`

// Run collects the reports and lists the tenants.
func (c *TenantsCommand) Run(ctx context.Context, args []string) error {
	fs := c.m.newFlags("tenants", "[flags]", tenantsAbout, tenantsExamples)
	c.register(fs)
	fs.StringVar(&c.kind, "kind", "", "only this kind")
	fs.IntVar(&c.limit, "limit", 20, "at most this many tenants (0: all)")
	fs.DurationVar(&c.listen, "listen", 2*time.Second, "how long to listen to the load reports (instances report about once a second)")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if err := c.check(); err != nil {
		return err
	}
	if len(pos) > 0 {
		return usagef("tenants takes no arguments")
	}
	if c.limit < 0 || c.listen <= 0 || c.listen > time.Minute {
		return usagef("--limit must be >= 0 and --listen between 0 and 1m")
	}
	st, closeFn, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer closeFn()
	tel, err := rebalancer.CollectTelemetry(ctx, st, c.kind, c.listen)
	if err != nil {
		return err
	}
	views := rebalancer.LargestTenants(tel.Reports(c.kind, c.m.Now(), 0), c.limit)
	return c.emit(c.m.Stdout, views, func(w io.Writer) error { return renderTenantSizes(w, views) })
}

// renderTenantSizes is `rebalance tenants`' table.
func renderTenantSizes(w io.Writer, views []rebalancer.TenantSizeView) error {
	if len(views) == 0 {
		_, err := fmt.Fprintln(w, "no instance reported tenant sizes")
		return err
	}
	tw := newTable(w)
	fmt.Fprintln(tw, "KIND\tSHARD\tTENANT\tBYTES\tEVENTS\tEVENT BYTES\tSNAPSHOT\tVIEWS\tQUEUED\tOUTBOX\tDUE")
	for _, v := range views {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", v.Kind, v.Shard, v.Tenant, planner.HumanBytes(v.MoveBytes),
			zeroDash(v.Events), bytesDash(v.EventBytes), bytesDash(v.SnapshotBytes), bytesDash(v.ViewBytes),
			zeroDash(uint64(v.Queued)), zeroDash(uint64(v.Outbox)), zeroDash(uint64(v.Due)))
	}
	return tw.Flush()
}

func zeroDash(n uint64) string {
	if n == 0 {
		return "-"
	}
	return strconv.FormatUint(n, 10)
}

func bytesDash(n uint64) string {
	if n == 0 {
		return "-"
	}
	return planner.HumanBytes(n)
}
