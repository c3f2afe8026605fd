package natsauth

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
)

// DefaultExpiry is how long a user minted by Creds stays valid: a leaked credentials file
// stops working by then even if nobody revokes it. Processes pick up renewed files when they
// reconnect (natsconn reads the file on every connect), so renewing means minting again
// before it ends (`rebalance auth creds`, or the dev stack at each start).
const DefaultExpiry = 90 * 24 * time.Hour

// SigningKey is one version of the account's user-signing key.
type SigningKey struct {
	Version int    `json:"version"`
	Seed    string `json:"seed"`
	// Scoped are this version's scoped keys, one per role template (scope.go).
	Scoped []ScopedKey `json:"scoped,omitempty"`
}

// User is a user the chain minted.
type User struct {
	Name    string `json:"name"`
	Key     string `json:"key"` // public nkey
	Version int    `json:"version"`
	Issued  int64  `json:"issued"`
	Expires int64  `json:"expires,omitempty"`
}

// KeyVersion is the version of the newest signing key (0: users are signed by the account key).
func (c *Chain) KeyVersion() int {
	if len(c.SigningKeys) == 0 {
		return 0
	}
	return c.SigningKeys[len(c.SigningKeys)-1].Version
}

// CredsFor mints a user for role, valid for ttl (0: no expiry), signed by the newest signing
// key, and keeps it in Users (Save to keep that).
//
// A role whose template has a scoped key in the newest version (AddScope) is signed by that
// key, and its JWT carries only its name and tags; any other role carries its permissions.
func (c *Chain) CredsFor(role Role, ttl time.Duration) ([]byte, error) {
	signer, issuer, scoped := c.AccountSeed, "", false
	if n := len(c.SigningKeys); n > 0 {
		signer, issuer = c.SigningKeys[n-1].Seed, pub(c.AccountJWT)
		if k, ok := c.scopeFor(role); ok {
			signer, scoped = k.Seed, true
		}
	}
	b, u, err := mint(signer, issuer, role, scoped, ttl)
	if err != nil {
		return nil, err
	}
	u.Version = c.KeyVersion()
	c.mu.Lock()
	c.Users = append(c.Users, u)
	if c.Roles == nil {
		c.Roles = map[string]Role{}
	}
	c.Roles[role.Name] = role.Sorted()
	c.mu.Unlock()
	return b, nil
}

// account decodes the account's claims.
func (c *Chain) account() (*jwt.AccountClaims, error) {
	ac, err := jwt.DecodeAccountClaims(c.AccountJWT)
	if err != nil {
		return nil, fmt.Errorf("natsauth: account JWT: %w", err)
	}
	return ac, nil
}

// encodeAccount re-signs the account's claims with the operator key, with the chain's signing
// keys and revocations.
func (c *Chain) encodeAccount() error {
	ac, err := c.account()
	if err != nil {
		return err
	}
	ac.SigningKeys = jwt.SigningKeys{}
	for _, k := range c.SigningKeys {
		kp, err := nkeys.FromSeed([]byte(k.Seed))
		if err != nil {
			return fmt.Errorf("natsauth: signing key %d: %w", k.Version, err)
		}
		p, _ := kp.PublicKey()
		ac.SigningKeys.Add(p)
		for _, sk := range k.Scoped {
			us, err := sk.userScope()
			if err != nil {
				return fmt.Errorf("natsauth: signing key %d: %w", k.Version, err)
			}
			ac.SigningKeys.AddScopedSigner(us)
		}
	}
	ac.Revocations = jwt.RevocationList{}
	for k, t := range c.Revocations {
		ac.Revocations[k] = t
	}
	op, err := nkeys.FromSeed([]byte(c.OperatorSeed))
	if err != nil {
		return fmt.Errorf("natsauth: operator seed: %w", err)
	}
	tok, err := ac.Encode(op)
	if err != nil {
		return fmt.Errorf("natsauth: encode account: %w", err)
	}
	c.AccountJWT = tok
	return nil
}

// addSigningKey adds the next version of the signing key, with a scoped key for each template
// the version before had.
func (c *Chain) addSigningKey() error {
	kp, err := nkeys.CreateAccount()
	if err != nil {
		return err
	}
	next := SigningKey{Version: c.KeyVersion() + 1, Seed: seed(kp)}
	if n := len(c.SigningKeys); n > 0 {
		for _, sk := range c.SigningKeys[n-1].Scoped {
			k, err := newScopedKey(sk.Template)
			if err != nil {
				return err
			}
			next.Scoped = append(next.Scoped, k)
		}
	}
	c.SigningKeys = append(c.SigningKeys, next)
	return c.encodeAccount()
}

