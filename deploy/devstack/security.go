package main

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/tenantmesh/tenantmesh/internal/embednats"
	"github.com/tenantmesh/tenantmesh/internal/gatesig"
	"github.com/tenantmesh/tenantmesh/internal/natsauth"
	"github.com/tenantmesh/tenantmesh/shardkit/natsconn"
	"github.com/tenantmesh/tenantmesh/shardkit/natsperm"
)

// security is how the stack's NATS is secured: the trust chain kept under <data>/auth (made on
// first start), one credentials file per role under <data>/creds, and with --nats-tls a CA
// and server certificate under <data>/auth/tls. Nil with --nats-insecure.
type security struct {
	chain *natsauth.Chain
	creds string
	tls   *natsauth.TLSFiles
}

func newSecurity(c config) (*security, error) {
	if c.natsInsecure {
		return nil, nil
	}
	chain, err := natsauth.LoadOrCreate(filepath.Join(c.data, "auth"))
	if err != nil {
		return nil, err
	}
	// Scoped keys for the stack's roles, in the account before NATS starts: their users' JWTs
	// hold a name and a tag instead of their permissions (natsauth, scope.go).
	if changed, err := natsperm.AddScopes(chain, append(natsperm.Scopes(), c.gatewayRole())); err != nil {
		return nil, err
	} else if changed {
		if err := chain.Save(); err != nil {
			return nil, err
		}
	}
	s := &security{chain: chain, creds: filepath.Join(c.data, "creds")}
	if c.natsTLS {
		f, err := natsauth.LoadOrCreateTLS(filepath.Join(c.data, "auth", "tls"))
		if err != nil {
			return nil, err
		}
		s.tls = &f
	}
	return s, nil
}

// server makes cfg trust the chain (and serve TLS).
func (s *security) server(cfg *embednats.Config) error {
	if s == nil {
		return nil
	}
	cfg.Auth = s.chain
	if s.tls != nil {
		t, err := s.tls.ServerConfig()
		if err != nil {
			return err
		}
		cfg.TLS = t
	}
	return nil
}

// conn is how a process of role connects to url: its credentials file, written now.
func (s *security) conn(url string, role natsperm.Role) (natsconn.Options, error) {
	o := natsconn.Options{URL: url}
	if s == nil {
		return o, nil
	}
	path, err := s.chain.WriteCreds(s.creds, role)
	if err != nil {
		return o, fmt.Errorf("credentials for %s: %w", role.Name, err)
	}
	// Kept with the user on record, so `rebalance auth revoke --dir <data>/auth --role ...
	// --push` works on the stack too.
	if err := s.chain.Save(); err != nil {
		return o, err
	}
	o.Creds = path
	if s.tls != nil {
		o.TLSCA = s.tls.CA
	}
	return o, nil
}

// args are o as command-line flags (file paths only; no secret is on a command line).
func args(o natsconn.Options) []string {
	a := []string{"--nats-url", o.URL}
	if o.Creds != "" {
		a = append(a, "--nats-creds", o.Creds)
	}
	if o.TLSCA != "" {
		a = append(a, "--nats-tls-ca", o.TLSCA)
	}
	return a
}

// gateKeys are the gateway proof's keys (internal/gatesig) under <data>/auth: the gateways'
// key gate.key (made on first start, kept) and each kind's key under gate/, so the stack's
// shards serve only requests its gateways proved, as a production deployment's do.
type gateKeys struct{ dir, master string }

func newGateKeys(dir string) (*gateKeys, error) {
	g := &gateKeys{dir: dir, master: filepath.Join(dir, "gate.key")}
	if _, err := gatesig.LoadOrCreate(g.master); err != nil {
		return nil, fmt.Errorf("the gateways' key: %w", err)
	}
	return g, nil
}

// gateway are a gateway's flags.
func (g *gateKeys) gateway() []string { return []string{"--shard-key-file", g.master} }

// shard are the flags of a shard of kind, its key written now.
func (g *gateKeys) shard(kind string) ([]string, error) {
	master, err := gatesig.ReadKeyFile(g.master)
	if err != nil {
		return nil, err
	}
	path := filepath.Join(g.dir, "gate", kind+".key")
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, err
	}
	return []string{"--gateway-key-file", path}, gatesig.WriteKeyFile(path, gatesig.KindKey(master, kind))
}
