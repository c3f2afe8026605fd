// Package natsauth makes and keeps the NATS trust chain tenantmesh runs on: an operator, the
// system account, and the TENANTMESH account (JetStream enabled) whose users are tenantmesh's
// roles (natsperm). It is NATS's decentralized JWT auth, the way production NATS is run: the
// server trusts the operator, and a user proves itself with a .creds file (its JWT and nkey
// seed) that the account key signed. Nothing but the account's seed is needed to mint a user,
// so `rebalance auth creds` can make a shard's credentials at deploy time.
//
// The dev stack and the tests use it through embednats (Config.Auth); deploy/ ships the server
// config it writes (ServerConfig).
package natsauth

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nkeys"

	"github.com/tenantmesh/tenantmesh/internal/natsinbox"
	"github.com/tenantmesh/tenantmesh/internal/secretfile"
)

// Role is one user: its name and the subjects it may publish and subscribe to (natsperm makes
// tenantmesh's). The name is also its inbox: replies come on _INBOX_<Name>.>.
type Role struct {
	Name     string
	Pub, Sub []string
	// Respond lets the role answer requests it receives (one reply each, to whatever reply
	// subject the requester chose: NATS's allow_responses), without a publish permission on
	// the requesters' inboxes.
	Respond bool
	// Template, if set, is the role's permissions as NATS permission templates: what differs
	// between users of one kind of role written as {{tag(<key>)}}, which Tags fill in for
	// this user. A chain with a scoped key for it (AddScope; scope.go) mints the role's
	// users with that key, their JWTs holding no permissions of their own. Without Template,
	// the role is its own template (no tags).
	Template *Role             `json:",omitempty"`
	Tags     map[string]string `json:",omitempty"`
}

// Inbox is the reply prefix the role's connections use (natsconn reads the name from the JWT).
func (r Role) Inbox() string { return natsinbox.Prefix(r.Name) }

// Sorted returns r with its subjects sorted and deduplicated, for tables and stable JWTs.
func (r Role) Sorted() Role {
	sortUniq := func(s []string) []string {
		s = slices.Clone(s)
		slices.Sort(s)
		return slices.Compact(s)
	}
	out := Role{Name: r.Name, Pub: sortUniq(r.Pub), Sub: sortUniq(r.Sub), Respond: r.Respond, Tags: maps.Clone(r.Tags)}
	if r.Template != nil {
		t := r.Template.Sorted()
		out.Template = &t
	}
	return out
}

// Admin may do everything in tenantmesh's account: the rebalancer and the operator CLI.
func Admin() Role { return Role{Name: "rebalancer", Pub: []string{">"}, Sub: []string{">"}} }

// AccountName is the account tenantmesh's users live in.
const AccountName = "TENANTMESH"

// Chain is an operator with a system account and tenantmesh's account. Seeds are secrets.
//
// Users are signed by the account's signing keys (users.go), each with a version (seed 003's
// key version), not by the account's own key: a signing key can be retired, which cuts off every
// user it signed, without changing the account. Users expire (DefaultExpiry), can be revoked
// one by one or by role, and every change to the account is pushed to running servers through
// the system account (Push), so neither a rotation nor a revocation restarts anything.
type Chain struct {
	OperatorSeed string `json:"operator_seed"`
	OperatorJWT  string `json:"operator_jwt"`
	SystemSeed   string `json:"system_seed"`
	SystemJWT    string `json:"system_jwt"`
	AccountSeed  string `json:"account_seed"`
	AccountJWT   string `json:"account_jwt"`
	// SigningKeys sign users; the newest version signs new ones. A chain made before there
	// were signing keys has none, and its users are signed by the account key until Rotate.
	SigningKeys []SigningKey `json:"signing_keys,omitempty"`
	// Revocations: a user's public key (or "*" for all) -> users of it issued at or before
	// this unix time are refused.
	Revocations map[string]int64 `json:"revocations,omitempty"`
	// Users are the users minted and not yet expired, so they can be revoked by role.
	Users []User `json:"users,omitempty"`
	// Roles are the roles minted, by name, so a rotation can mint each again.
	Roles map[string]Role `json:"roles,omitempty"`

	dir string     // where LoadOrCreate found it; Save writes there
	mu  sync.Mutex // Users, as credentials are minted concurrently (tests)
}

