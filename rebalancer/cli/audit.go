package cli

import (
	"context"
	"io"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// AuditCommand is `rebalance audit`.
type AuditCommand struct {
	m *Main
	common
	kind, tenant, since string
	limit               int
}

const auditAbout = `Reads the audit journal (TM_AUDIT): every placement change and workflow step, with the actor,
the plan and move, and the placement revision it produced. Oldest first.`

const auditExamples = `  rebalance audit --tenant acme
  rebalance audit --kind aggregate --since 1h --limit 200
  rebalance audit --since 2026-01-01T00:00:00Z --output json
`

// Run reads the journal.
func (c *AuditCommand) Run(ctx context.Context, args []string) error {
	fs := c.m.newFlags("audit", "[flags]", auditAbout, auditExamples)
	c.register(fs)
	fs.StringVar(&c.kind, "kind", "", "only this kind")
	fs.StringVar(&c.tenant, "tenant", "", "only this tenant")
	fs.StringVar(&c.since, "since", "", "only events since: a duration back from now (30m, 2h) or an RFC 3339 time")
	fs.IntVar(&c.limit, "limit", 50, "the newest events shown, at most")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if err := c.check(); err != nil {
		return err
	}
	if len(pos) > 0 {
		return usagef("audit takes no arguments; filter with --kind, --tenant, --since")
	}
	q := schema.AuditQuery{Kind: c.kind, Tenant: c.tenant, Limit: c.limit}
	if c.since != "" {
		if q.Since, err = rebalancer.ParseSince(c.since, c.m.Now()); err != nil {
			return usagef("--%v", err)
		}
	}
	if c.tenant != "" {
		if err := schema.CheckTenant(c.tenant); err != nil {
			return usagef("--tenant: %v", err)
		}
	}
	st, closeFn, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer closeFn()
	evs, err := st.Audit().Read(ctx, q)
	if err != nil {
		return err
	}
	if evs == nil {
		evs = []schema.AuditEvent{}
	}
	return c.emit(c.m.Stdout, evs, func(w io.Writer) error { return renderAudit(w, evs) })
}
