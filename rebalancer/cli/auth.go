package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/tenantmesh/tenantmesh/internal/gatesig"
	"github.com/tenantmesh/tenantmesh/internal/natsauth"
	"github.com/tenantmesh/tenantmesh/internal/natsperm"
	"github.com/tenantmesh/tenantmesh/internal/secretfile"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// AuthCommand is `rebalance auth init|creds|permissions`: the NATS trust chain and each role's
// credentials. It works on files only; it never connects to NATS.
type AuthCommand struct {
	m *Main
	common
	dir, kinds, affinity, shards, out string
	kind, shard, kv                   string
}

const authAbout = `Makes and keeps the NATS trust chain tenantmesh runs on (NATS decentralized JWT auth: an
operator, a system account and the TENANTMESH account) and mints each role's credentials,
allowed only the subjects that role needs (see 'auth permissions' and docs/security.md).

  init         make the chain in --dir (kept: running it again reuses it), write the server
               config auth.conf to include from nats-server.conf, and credentials for the
               rebalancer, the gateway, and each --shards entry under --dir/creds
  creds ROLE   mint one role's credentials: rebalancer, gateway, or shard (--kind, --shard)
  gate-key     write the gateway key of --kind (for its shards' --gateway-key-file) from the
               gateways' key gate.key (init makes it, for the gateways' --shard-key-file)
  permissions  print what each role may publish and subscribe to

--dir holds the chain's seeds: keep it secret, like a CA's key.`

const authExamples = `  rebalance auth init --dir ./nats-auth --shards aggregate:aggregate-1,aggregate:aggregate-2
  rebalance auth creds shard --dir ./nats-auth --kind runner --shard runner-3 --out runner-3.creds
  rebalance auth creds shard --dir ./nats-auth --kind notes --shard notes-1 --kv notes --out notes-1.creds
  rebalance auth gate-key --dir ./nats-auth --kind notes --out notes.key
  rebalance auth permissions --kind aggregate --shard aggregate-1 --output json
`

// Run runs the subcommand.
func (c *AuthCommand) Run(ctx context.Context, args []string) error {
	fs := c.m.newFlags("auth", "init|creds <role>|permissions [flags]", authAbout, authExamples)
	fs.StringVar(&c.output, "output", "table", "output format: table or json")
	fs.StringVar(&c.dir, "dir", "nats-auth", "directory keeping the trust chain (chain.json, secret) and credentials")
	fs.StringVar(&c.kinds, "kinds", "aggregate,projection,runner,render", "kinds whose placements the gateway reads and writes")
	fs.StringVar(&c.affinity, "affinity-kinds", "render", "kinds whose servers register through the gateway")
	fs.StringVar(&c.shards, "shards", "", "init: shards to mint credentials for, kind:shard,...")
	fs.StringVar(&c.kind, "kind", "aggregate", "creds shard, permissions: the shard's kind")
	fs.StringVar(&c.shard, "shard", "aggregate-1", "creds shard, permissions: the shard")
	fs.StringVar(&c.kv, "kv", "", "creds shard, permissions: KV buckets the shard's kind owns beyond the built-in kinds' (name,...: bucket tm_<kind>_<name>)")
	fs.StringVar(&c.out, "out", "", "creds: write here instead of --dir/creds/<role>.creds")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if err := c.check(); err != nil {
		return err
	}
	if len(pos) == 0 {
		return usagef("auth needs a subcommand: init, creds <role> or permissions (see rebalance auth --help)")
	}
	switch pos[0] {
	case "init":
		return c.init()
	case "creds":
		if len(pos) != 2 {
			return usagef("auth creds takes one role: rebalancer, gateway or shard")
		}
		role, err := c.role(pos[1], c.kind, c.shard)
		if err != nil {
			return err
		}
		return c.creds(role)
	case "permissions":
		return c.permissions()
	case "gate-key":
		return c.gateKey()
	}
	return usagef("auth %s: unknown; use init, creds or permissions", pos[0])
}

func list(s string) []string {
	var out []string
	for _, v := range strings.Split(s, ",") {
		if v = strings.TrimSpace(v); v != "" {
			out = append(out, v)
		}
	}
	return out
}

func (c *AuthCommand) role(name, kind, shard string) (natsperm.Role, error) {
	switch name {
	case "rebalancer", "operator":
		return natsperm.Rebalancer(), nil
	case "gateway":
		return natsperm.Gateway(list(c.kinds), list(c.affinity)), nil
	case "shard":
		if err := schema.CheckName("kind", kind); err != nil {
			return natsperm.Role{}, usagef("%v", err)
		}
		if err := schema.CheckName("shard", shard); err != nil {
			return natsperm.Role{}, usagef("%v", err)
		}
		assets := natsperm.KindAssets(kind)
		for _, name := range list(c.kv) {
			b := schema.ServiceBucket(kind, name)
			if err := schema.CheckName("kv", b); err != nil {
				return natsperm.Role{}, usagef("--kv %q: %v", name, err)
			}
			assets.KV = append(assets.KV, b)
		}
		return natsperm.Shard(kind, shard, assets), nil
	}
	return natsperm.Role{}, usagef("role %q: use rebalancer, gateway or shard", name)
}

// written is one file init or creds wrote.
type written struct {
	What string `json:"what"`
	Path string `json:"path"`
}

