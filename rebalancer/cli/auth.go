package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/internal/gatesig"
	"github.com/tenantmesh/tenantmesh/internal/natsauth"
	"github.com/tenantmesh/tenantmesh/internal/secretfile"
	"github.com/tenantmesh/tenantmesh/shardkit/natsperm"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// AuthCommand is `rebalance auth init|creds|permissions`: the NATS trust chain and each role's
// credentials. It works on files only; it never connects to NATS.
type AuthCommand struct {
	m *Main
	common
	dir, kinds, affinity, shards, out string
	kind, shard, kv                   string
	expiry                            time.Duration
	revokeRole, user, push, pushCA    string
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
  revoke       revoke the users of --role (every user minted with that name) or one --user
               (public key U...): servers disconnect and refuse them once the account is
               pushed (--push)
  rotate       add a new version of the signing key and mint every role's credentials in
               --dir/creds again with it; the older keys' users keep working until retire
  retire       remove the older signing keys: their users are disconnected (once pushed) and
               reconnect with the credentials minted by rotate, without a restart
  push URL     send the account (signing keys, revocations) to the running servers at URL
               through the system account; revoke, rotate and retire do it with --push URL

Users expire after --expiry (default 90 days): mint again before then. Every change rewrites
auth.conf too, so a server restarted later keeps it.

init keeps the gateway's and each shard kind's permissions in the account (NATS scoped signing
keys): their credentials then carry a name and a tag, not a few hundred subjects that every
JetStream request would carry to the server. creds uses such a key when the role's kind has
one; a kind init did not see gets its permissions in its credentials, as before.

--dir holds the chain's seeds: keep it secret, like a CA's key.`

const authExamples = `  rebalance auth init --dir ./nats-auth --shards aggregate:aggregate-1,aggregate:aggregate-2
  rebalance auth creds shard --dir ./nats-auth --kind runner --shard runner-3 --out runner-3.creds
  rebalance auth creds shard --dir ./nats-auth --kind notes --shard notes-1 --kv notes --out notes-1.creds
  rebalance auth gate-key --dir ./nats-auth --kind notes --out notes.key
  rebalance auth permissions --kind aggregate --shard aggregate-1 --output json
  rebalance auth revoke --dir ./nats-auth --role shard-runner-runner-3 --push nats://nats-1:4222
  rebalance auth rotate --dir ./nats-auth --push nats://nats-1:4222   # then deliver the new files, and
  rebalance auth retire --dir ./nats-auth --push nats://nats-1:4222
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
	fs.DurationVar(&c.expiry, "expiry", natsauth.DefaultExpiry, "init, creds, rotate: how long the users minted stay valid (0: forever, not advised)")
	fs.StringVar(&c.revokeRole, "role", "", "revoke: the role name whose users to revoke (rebalancer, gateway, shard-<kind>-<shard>)")
	fs.StringVar(&c.user, "user", "", "revoke: one user's public key (U...)")
	fs.StringVar(&c.push, "push", "", "revoke, rotate, retire: push the account to the servers at this NATS URL")
	fs.StringVar(&c.pushCA, "push-tls-ca", "", "with --push: CA of the servers' TLS certificate")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if err := c.check(); err != nil {
		return err
	}
	if len(pos) == 0 {
		return usagef("auth needs a subcommand: init, creds <role>, gate-key, permissions, revoke, rotate, retire or push (see rebalance auth --help)")
	}
	switch pos[0] {
	case "revoke", "rotate", "retire":
		return c.change(pos[0])
	case "push":
		if len(pos) == 2 {
			c.push = pos[1]
		}
		if c.push == "" {
			return usagef("auth push takes the NATS URL of the servers")
		}
		return c.change("push")
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
	// The gateway's and the shards' permissions go into the account as scoped keys, before
	// auth.conf is written: their credentials then hold a name and a tag, not the subjects.
	if _, err := natsperm.AddScopes(chain, roles[1:]); err != nil {
		return err
	}
	conf := filepath.Join(c.dir, "auth.conf")
	if err := os.WriteFile(conf, []byte(chain.ServerConfig()), 0o644); err != nil {
		return err
	}
	out := []written{{"trust chain (secret: the seeds)", filepath.Join(c.dir, "chain.json")}, {"server config: include it in nats-server.conf", conf}}
	creds := filepath.Join(c.dir, "creds")
	for _, r := range roles {
		path, err := c.writeCreds(chain, creds, r)
		if err != nil {
			return err
		}
		out = append(out, written{"credentials of " + r.Name, path})
	}
	if err := c.save(chain); err != nil {
		return err
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
		if path, err = c.writeCreds(chain, filepath.Join(c.dir, "creds"), r); err != nil {
			return err
		}
	} else {
		b, err := chain.CredsFor(r, c.expiry)
		if err != nil {
			return err
		}
		if err := secretfile.Write(path, b); err != nil {
			return err
		}
	}
	if err := c.save(chain); err != nil {
		return err
	}
	out := []written{{"credentials of " + r.Name, path}}
	return c.emit(c.m.Stdout, out, func(w io.Writer) error { return renderWritten(w, out) })
}

// writeCreds mints r's credentials with --expiry into dir/<role>.creds.
func (c *AuthCommand) writeCreds(chain *natsauth.Chain, dir string, r natsperm.Role) (string, error) {
	b, err := chain.CredsFor(r, c.expiry)
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	path := filepath.Join(dir, r.Name+".creds")
	return path, secretfile.Write(path, b)
}

// save keeps the chain and rewrites auth.conf from it (public JWTs only).
func (c *AuthCommand) save(chain *natsauth.Chain) error {
	if err := chain.Save(); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(c.dir, "auth.conf"), []byte(chain.ServerConfig()), 0o644)
}

