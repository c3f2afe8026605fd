package certfile

import (
	"crypto/tls"
	"crypto/x509"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/natsauth"
)

func copyFile(t *testing.T, from, to string, mod time.Time) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chtimes(to, mod, mod); err != nil {
		t.Fatal(err)
	}
}

// A renewed certificate is served on the next handshake after the check interval; a broken
// renewal keeps the previous one.
func TestReload(t *testing.T) {
	a, err := natsauth.LoadOrCreateTLS(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	b, err := natsauth.LoadOrCreateTLS(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	cert, key := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	t0 := time.Now().Add(-time.Hour)
	copyFile(t, a.Cert, cert, t0)
	copyFile(t, a.Key, key, t0)
	r, err := New(cert, key, nil)
	if err != nil {
		t.Fatal(err)
	}
	clock := time.Now()
	r.now = func() time.Time { return clock }

	ln, err := tls.Listen("tcp", "127.0.0.1:0", r.ServerConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_ = c.(*tls.Conn).Handshake()
			c.Close()
		}
	}()
	pool := x509.NewCertPool()
	for _, ca := range []string{a.CA, b.CA} {
		if _, err := Pool(ca); err != nil {
			t.Fatal(err)
		}
		pem, _ := os.ReadFile(ca)
		pool.AppendCertsFromPEM(pem)
	}
	served := func() string {
		t.Helper()
		c, err := tls.DialWithDialer(&net.Dialer{Timeout: 2 * time.Second}, "tcp", ln.Addr().String(), &tls.Config{RootCAs: pool, ServerName: "localhost"})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		return c.ConnectionState().PeerCertificates[0].SerialNumber.String()
	}
	first := served()

	copyFile(t, b.Cert, cert, t0.Add(time.Minute))
	copyFile(t, b.Key, key, t0.Add(time.Minute))
	if got := served(); got != first {
		t.Fatal("reloaded within the check interval")
	}
	clock = clock.Add(2 * time.Second)
	second := served()
	if second == first {
		t.Fatal("renewed certificate not served")
	}

	if err := os.WriteFile(key, []byte("half written"), 0o600); err != nil {
		t.Fatal(err)
	}
	clock = clock.Add(2 * time.Second)
	if got := served(); got != second {
		t.Fatal("a broken renewal replaced the certificate")
	}
}