// Rotate adds a new version of the signing key, which signs every user minted from now on.
// Users of the older versions keep working until Retire; mint each role's credentials again
// in between (a process picks up its new file when it reconnects), then Retire and Push.
func (c *Chain) Rotate() (int, error) {
	if err := c.addSigningKey(); err != nil {
		return 0, err
	}
	return c.KeyVersion(), nil
}

// Retire removes every signing key older than the newest: the servers then disconnect every
// user they signed (once the account is pushed), and the users reconnect with the credentials
// minted since the rotation. It returns the versions retired.
func (c *Chain) Retire() ([]int, error) {
	if len(c.SigningKeys) < 2 {
		return nil, nil
	}
	var out []int
	for _, k := range c.SigningKeys[:len(c.SigningKeys)-1] {
		out = append(out, k.Version)
	}
	c.SigningKeys = c.SigningKeys[len(c.SigningKeys)-1:]
	c.Users = slices.DeleteFunc(c.Users, func(u User) bool { return slices.Contains(out, u.Version) })
	return out, c.encodeAccount()
}

// Revoke revokes the users that match: from the account's next push, servers disconnect and
// refuse them (NATS revokes a user key's JWTs issued up to now). It returns the users revoked.
func (c *Chain) Revoke(match func(User) bool) ([]User, error) {
	now := time.Now().Unix()
	var out []User
	if c.Revocations == nil {
		c.Revocations = map[string]int64{}
	}
	for _, u := range c.Users {
		if match(u) {
			c.Revocations[u.Key] = max(now, u.Issued)
			out = append(out, u)
		}
	}
	c.Users = slices.DeleteFunc(c.Users, match)
	if len(out) == 0 {
		return nil, nil
	}
	return out, c.encodeAccount()
}

// RevokeKey revokes one user by its public key (one the chain may not have recorded).
func (c *Chain) RevokeKey(key string) error {
	if !nkeys.IsValidPublicUserKey(key) {
		return fmt.Errorf("natsauth: %q is not a user's public key (U...)", key)
	}
	if c.Revocations == nil {
		c.Revocations = map[string]int64{}
	}
	c.Revocations[key] = time.Now().Unix()
	c.Users = slices.DeleteFunc(c.Users, func(u User) bool { return u.Key == key })
	return c.encodeAccount()
}

// forgetExpired drops expired users from Users (revocations stay: a user minted without an
// expiry may still be around).
func (c *Chain) forgetExpired(now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.Users = slices.DeleteFunc(c.Users, func(u User) bool { return u.Expires != 0 && u.Expires < now.Unix() })
}

// Push sends the account's claims to the running servers through the system account
// ($SYS.REQ.ACCOUNT.<account>.CLAIMS.UPDATE), connected to url with a system user minted
// for it (opts add TLS and the like): every server of the cluster applies them at once,
// disconnecting revoked users and users of retired keys. A server restarted later reads the
// account from its configuration: write ServerConfig to auth.conf too.
func (c *Chain) Push(url string, opts ...nats.Option) error {
	sys, err := c.SystemCreds()
	if err != nil {
		return err
	}
	tok, err := jwt.ParseDecoratedJWT(sys)
	if err != nil {
		return err
	}
	kp, err := jwt.ParseDecoratedNKey(sys)
	if err != nil {
		return err
	}
	s, _ := kp.Seed()
	nc, err := nats.Connect(url, append([]nats.Option{nats.UserJWTAndSeed(tok, string(s)), nats.Name("tenantmesh auth push")}, opts...)...)
	if err != nil {
		return fmt.Errorf("natsauth: connect to %s as the system account: %w", url, err)
	}
	defer nc.Close()
	msg, err := nc.Request("$SYS.REQ.ACCOUNT."+pub(c.AccountJWT)+".CLAIMS.UPDATE", []byte(c.AccountJWT), 5*time.Second)
	if err != nil {
		return fmt.Errorf("natsauth: push the account to %s: %w", url, err)
	}
	var resp struct {
		Error *struct {
			Description string `json:"description"`
		} `json:"error"`
		Data *struct {
			Message string `json:"message"`
		} `json:"data"`
	}
	if err := json.Unmarshal(msg.Data, &resp); err != nil {
		return fmt.Errorf("natsauth: push: %s", msg.Data)
	}
	if resp.Error != nil {
		return errors.New("natsauth: the server refused the account: " + resp.Error.Description)
	}
	return nil
}
