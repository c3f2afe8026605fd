package edgeauth_test

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"

	"github.com/tenantmesh/tenantmesh/gateway/edgeauth"
)

// TestAttackLaxConfig (low): a verifier without an issuer or an audience accepted any token the
// identity provider signed, for any of its relying parties (or another provider sharing the
// key), and a JWKS fetched over plain http could be replaced on the way. Both are refused at
// start now (http stays allowed on a loopback address).
func TestAttackLaxConfig(t *testing.T) {
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, _ := x509.MarshalPKIXPublicKey(pub)
	path := filepath.Join(t.TempDir(), "idp.pem")
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	// A token the provider issued to another service: no audience of ours.
	other, _ := jwt.NewWithClaims(jwt.SigningMethodEdDSA, jwt.MapClaims{"sub": "s", "tenant_id": "acme", "iss": "https://idp.example",
		"aud": "billing", "exp": time.Now().Add(time.Minute).Unix()}).SignedString(priv)
	for _, cfg := range []edgeauth.Config{{KeyFile: path}, {KeyFile: path, Issuer: "https://idp.example"}, {KeyFile: path, Audience: "tenantmesh"}} {
		v, err := edgeauth.New(context.Background(), cfg)
		if err == nil {
			if _, verr := v.VerifyToken(other); verr == nil {
				t.Errorf("issuer %q audience %q: the verifier started and took another service's token", cfg.Issuer, cfg.Audience)
			}
			continue
		}
		if !strings.Contains(err.Error(), "--jwt-issuer and --jwt-audience") {
			t.Errorf("issuer %q audience %q: %v", cfg.Issuer, cfg.Audience, err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = edgeauth.New(ctx, edgeauth.Config{JWKSURL: "http://idp.invalid/.well-known/jwks.json", Issuer: "i", Audience: "a", FetchTimeout: time.Second})
	if err == nil || !strings.Contains(err.Error(), "must be https") {
		t.Fatalf("a JWKS over plain http: %v; want it refused for not being https", err)
	}
}
