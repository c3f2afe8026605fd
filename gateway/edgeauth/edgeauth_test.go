package edgeauth_test

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"math/big"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"

	"github.com/tenantmesh/tenantmesh/gateway/edgeauth"
)

// idp is an identity provider: signing keys and a JWKS served by a real HTTP server.
type idp struct {
	*httptest.Server
	mu      sync.Mutex
	keys    map[string]*rsa.PrivateKey
	fetches atomic.Int32
}

func newIDP(t testing.TB, kids ...string) *idp {
	t.Helper()
	p := &idp{keys: map[string]*rsa.PrivateKey{}}
	for _, k := range kids {
		p.add(t, k)
	}
	p.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.fetches.Add(1)
		p.mu.Lock()
		defer p.mu.Unlock()
		var set struct {
			Keys []map[string]string `json:"keys"`
		}
		for kid, k := range p.keys {
			set.Keys = append(set.Keys, map[string]string{"kty": "RSA", "kid": kid, "alg": "RS256", "use": "sig",
				"n": b64(k.N.Bytes()), "e": b64(big.NewInt(int64(k.E)).Bytes())})
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(set)
	}))
	t.Cleanup(p.Close)
	return p
}

func b64(b []byte) string { return base64.RawURLEncoding.EncodeToString(b) }

func (p *idp) add(t testing.TB, kid string) {
	t.Helper()
	k, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	p.keys[kid] = k
	p.mu.Unlock()
}