func (c *AuthCommand) init() error {
	chain, err := natsauth.LoadOrCreate(c.dir)
	if err != nil {
		return err
	}
	conf := filepath.Join(c.dir, "auth.conf")
	if err := os.WriteFile(conf, []byte(chain.ServerConfig()), 0o644); err != nil {
		return err
	}
	out := []written{{"trust chain (secret: the seeds)", filepath.Join(c.dir, "chain.json")}, {"server config: include it in nats-server.conf", conf}}
	roles := []natsperm.Role{natsperm.Rebalancer(), natsperm.Gateway(list(c.kinds), list(c.affinity))}
	for _, ks := range list(c.shards) {
		kind, shard, ok := strings.Cut(ks, ":")
		if !ok {
			return usagef("--shards %q: write kind:shard", ks)
		}
		r, err := c.role("shard", kind, shard)
		if err != nil {
			return err
		}
		roles = append(roles, r)
	}
	creds := filepath.Join(c.dir, "creds")
	for _, r := range roles {
		path, err := chain.WriteCreds(creds, r)
		if err != nil {
			return err
		}
		out = append(out, written{"credentials of " + r.Name, path})
	}
	b, err := chain.SystemCreds()
	if err != nil {
		return err
	}
	sys := filepath.Join(creds, "system.creds")
	if err := secretfile.Write(sys, b); err != nil {
		return err
	}
	out = append(out, written{"system account user (nats server ls, monitoring)", sys})
	gate, err := c.gateKeys(list(c.kinds))
	if err != nil {
		return err
	}
	out = append(out, gate...)
	return c.emit(c.m.Stdout, out, func(w io.Writer) error { return renderWritten(w, out) })
}

func (c *AuthCommand) creds(r natsperm.Role) error {
	chain, err := natsauth.LoadOrCreate(c.dir)
	if err != nil {
		return err
	}
	path := c.out
	if path == "" {
		if path, err = chain.WriteCreds(filepath.Join(c.dir, "creds"), r); err != nil {
			return err
		}
	} else {
		b, err := chain.Creds(r)
		if err != nil {
			return err
		}
		if err := secretfile.Write(path, b); err != nil {
			return err
		}
	}
	out := []written{{"credentials of " + r.Name, path}}
	return c.emit(c.m.Stdout, out, func(w io.Writer) error { return renderWritten(w, out) })
}

// gateKeyFile is the gateways' key in the --dir of init: the gateways' --shard-key-file.
const gateKeyFile = "gate.key"

// gateKeys makes the gateways' key (kept: made once) and writes each kind's key under
// --dir/gate/<kind>.key.
func (c *AuthCommand) gateKeys(kinds []string) ([]written, error) {
	path := filepath.Join(c.dir, gateKeyFile)
	master, err := gatesig.LoadOrCreate(path)
	if err != nil {
		return nil, err
	}
	out := []written{{"gateways' key (secret: --shard-key-file of every gateway)", path}}
	for _, k := range kinds {
		if err := schema.CheckName("kind", k); err != nil {
			return nil, usagef("--kinds: %v", err)
		}
		kp := filepath.Join(c.dir, "gate", k+".key")
		if err := os.MkdirAll(filepath.Dir(kp), 0o700); err != nil {
			return nil, err
		}
		if err := gatesig.WriteKeyFile(kp, gatesig.KindKey(master, k)); err != nil {
			return nil, err
		}
		out = append(out, written{"gateway key of kind " + k + " (--gateway-key-file of its shards)", kp})
	}
	return out, nil
}

// gateKey is `auth gate-key`: one kind's key, to --out or --dir/gate/<kind>.key.
func (c *AuthCommand) gateKey() error {
	if err := schema.CheckName("kind", c.kind); err != nil {
		return usagef("%v", err)
	}
	if c.out == "" {
		out, err := c.gateKeys([]string{c.kind})
		if err != nil {
			return err
		}
		return c.emit(c.m.Stdout, out, func(w io.Writer) error { return renderWritten(w, out) })
	}
	master, err := gatesig.ReadKeyFile(filepath.Join(c.dir, gateKeyFile))
	if err != nil {
		return fmt.Errorf("the gateways' key: %w (run rebalance auth init --dir %s first)", err, c.dir)
	}
	if err := gatesig.WriteKeyFile(c.out, gatesig.KindKey(master, c.kind)); err != nil {
		return err
	}
	out := []written{{"gateway key of kind " + c.kind, c.out}}
	return c.emit(c.m.Stdout, out, func(w io.Writer) error { return renderWritten(w, out) })
}

func renderWritten(w io.Writer, out []written) error {
	tw := newTable(w)
	fmt.Fprintln(tw, "WROTE\tPATH")
	for _, o := range out {
		fmt.Fprintf(tw, "%s\t%s\n", o.What, o.Path)
	}
	return tw.Flush()
}

func (c *AuthCommand) permissions() error {
	shard, err := c.role("shard", c.kind, c.shard)
	if err != nil {
		return err
	}
	roles := []natsperm.Role{natsperm.Rebalancer().Sorted(), natsperm.Gateway(list(c.kinds), list(c.affinity)).Sorted(), shard.Sorted()}
	return c.emit(c.m.Stdout, roles, func(w io.Writer) error {
		tw := newTable(w)
		fmt.Fprintln(tw, "ROLE\tMAY\tSUBJECT")
		for _, r := range roles {
			for _, s := range r.Pub {
				fmt.Fprintf(tw, "%s\tpublish\t%s\n", r.Name, s)
			}
			for _, s := range r.Sub {
				fmt.Fprintf(tw, "%s\tsubscribe\t%s\n", r.Name, s)
			}
		}
		return tw.Flush()
	})
}