// New makes a fresh chain.
func New() (*Chain, error) {
	op, err := nkeys.CreateOperator()
	if err != nil {
		return nil, err
	}
	opPub, _ := op.PublicKey()
	sys, sysJWT, err := account(op, "SYS", false)
	if err != nil {
		return nil, err
	}
	acc, accJWT, err := account(op, AccountName, true)
	if err != nil {
		return nil, err
	}
	sysPub, _ := sys.PublicKey()
	oc := jwt.NewOperatorClaims(opPub)
	oc.Name = "tenantmesh"
	oc.SystemAccount = sysPub
	opJWT, err := oc.Encode(op)
	if err != nil {
		return nil, fmt.Errorf("natsauth: encode operator: %w", err)
	}
	c := &Chain{OperatorJWT: opJWT, SystemJWT: sysJWT, AccountJWT: accJWT}
	c.OperatorSeed, c.SystemSeed, c.AccountSeed = seed(op), seed(sys), seed(acc)
	if err := c.addSigningKey(); err != nil {
		return nil, err
	}
	return c, nil
}

func account(op nkeys.KeyPair, name string, jetStream bool) (nkeys.KeyPair, string, error) {
	kp, err := nkeys.CreateAccount()
	if err != nil {
		return nil, "", err
	}
	pub, _ := kp.PublicKey()
	ac := jwt.NewAccountClaims(pub)
	ac.Name = name
	if jetStream {
		ac.Limits.JetStreamLimits = jwt.JetStreamLimits{MemoryStorage: -1, DiskStorage: -1, Streams: -1, Consumer: -1,
			MaxAckPending: -1, MemoryMaxStreamBytes: -1, DiskMaxStreamBytes: -1}
	}
	tok, err := ac.Encode(op)
	if err != nil {
		return nil, "", fmt.Errorf("natsauth: encode account %s: %w", name, err)
	}
	return kp, tok, nil
}

func seed(kp nkeys.KeyPair) string {
	s, _ := kp.Seed()
	return string(s)
}

func pub(jwtString string) string {
	c, err := jwt.Decode(jwtString)
	if err != nil {
		return ""
	}
	return c.Claims().Subject
}

// chainFile is the chain's file in a LoadOrCreate directory.
const chainFile = "chain.json"

// LoadOrCreate reads the chain kept in dir, or makes one and keeps it there (mode 0600).
func LoadOrCreate(dir string) (*Chain, error) {
	path := filepath.Join(dir, chainFile)
	b, err := os.ReadFile(path)
	if err == nil {
		var c Chain
		if err := json.Unmarshal(b, &c); err != nil {
			return nil, fmt.Errorf("natsauth: %s: %w", path, err)
		}
		if pub(c.AccountJWT) == "" || pub(c.OperatorJWT) == "" {
			return nil, fmt.Errorf("natsauth: %s holds no trust chain; remove it to make a new one", path)
		}
		c.dir = dir
		return &c, nil
	}
	if !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("natsauth: %w", err)
	}
	c, err := New()
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("natsauth: %w", err)
	}
	c.dir = dir
	if err := c.Save(); err != nil {
		return nil, err
	}
	return c, nil
}

// Save writes the chain back where LoadOrCreate found it (mode 0600), dropping users that
// have expired.
func (c *Chain) Save() error {
	if c.dir == "" {
		return errors.New("natsauth: the chain was not loaded from a directory")
	}
	c.forgetExpired(time.Now())
	c.mu.Lock()
	b, _ := json.MarshalIndent(c, "", "  ")
	c.mu.Unlock()
	return writeFile(filepath.Join(c.dir, chainFile), b)
}

// writeFile writes a secret with mode 0600 through a new file (secretfile).
func writeFile(path string, b []byte) error {
	if err := secretfile.Write(path, b); err != nil {
		return fmt.Errorf("natsauth: %w", err)
	}
	return nil
}