func (p *idp) sign(t testing.TB, kid string, claims jwt.MapClaims) string {
	t.Helper()
	p.mu.Lock()
	k := p.keys[kid]
	p.mu.Unlock()
	if k == nil {
		var err error
		if k, err = rsa.GenerateKey(rand.Reader, 2048); err != nil { // a key the JWKS does not have
			t.Fatal(err)
		}
	}
	tok := jwt.NewWithClaims(jwt.SigningMethodRS256, claims)
	tok.Header["kid"] = kid
	s, err := tok.SignedString(k)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func claims(mod func(jwt.MapClaims)) jwt.MapClaims {
	now := time.Now()
	c := jwt.MapClaims{"iss": "https://idp.example", "aud": "tenantmesh", "sub": "user-7", "tenant_id": "acme",
		"iat": now.Unix(), "exp": now.Add(time.Hour).Unix()}
	if mod != nil {
		mod(c)
	}
	return c
}

func verifier(t testing.TB, p *idp) *edgeauth.Verifier {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	v, err := edgeauth.New(ctx, edgeauth.Config{JWKSURL: p.URL, Issuer: "https://idp.example", Audience: "tenantmesh",
		Leeway: 5 * time.Second, FetchTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func TestVerify(t *testing.T) {
	p := newIDP(t, "k1")
	v := verifier(t, p)
	id, err := v.VerifyToken(p.sign(t, "k1", claims(nil)))
	if err != nil || id.Subject != "user-7" || id.Tenant != "acme" {
		t.Fatalf("valid token: %+v, %v", id, err)
	}

	none, _ := jwt.NewWithClaims(jwt.SigningMethodNone, claims(nil)).SignedString(jwt.UnsafeAllowNoneSignatureType)
	p.mu.Lock()
	pub := x509.MarshalPKCS1PublicKey(&p.keys["k1"].PublicKey)
	p.mu.Unlock()
	hsTok := jwt.NewWithClaims(jwt.SigningMethodHS256, claims(nil))
	hsTok.Header["kid"] = "k1"
	hs, _ := hsTok.SignedString(pub) // the old key-confusion attack: HMAC keyed with the public key
	cases := []struct {
		name, token, reason string
	}{
		{"expired", p.sign(t, "k1", claims(func(c jwt.MapClaims) { c["exp"] = time.Now().Add(-time.Minute).Unix() })), "expired"},
		{"not yet valid", p.sign(t, "k1", claims(func(c jwt.MapClaims) { c["nbf"] = time.Now().Add(time.Minute).Unix() })), "not valid yet"},
		{"wrong audience", p.sign(t, "k1", claims(func(c jwt.MapClaims) { c["aud"] = "someone-else" })), "wrong audience"},
		{"wrong issuer", p.sign(t, "k1", claims(func(c jwt.MapClaims) { c["iss"] = "https://evil.example" })), "wrong issuer"},
		{"no exp", p.sign(t, "k1", claims(func(c jwt.MapClaims) { delete(c, "exp") })), "invalid"},
		{"unknown kid", p.sign(t, "k9", claims(nil)), "bad signature"},
		{"alg none", none, "bad signature"},
		{"HS256 with the public key", hs, "bad signature"},
		{"no tenant", p.sign(t, "k1", claims(func(c jwt.MapClaims) { delete(c, "tenant_id") })), "no tenant"},
		{"garbage", "not.a.jwt", "malformed"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := v.VerifyToken(c.token)
			var ae *edgeauth.Error
			if !errors.As(err, &ae) {
				t.Fatalf("accepted or wrong error type: %v", err)
			}
			if ae.Reason != c.reason {
				t.Errorf("reason %q (%v), want %q", ae.Reason, err, c.reason)
			}
		})
	}
	// Within the leeway an expired token still passes.
	if _, err := v.VerifyToken(p.sign(t, "k1", claims(func(c jwt.MapClaims) { c["exp"] = time.Now().Add(-2 * time.Second).Unix() }))); err != nil {
		t.Errorf("expired 2 s ago with 5 s leeway: %v", err)
	}
}

// A key added to the JWKS is found on the first token that names it; the provider going down
// fails no token whose key was fetched before.
func TestJWKSRotationAndOutage(t *testing.T) {
	p := newIDP(t, "k1")
	v := verifier(t, p)
	p.add(t, "k2")
	if _, err := v.VerifyToken(p.sign(t, "k2", claims(nil))); err != nil {
		t.Fatalf("token signed with a key added to the JWKS: %v", err)
	}
	before := p.fetches.Load()
	p.Close() // the identity provider goes away
	for i := range 3 {
		// New tokens (not cached), signed with both known keys.
		for _, kid := range []string{"k1", "k2"} {
			if _, err := v.VerifyToken(p.sign(t, kid, claims(func(c jwt.MapClaims) { c["sub"] = "u" + string(rune('a'+i)) }))); err != nil {
				t.Fatalf("%s during the outage: %v", kid, err)
			}
		}
	}
	if got := p.fetches.Load(); got != before {
		t.Errorf("%d JWKS fetches on the request path for known keys", got-before)
	}
}

func TestKeyFile(t *testing.T) {
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, _ := x509.MarshalPKIXPublicKey(pub)
	path := filepath.Join(t.TempDir(), "idp.pem")
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	v, err := edgeauth.New(context.Background(), edgeauth.Config{KeyFile: path, TenantClaim: "org", Issuer: "i", Audience: "a"})
	if err != nil {
		t.Fatal(err)
	}
	tok, _ := jwt.NewWithClaims(jwt.SigningMethodEdDSA, jwt.MapClaims{"sub": "s", "org": "globex", "iss": "i", "aud": "a", "exp": time.Now().Add(time.Minute).Unix()}).SignedString(priv)
	if id, err := v.VerifyToken(tok); err != nil || id.Tenant != "globex" {
		t.Fatalf("%+v %v", id, err)
	}
	if _, err := edgeauth.New(context.Background(), edgeauth.Config{KeyFile: path, Issuer: "i", Audience: "a", Methods: []string{"HS256"}}); err == nil {
		t.Error("HS256 accepted as a method")
	}
}

func BenchmarkVerify(b *testing.B) {
	p := newIDP(b, "k1")
	v := verifier(b, p)
	tok := p.sign(b, "k1", claims(nil))
	b.Run("cached", func(b *testing.B) {
		if _, err := v.VerifyToken(tok); err != nil {
			b.Fatal(err)
		}
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if _, err := v.VerifyToken(tok); err != nil {
					b.Fatal(err)
				}
			}
		})
	})
	b.Run("first-sight-RS256", func(b *testing.B) {
		toks := make([]string, 256)
		for i := range toks {
			toks[i] = p.sign(b, "k1", claims(func(c jwt.MapClaims) { c["sub"] = i }))
		}
		b.ReportAllocs()
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			if i%len(toks) == 0 {
				b.StopTimer()
				v2 := verifier(b, p) // an empty cache
				v = v2
				b.StartTimer()
			}
			if _, err := v.VerifyToken(toks[i%len(toks)]); err != nil {
				b.Fatal(err)
			}
		}
	})
}
