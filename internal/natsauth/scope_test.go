package natsauth_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/natsauth"
)

// shardRole is a role of one kind whose users differ by their shard: a template with
// {{tag(shard)}}, filled in for shard.
func shardRole(shard string) natsauth.Role {
	grants := func(s string) natsauth.Role {
		return natsauth.Role{Name: "shard-notes-" + s,
			Pub: []string{"$JS.API.INFO", "notes." + s + ".>", "_INBOX_shard-notes-" + s + ".>"},
			Sub: []string{"_INBOX_shard-notes-" + s + ".>", "ping." + s}, Respond: true}
	}
	r, t := grants(shard), grants("{{tag(shard)}}")
	t.Name = "shard-notes"
	r.Template, r.Tags = &t, map[string]string{"shard": shard}
	return r
}

// claims decodes a credentials file's user.
func claims(t *testing.T, creds []byte) *jwt.UserClaims {
	t.Helper()
	uc, _ := natstest.UserClaims(t, creds)
	return uc
}

// violations connects with creds and collects the permission violations the server reports.
func violations(t *testing.T, url, path, inbox string) (*nats.Conn, chan error) {
	t.Helper()
	errs := make(chan error, 16)
	nc, err := nats.Connect(url, nats.UserCredentials(path), nats.CustomInboxPrefix(inbox),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { errs <- err }))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc, errs
}

// TestScopedUserCarriesNoPermissions: a user of a role whose template has a scoped key holds a
// name and a tag, no subjects, and the server lets it do what the role allows and nothing else:
// the same as a user whose JWT carries the role's permissions.
func TestScopedUserCarriesNoPermissions(t *testing.T) {
	c, err := natsauth.New()
	if err != nil {
		t.Fatal(err)
	}
	classic, err := c.Creds(shardRole("notes-1"))
	if err != nil {
		t.Fatal(err)
	}
	if uc := claims(t, classic); len(uc.Pub.Allow) == 0 {
		t.Fatal("without a scope, the user must carry its permissions")
	}
	if changed, err := c.AddScope(shardRole("notes-1")); err != nil || !changed {
		t.Fatalf("add scope: %v %v", changed, err)
	}
	if changed, _ := c.AddScope(shardRole("notes-2")); changed {
		t.Fatal("a second shard of the kind needs no second scope")
	}
	srv := server(t, c)
	scoped, err := c.Creds(shardRole("notes-2"))
	if err != nil {
		t.Fatal(err)
	}
	uc := claims(t, scoped)
	if len(uc.Pub.Allow) != 0 || len(uc.Sub.Allow) != 0 || uc.Resp != nil || !uc.Tags.Contains("shard:notes-2") || uc.IssuerAccount == "" || uc.Expires == 0 {
		t.Fatalf("scoped user: pub %v sub %v resp %v tags %v issuer %q", uc.Pub.Allow, uc.Sub.Allow, uc.Resp, uc.Tags, uc.IssuerAccount)
	}
	_, n := natstest.UserClaims(t, scoped)
	if _, m := natstest.UserClaims(t, classic); n >= m {
		t.Fatalf("the scoped JWT is %d bytes, the classic one %d", n, m)
	}

	path := filepath.Join(t.TempDir(), "notes-2.creds")
	if err := os.WriteFile(path, scoped, 0o600); err != nil {
		t.Fatal(err)
	}
	nc, errs := violations(t, srv.URL(), path, "_INBOX_shard-notes-notes-2")
	if _, err := nc.Request("$JS.API.INFO", nil, 5*time.Second); err != nil {
		t.Fatalf("an allowed request (its inbox filled in from its tag): %v", err)
	}
	if _, err := nc.SubscribeSync("ping.notes-2"); err != nil {
		t.Fatal(err)
	}
	if err := nc.Publish("notes.notes-2.x", nil); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := nc.Publish("notes.notes-1.x", nil); err != nil { // another shard's
		t.Fatal(err)
	}
	if _, err := nc.SubscribeSync("ping.notes-1"); err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	deadline := time.After(10 * time.Second)
	for !seen["notes.notes-1.x"] || !seen["ping.notes-1"] {
		select {
		case err := <-errs:
			if !errors.Is(err, nats.ErrPermissionViolation) {
				t.Fatalf("unexpected error: %v", err)
			}
			for _, s := range []string{"notes.notes-1.x", "ping.notes-1", "notes.notes-2.x", "ping.notes-2"} {
				if strings.Contains(err.Error(), `"`+s+`"`) {
					seen[s] = true
				}
			}
		case <-deadline:
			t.Fatalf("violations seen: %v; want another shard's publish and subscription refused", seen)
		}
	}
	if seen["notes.notes-2.x"] || seen["ping.notes-2"] {
		t.Fatalf("its own subjects were refused: %v", seen)
	}
}