// Configure makes opts trust the chain: the operator, its system account, and both accounts'
// JWTs preloaded in a memory resolver.
func (c *Chain) Configure(opts *server.Options) error {
	oc, err := jwt.DecodeOperatorClaims(c.OperatorJWT)
	if err != nil {
		return fmt.Errorf("natsauth: operator JWT: %w", err)
	}
	res := &server.MemAccResolver{}
	for _, a := range []string{c.SystemJWT, c.AccountJWT} {
		if err := res.Store(pub(a), a); err != nil {
			return err
		}
	}
	opts.TrustedOperators = []*jwt.OperatorClaims{oc}
	opts.SystemAccount = pub(c.SystemJWT)
	opts.AccountResolver = res
	return nil
}

// ServerConfig is the nats-server configuration block that trusts the chain, for a config file
// (include it: `include auth.conf`).
func (c *Chain) ServerConfig() string {
	var b strings.Builder
	fmt.Fprintf(&b, "# tenantmesh trust chain (made by `rebalance auth init`). Public keys and JWTs only.\n")
	fmt.Fprintf(&b, "operator: %s\n", c.OperatorJWT)
	fmt.Fprintf(&b, "system_account: %s\n", pub(c.SystemJWT))
	fmt.Fprintf(&b, "resolver: MEMORY\n")
	fmt.Fprintf(&b, "resolver_preload: {\n  %s: %s\n  %s: %s\n}\n",
		pub(c.SystemJWT), c.SystemJWT, pub(c.AccountJWT), c.AccountJWT)
	return b.String()
}

// Creds mints a user for role in tenantmesh's account, expiring after DefaultExpiry, and
// returns its .creds file.
func (c *Chain) Creds(role Role) ([]byte, error) {
	return c.CredsFor(role, DefaultExpiry)
}

// SystemCreds mints a user of the system account, for server monitoring (nats server ls) and
// for pushing account updates (Push); it expires after DefaultExpiry.
func (c *Chain) SystemCreds() ([]byte, error) {
	b, _, err := creds(c.SystemSeed, "", Role{Name: "system", Pub: []string{">"}, Sub: []string{">"}}, DefaultExpiry)
	return b, err
}

// creds mints a user of role signed by signer (a seed); issuer, if set, is the account the
// signer signs for (a signing key's). ttl 0: no expiry.
func creds(signer, issuer string, role Role, ttl time.Duration) ([]byte, User, error) {
	return mint(signer, issuer, role, false, ttl)
}

// mint mints a user of role signed by signer; scoped: signer is a scoped key, which holds the
// permissions, so the user carries only its name and role's tags.
func mint(signer, issuer string, role Role, scoped bool, ttl time.Duration) ([]byte, User, error) {
	kp, err := nkeys.FromSeed([]byte(signer))
	if err != nil {
		return nil, User{}, fmt.Errorf("natsauth: signing seed: %w", err)
	}
	u, err := nkeys.CreateUser()
	if err != nil {
		return nil, User{}, err
	}
	upub, _ := u.PublicKey()
	uc := jwt.NewUserClaims(upub)
	uc.Name = role.Name
	uc.IssuerAccount = issuer
	if ttl > 0 {
		uc.Expires = time.Now().Add(ttl).Unix()
	}
	if scoped {
		uc.UserPermissionLimits = jwt.UserPermissionLimits{} // none at all: the scope has them (limits too)
		for _, k := range slices.Sorted(maps.Keys(role.Tags)) {
			uc.Tags.Add(k + ":" + role.Tags[k])
		}
	} else {
		r := role.Sorted()
		uc.Pub.Allow = jwt.StringList(r.Pub)
		uc.Sub.Allow = jwt.StringList(r.Sub)
		if r.Respond {
			uc.Resp = responses()
		}
	}
	tok, err := uc.Encode(kp)
	if err != nil {
		return nil, User{}, fmt.Errorf("natsauth: encode user %s: %w", role.Name, err)
	}
	s, _ := u.Seed()
	b, err := jwt.FormatUserConfig(tok, s)
	return b, User{Name: role.Name, Key: upub, Issued: uc.IssuedAt, Expires: uc.Expires}, err
}

// WriteCreds mints role's credentials into dir/<role>.creds (mode 0600) and returns the path.
func (c *Chain) WriteCreds(dir string, role Role) (string, error) {
	b, err := c.Creds(role)
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("natsauth: %w", err)
	}
	path := filepath.Join(dir, role.Name+".creds")
	return path, writeFile(path, b)
}