// change is revoke, rotate, retire and push: change the account, keep it, rewrite auth.conf,
// and with --push send it to the running servers.
func (c *AuthCommand) change(what string) error {
	chain, err := natsauth.LoadOrCreate(c.dir)
	if err != nil {
		return err
	}
	var out []written
	switch what {
	case "revoke":
		switch {
		case c.user != "":
			err = chain.RevokeKey(c.user)
			out = append(out, written{"revoked user", c.user})
		case c.revokeRole != "":
			var users []natsauth.User
			users, err = chain.Revoke(func(u natsauth.User) bool { return u.Name == c.revokeRole })
			for _, u := range users {
				out = append(out, written{"revoked user of " + u.Name + " (key version " + strconv.Itoa(u.Version) + ")", u.Key})
			}
			if err == nil && len(users) == 0 {
				return fmt.Errorf("no user of role %q is on record in %s", c.revokeRole, c.dir)
			}
		default:
			return usagef("auth revoke needs --role or --user")
		}
	case "rotate":
		var v int
		if v, err = chain.Rotate(); err != nil {
			return err
		}
		out = append(out, written{"signing key version " + strconv.Itoa(v), filepath.Join(c.dir, "chain.json")})
		for _, name := range slices.Sorted(maps.Keys(chain.Roles)) {
			path := filepath.Join(c.dir, "creds", name+".creds")
			if _, serr := os.Stat(path); serr != nil {
				continue // minted elsewhere (--out): mint it again with auth creds
			}
			if _, err = c.writeCreds(chain, filepath.Join(c.dir, "creds"), chain.Roles[name]); err != nil {
				return err
			}
			out = append(out, written{"credentials of " + name + " (key version " + strconv.Itoa(v) + ")", path})
		}
	case "retire":
		var vs []int
		if vs, err = chain.Retire(); err == nil && len(vs) == 0 {
			return errors.New("only one signing key is in use: nothing to retire (rotate first)")
		}
		for _, v := range vs {
			out = append(out, written{"retired signing key version " + strconv.Itoa(v), filepath.Join(c.dir, "chain.json")})
		}
	}
	if err != nil {
		return err
	}
	if err := c.save(chain); err != nil {
		return err
	}
	out = append(out, written{"server config (restarted servers read it)", filepath.Join(c.dir, "auth.conf")})
	if c.push != "" {
		var opts []nats.Option
		if c.pushCA != "" {
			opts = append(opts, nats.RootCAs(c.pushCA))
		}
		if err := chain.Push(c.push, opts...); err != nil {
			return err
		}
		out = append(out, written{"account pushed to the running servers", c.push})
	}
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
	for i := range roles {
		roles[i].Template = nil // the same subjects with the shard as {{tag(shard)}}: see Tags
	}
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