// TestScopeOnlyWhenItGrantsTheSame: a user is minted with a scope only when the template,
// filled in as the server would, is exactly its role; otherwise its JWT carries its
// permissions (NATS lowercases tags, so an upper-case shard would get another's subjects).
func TestScopeOnlyWhenItGrantsTheSame(t *testing.T) {
	c, _ := natsauth.New()
	if _, err := c.AddScope(shardRole("notes-1")); err != nil {
		t.Fatal(err)
	}
	upper := shardRole("Notes-1")
	b, err := c.Creds(upper)
	if err != nil {
		t.Fatal(err)
	}
	if uc := claims(t, b); len(uc.Pub.Allow) == 0 {
		t.Fatal("an upper-case tag was minted with the scope")
	}
	odd := shardRole("notes-3")
	odd.Pub = append(odd.Pub, "extra.subject") // not what its template says
	if b, _ = c.Creds(odd); len(claims(t, b).Pub.Allow) == 0 {
		t.Fatal("a role that differs from its template was minted with the scope")
	}
	plain := natsauth.Role{Name: "gateway", Pub: []string{"$JS.API.INFO"}, Sub: []string{"_INBOX_gateway.>"}}
	if b, _ = c.Creds(plain); len(claims(t, b).Pub.Allow) == 0 {
		t.Fatal("a role without a scope was minted without its permissions")
	}
}

// TestRotateKeepsScopes: the next signing key version gets the scopes too, its users connect,
// and retiring the old version cuts off the old scoped users.
func TestRotateKeepsScopes(t *testing.T) {
	c, _ := natsauth.New()
	if _, err := c.AddScope(shardRole("notes-1")); err != nil {
		t.Fatal(err)
	}
	srv := server(t, c)
	old := writeCreds(t, c, shardRole("notes-1"), time.Hour)
	_, errs := watched(t, srv.URL(), old, nats.NoReconnect(), nats.CustomInboxPrefix("_INBOX_shard-notes-notes-1"))
	if _, err := c.Rotate(); err != nil {
		t.Fatal(err)
	}
	if err := c.Push(srv.URL()); err != nil {
		t.Fatal(err)
	}
	renewed := writeCreds(t, c, shardRole("notes-1"), time.Hour)
	b, _ := os.ReadFile(renewed)
	if uc := claims(t, b); len(uc.Pub.Allow) != 0 {
		t.Fatal("the rotated version has no scope for the template")
	}
	if _, err := c.Retire(); err != nil {
		t.Fatal(err)
	}
	if err := c.Push(srv.URL()); err != nil {
		t.Fatal(err)
	}
	cutOff(t, errs, "a scoped user of the retired key")
	nc, err := nats.Connect(srv.URL(), nats.UserCredentials(renewed), nats.CustomInboxPrefix("_INBOX_shard-notes-notes-1"))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if _, err := nc.Request("$JS.API.INFO", nil, 5*time.Second); err != nil {
		t.Fatalf("a scoped user of the new key: %v", err)
	}
}
