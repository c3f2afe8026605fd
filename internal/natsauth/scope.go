package natsauth

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nkeys"
)

// Scoped signing keys keep a role's permissions in the account, not in each user's JWT.
//
// A NATS server puts the requester's JWT into the client information of every JetStream API
// request (the Nats-Request-Info header: the server marshals it per request and the JetStream
// layer parses it back). A shard's permissions, a few hundred subjects, made its JWT 10-15 KB,
// and that JSON work took about an eighth of the server's CPU under the e2e's load. A user
// signed by a scoped key carries no permissions: the server takes them from the key's scope
// in the account JWT, a template that the user's name and tags fill in ({{tag(shard)}}). Its
// JWT is well under 1 KB, and what it may do is exactly what the role's own JWT would allow:
// CredsFor uses a scope only when the template, filled in with the user's tags, is that role.

// ScopedKey is a signing key whose users take their permissions from Template.
type ScopedKey struct {
	Seed     string `json:"seed"`
	Template Role   `json:"template"`
}

func newScopedKey(t Role) (ScopedKey, error) {
	kp, err := nkeys.CreateAccount()
	if err != nil {
		return ScopedKey{}, err
	}
	return ScopedKey{Seed: seed(kp), Template: t.Sorted()}, nil
}

// userScope is k as the account JWT's scoped signer.
func (k ScopedKey) userScope() (*jwt.UserScope, error) {
	kp, err := nkeys.FromSeed([]byte(k.Seed))
	if err != nil {
		return nil, fmt.Errorf("scoped key of %s: %w", k.Template.Name, err)
	}
	us := jwt.NewUserScope()
	us.Key, _ = kp.PublicKey()
	us.Role = k.Template.Name
	us.Template.Pub.Allow = jwt.StringList(k.Template.Pub)
	us.Template.Sub.Allow = jwt.StringList(k.Template.Sub)
	if k.Template.Respond {
		us.Template.Resp = responses()
	}
	return us, nil
}

// responses is the reply permission of a role that answers requests: one reply each, within
// a minute.
func responses() *jwt.ResponsePermission {
	return &jwt.ResponsePermission{MaxMsgs: 1, Expires: time.Minute}
}

// template is r's template: Template, or r itself when it has none.
func (r Role) template() Role {
	if r.Template != nil {
		return r.Template.Sorted()
	}
	return Role{Name: r.Name, Pub: r.Pub, Sub: r.Sub, Respond: r.Respond}.Sorted()
}

// AddScope gives the newest signing key a scoped key for r's template, unless it has one: r's
// users minted from then on carry no permissions of their own. It reports whether the account
// changed; if it did, servers already running need the account (Push, or a restart with the
// new ServerConfig) before such a user can connect. A chain without signing keys (made before
// there were any) adds none: Rotate first.
func (c *Chain) AddScope(r Role) (bool, error) {
	n := len(c.SigningKeys)
	if n == 0 {
		return false, nil
	}
	t := r.template()
	if slices.ContainsFunc(c.SigningKeys[n-1].Scoped, func(k ScopedKey) bool { return sameGrants(k.Template, t) }) {
		return false, nil
	}
	k, err := newScopedKey(t)
	if err != nil {
		return false, err
	}
	c.SigningKeys[n-1].Scoped = append(c.SigningKeys[n-1].Scoped, k)
	return true, c.encodeAccount()
}

// scopeFor is the newest version's scoped key that mints r: its template, filled in with r's
// tags as a server would, grants exactly what r does.
func (c *Chain) scopeFor(r Role) (ScopedKey, bool) {
	n := len(c.SigningKeys)
	if n == 0 {
		return ScopedKey{}, false
	}
	t := r.template()
	for _, k := range c.SigningKeys[n-1].Scoped {
		if !sameGrants(k.Template, t) {
			continue
		}
		if got, ok := fill(t, r.Tags); ok && sameGrants(got, r) {
			return k, true
		}
		return ScopedKey{}, false
	}
	return ScopedKey{}, false
}

// fill is template t with each {{tag(key)}} replaced by tags[key]; false if a tag would not
// survive as a user's tag (NATS lowercases tags and trims spaces) or a placeholder is left.
func fill(t Role, tags map[string]string) (Role, bool) {
	var pairs []string
	for _, k := range slices.Sorted(maps.Keys(tags)) {
		v := tags[k]
		if k == "" || v == "" || strings.ToLower(strings.TrimSpace(k)) != k || strings.ToLower(strings.TrimSpace(v)) != v || strings.ContainsAny(k, ":{}") {
			return Role{}, false
		}
		pairs = append(pairs, "{{tag("+k+")}}", v)
	}
	rep := strings.NewReplacer(pairs...)
	out := Role{Name: t.Name, Respond: t.Respond}
	for _, s := range t.Pub {
		out.Pub = append(out.Pub, rep.Replace(s))
	}
	for _, s := range t.Sub {
		out.Sub = append(out.Sub, rep.Replace(s))
	}
	for _, s := range slices.Concat(out.Pub, out.Sub) {
		if strings.Contains(s, "{{") {
			return Role{}, false
		}
	}
	return out, true
}

// sameGrants reports whether a and b allow the same subjects and replies.
func sameGrants(a, b Role) bool {
	a, b = a.Sorted(), b.Sorted()
	return a.Respond == b.Respond && slices.Equal(a.Pub, b.Pub) && slices.Equal(a.Sub, b.Sub)
}
