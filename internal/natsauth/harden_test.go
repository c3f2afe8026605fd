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

	"github.com/tenantmesh/tenantmesh/internal/embednats"
	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/natsauth"
)

var role = natsauth.Role{Name: "gateway", Pub: []string{"$JS.API.INFO", "_INBOX_gateway.>"}, Sub: []string{"_INBOX_gateway.>"}}

// TestAttackCredsNeverExpire (item 14): a credentials file minted by the chain used to be valid
// forever, so a leaked one could not be made to stop working. Users now carry an expiry.
func TestAttackCredsNeverExpire(t *testing.T) {
	c, err := natsauth.New()
	if err != nil {
		t.Fatal(err)
	}
	b, err := c.Creds(role)
	if err != nil {
		t.Fatal(err)
	}
	tok, _ := jwt.ParseDecoratedJWT(b)
	uc, err := jwt.DecodeUserClaims(tok)
	if err != nil {
		t.Fatal(err)
	}
	if uc.Expires == 0 || time.Until(time.Unix(uc.Expires, 0)) > 91*24*time.Hour {
		t.Fatalf("a minted user expires at %d; want within 90 days", uc.Expires)
	}
}

// server runs a NATS server trusting c, and writes role's credentials (valid for ttl).
func server(t *testing.T, c *natsauth.Chain) *embednats.Server {
	t.Helper()
	return natstest.Restart(t, embednats.Config{StoreDir: t.TempDir(), Auth: c})
}

func writeCreds(t *testing.T, c *natsauth.Chain, r natsauth.Role, ttl time.Duration) string {
	t.Helper()
	b, err := c.CredsFor(r, ttl)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), r.Name+".creds")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// watched is a connection with a channel of the errors it was disconnected with.
func watched(t *testing.T, url, creds string, opts ...nats.Option) (*nats.Conn, <-chan error) {
	t.Helper()
	errs := make(chan error, 16)
	opts = append([]nats.Option{nats.UserCredentials(creds), nats.CustomInboxPrefix("_INBOX_gateway"),
		nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			select {
			case errs <- err:
			default:
			}
		})}, opts...)
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc, errs
}

func cutOff(t *testing.T, errs <-chan error, what string) {
	t.Helper()
	select {
	case <-errs:
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: the connection was not cut off within 10 s", what)
	}
}

// TestUserExpires: a user minted for two seconds is disconnected by the server when they end,
// and cannot connect again.
func TestUserExpires(t *testing.T) {
	c, _ := natsauth.New()
	srv := server(t, c)
	path := writeCreds(t, c, role, 2*time.Second)
	_, errs := watched(t, srv.URL(), path, nats.NoReconnect())
	cutOff(t, errs, "an expired user")
	time.Sleep(time.Until(time.Now().Truncate(time.Second).Add(1100 * time.Millisecond))) // past the expiry's second: the clock itself is what is awaited
	if nc, err := nats.Connect(srv.URL(), nats.UserCredentials(path)); err == nil {
		nc.Close()
		t.Fatal("an expired user connected again")
	}
}

// TestRevokeCutsOff (item 14): revoking a role's users and pushing the account disconnects
// them at once on the running server, refuses them from then on, and leaves other users be.
func TestRevokeCutsOff(t *testing.T) {
	c, _ := natsauth.New()
	srv := server(t, c)
	leaked := writeCreds(t, c, role, time.Hour)
	other := writeCreds(t, c, natsauth.Role{Name: "rebalancer", Pub: []string{">"}, Sub: []string{">"}}, time.Hour)
	_, errs := watched(t, srv.URL(), leaked, nats.NoReconnect())
	ok, okErrs := watched(t, srv.URL(), other, nats.NoReconnect())
	users, err := c.Revoke(func(u natsauth.User) bool { return u.Name == "gateway" })
	if err != nil || len(users) != 1 {
		t.Fatalf("revoke: %v %v", users, err)
	}
	if err := c.Push(srv.URL()); err != nil {
		t.Fatal(err)
	}
	cutOff(t, errs, "a revoked user")
	if nc, err := nats.Connect(srv.URL(), nats.UserCredentials(leaked)); err == nil {
		nc.Close()
		t.Fatal("a revoked user connected again")
	}
	if _, err := ok.Request("$JS.API.INFO", nil, 2*time.Second); err != nil || len(okErrs) > 0 {
		t.Fatalf("another role after the revocation: %v", err)
	}
}

// TestRotateWithoutRestart (item 14): rotation mints a new key version; retiring the old one
// disconnects its users, and a process that reconnects with its renewed credentials file goes
// on, with neither the server nor the process restarted. The old file is refused from then on.
func TestRotateWithoutRestart(t *testing.T) {
	c, _ := natsauth.New()
	srv := server(t, c)
	dir := t.TempDir()
	path := filepath.Join(dir, "gateway.creds")
	b, _ := c.CredsFor(role, time.Hour)
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	old := writeCreds(t, c, role, time.Hour) // a copy of a version-1 file
	reconnected := make(chan struct{}, 4)
	nc, errs := watched(t, srv.URL(), path, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond),
		nats.ReconnectHandler(func(*nats.Conn) { reconnected <- struct{}{} }))
	if v, err := c.Rotate(); err != nil || v != 2 {
		t.Fatalf("rotate: %d %v", v, err)
	}
	if err := c.Push(srv.URL()); err != nil { // both versions valid now
		t.Fatal(err)
	}
	b, _ = c.CredsFor(role, time.Hour)
	if err := os.WriteFile(path, b, 0o600); err != nil { // the process's file, renewed
		t.Fatal(err)
	}
	if _, err := c.Retire(); err != nil {
		t.Fatal(err)
	}
	if err := c.Push(srv.URL()); err != nil {
		t.Fatal(err)
	}
	cutOff(t, errs, "a user of the retired key")
	select {
	case <-reconnected:
	case <-time.After(10 * time.Second):
		t.Fatal("the process did not reconnect with its renewed credentials")
	}
	if _, err := nc.Request("$JS.API.INFO", nil, 2*time.Second); err != nil {
		t.Fatalf("after the rotation: %v", err)
	}
	if nc, err := nats.Connect(srv.URL(), nats.UserCredentials(old)); err == nil {
		nc.Close()
		t.Fatal("a user of the retired key connected")
	} else if !errors.Is(err, nats.ErrAuthorization) && !strings.Contains(err.Error(), "Authorization") {
		t.Logf("refused: %v", err)
	}
}
