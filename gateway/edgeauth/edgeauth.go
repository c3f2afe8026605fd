// Package edgeauth checks a tenant's identity at the gateway: a bearer JWT on every tenant
// request, its signature from a JWKS URL or a local key file, its issuer, audience and
// lifetime, and the tenant it names.
//
// JWT parsing and validation are github.com/golang-jwt/jwt/v5 (the most used Go JWT library,
// strict about algorithms: only the configured ones are accepted, so "alg: none" and HMAC with
// a public key are refused). The JWKS is github.com/MicahParks/keyfunc/v3 over jwkset: fetched
// at start with a bounded time, refreshed in the background, refetched (rate-limited) for an
// unknown kid, and kept when the identity provider is down.
//
// A verified token is remembered until it expires (at most CacheTTL, CacheSize tokens), so a
// client's repeat requests cost a map lookup, not a signature check.
package edgeauth

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/MicahParks/keyfunc/v3"
	"github.com/golang-jwt/jwt/v5"
)

// Config says where keys come from and what a token must say.
type Config struct {
	// JWKSURL is the identity provider's JWK Set. One of JWKSURL and KeyFile is required.
	JWKSURL string
	// KeyFile is a PEM public key (RSA, ECDSA, Ed25519) or a JWK Set JSON file.
	KeyFile string
	// Issuer and Audience must match the token's iss and one of its aud (both required: a
	// token another relying party of the same identity provider got must not pass here).
	Issuer, Audience string
	// TenantClaim names the claim holding the tenant id. Default "tenant_id".
	TenantClaim string
	// Leeway is the clock skew allowed on exp, nbf and iat. Default 30s.
	Leeway time.Duration
	// Methods are the accepted signing algorithms. Default RS256, RS384, RS512, PS256, ES256,
	// ES384, EdDSA.
	Methods []string
	// FetchTimeout bounds one JWKS fetch. Default 5s. Refresh is how often it is fetched again
	// (default 10m); an unknown kid fetches it at most once a minute.
	FetchTimeout, Refresh time.Duration
	// CacheSize bounds remembered tokens (default 10,000: about 10 MB of tokens); CacheTTL how long one is remembered
	// at most (default 5m), so a key withdrawn from the JWKS stops working within it.
	CacheSize int
	CacheTTL  time.Duration
	Logger    *slog.Logger
}

// Identity is what a verified token says.
type Identity struct {
	Subject, Tenant string
}

// Error is a refused token. Status is 401; Reason is for the WWW-Authenticate header.
type Error struct {
	Reason string
	Err    error
}

func (e *Error) Error() string {
	if e.Err != nil {
		return e.Reason + ": " + e.Err.Error()
	}
	return e.Reason
}

func (e *Error) Unwrap() error { return e.Err }

// ErrNoToken: the request carries no bearer token.
var ErrNoToken = errors.New("no bearer token")

// Verifier checks tokens. It is safe for concurrent use.
type Verifier struct {
	cfg    Config
	parser *jwt.Parser
	keys   jwt.Keyfunc
	now    func() time.Time

	mu    sync.RWMutex
	cache map[string]cached
}

type cached struct {
	id    Identity
	until time.Time
}

// New makes a Verifier; with a JWKS URL it fetches the set first (bounded by FetchTimeout) and
// keeps refreshing it until ctx ends.
func New(ctx context.Context, cfg Config) (*Verifier, error) {
	if (cfg.JWKSURL == "") == (cfg.KeyFile == "") {
		return nil, errors.New("edgeauth: set one of --jwt-jwks-url and --jwt-key-file")
	}
	if cfg.Issuer == "" || cfg.Audience == "" {
		return nil, errors.New("edgeauth: set --jwt-issuer and --jwt-audience: without them a token the identity provider issued for another service, or another provider's, would pass")
	}
	if cfg.JWKSURL != "" {
		if err := checkJWKSURL(cfg.JWKSURL); err != nil {
			return nil, err
		}
	}
	if cfg.TenantClaim == "" {
		cfg.TenantClaim = "tenant_id"
	}
	if cfg.Leeway <= 0 {
		cfg.Leeway = 30 * time.Second
	}
	if len(cfg.Methods) == 0 {
		cfg.Methods = []string{"RS256", "RS384", "RS512", "PS256", "ES256", "ES384", "EdDSA"}
	}
	for _, m := range cfg.Methods {
		if m == "none" || strings.HasPrefix(m, "HS") {
			return nil, fmt.Errorf("edgeauth: algorithm %s is not accepted: the gateway verifies with public keys only", m)
		}
	}
	if cfg.FetchTimeout <= 0 {
		cfg.FetchTimeout = 5 * time.Second
	}
	if cfg.Refresh <= 0 {
		cfg.Refresh = 10 * time.Minute
	}
	if cfg.CacheSize <= 0 {
		cfg.CacheSize = 10_000
	}
	if cfg.CacheTTL <= 0 {
		cfg.CacheTTL = 5 * time.Minute
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	v := &Verifier{cfg: cfg, now: time.Now, cache: map[string]cached{}}
	opts := []jwt.ParserOption{jwt.WithValidMethods(cfg.Methods), jwt.WithLeeway(cfg.Leeway), jwt.WithExpirationRequired(),
		jwt.WithIssuedAt(), jwt.WithTimeFunc(func() time.Time { return v.now() })}
	opts = append(opts, jwt.WithIssuer(cfg.Issuer), jwt.WithAudience(cfg.Audience))
	v.parser = jwt.NewParser(opts...)
	var err error
	if cfg.JWKSURL != "" {
		v.keys, err = remoteKeys(ctx, cfg)
	} else {
		v.keys, err = fileKeys(cfg.KeyFile)
	}
	if err != nil {
		return nil, err
	}
	return v, nil
}

// checkJWKSURL wants https: keys fetched in the clear could be swapped on the way. A loopback
// address may use http (an identity provider's agent on the same host).
func checkJWKSURL(raw string) error {
	u, err := url.Parse(raw)
	if err != nil {
		return fmt.Errorf("edgeauth: --jwt-jwks-url %q: %w", raw, err)
	}
	if u.Scheme == "https" {
		return nil
	}
	if u.Scheme == "http" {
		if ip := net.ParseIP(u.Hostname()); (ip != nil && ip.IsLoopback()) || u.Hostname() == "localhost" {
			return nil
		}
	}
	return fmt.Errorf("edgeauth: --jwt-jwks-url %q must be https (http only on a loopback address): keys fetched in the clear could be replaced on the way", raw)
}

func remoteKeys(ctx context.Context, cfg Config) (jwt.Keyfunc, error) {
	fail := false
	kf, err := keyfunc.NewDefaultOverrideCtx(ctx, []string{cfg.JWKSURL}, keyfunc.Override{
		Client:                    &http.Client{Timeout: cfg.FetchTimeout},
		HTTPTimeout:               cfg.FetchTimeout,
		RefreshInterval:           cfg.Refresh,
		NoErrorReturnFirstHTTPReq: &fail,
		RateLimitWaitMax:          time.Second,
		RefreshErrorHandlerFunc: func(u string) func(context.Context, error) {
			return func(_ context.Context, err error) {
				cfg.Logger.Warn("JWKS refresh failed; keeping the keys fetched before", "url", u, "err", err)
			}
		},
	})
	if err != nil {
		return nil, fmt.Errorf("edgeauth: fetch the JWKS at %s (--jwt-jwks-url): %w", cfg.JWKSURL, err)
	}
	return kf.KeyfuncCtx(ctx), nil
}

func fileKeys(path string) (jwt.Keyfunc, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("edgeauth: --jwt-key-file: %w", err)
	}
	if json.Valid(b) {
		kf, err := keyfunc.NewJWKSetJSON(b)
		if err != nil {
			return nil, fmt.Errorf("edgeauth: --jwt-key-file %s: %w", path, err)
		}
		return kf.Keyfunc, nil
	}
	block, _ := pem.Decode(b)
	if block == nil {
		return nil, fmt.Errorf("edgeauth: --jwt-key-file %s is neither PEM nor a JWK Set", path)
	}
	key, err := x509.ParsePKIXPublicKey(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("edgeauth: --jwt-key-file %s: %w", path, err)
	}
	return func(*jwt.Token) (any, error) { return key, nil }, nil
}

// Verify checks r's bearer token.
func (v *Verifier) Verify(r *http.Request) (Identity, error) {
	h := r.Header.Get("Authorization")
	tok, ok := strings.CutPrefix(h, "Bearer ")
	if !ok {
		tok, ok = strings.CutPrefix(h, "bearer ")
	}
	if !ok || tok == "" {
		return Identity{}, &Error{Reason: "missing", Err: ErrNoToken}
	}
	return v.VerifyToken(tok)
}

// Cached returns the identity of a token verified before and still remembered, without any
// other work.
func (v *Verifier) Cached(tok string) (Identity, bool) {
	v.mu.RLock()
	c, ok := v.cache[tok]
	v.mu.RUnlock()
	if ok && v.now().Before(c.until) {
		return c.id, true
	}
	return Identity{}, false
}

// VerifyToken checks one compact JWT.
func (v *Verifier) VerifyToken(tok string) (Identity, error) {
	now := v.now()
	if id, ok := v.Cached(tok); ok {
		return id, nil
	}
	claims := jwt.MapClaims{}
	if _, err := v.parser.ParseWithClaims(tok, claims, v.keys); err != nil {
		return Identity{}, &Error{Reason: reason(err), Err: err}
	}
	id := Identity{}
	id.Subject, _ = claims["sub"].(string)
	id.Tenant, _ = claims[v.cfg.TenantClaim].(string)
	if id.Tenant == "" {
		return Identity{}, &Error{Reason: "no tenant", Err: fmt.Errorf("the token has no %q claim naming the tenant", v.cfg.TenantClaim)}
	}
	// Both travel to the shard in header fields: a control character would end the field
	// and start another (x-tm-epoch, a second request).
	if !headerSafe(id.Subject, MaxSubject) || !headerSafe(id.Tenant, MaxSubject) {
		return Identity{}, &Error{Reason: "bad claims", Err: fmt.Errorf("the token's sub or %q holds a control character or is longer than %d bytes", v.cfg.TenantClaim, MaxSubject)}
	}
	until := now.Add(v.cfg.CacheTTL)
	if exp, err := claims.GetExpirationTime(); err == nil && exp != nil && exp.Add(v.cfg.Leeway).Before(until) {
		until = exp.Add(v.cfg.Leeway)
	}
	v.mu.Lock()
	if len(v.cache) >= v.cfg.CacheSize {
		v.evict(now)
	}
	v.cache[tok] = cached{id: id, until: until}
	v.mu.Unlock()
	return id, nil
}

// evict drops expired tokens, and if that is not enough, half of the rest (any half: they are
// verified again on their next use). Called with mu held.
func (v *Verifier) evict(now time.Time) {
	for k, c := range v.cache {
		if !now.Before(c.until) {
			delete(v.cache, k)
		}
	}
	n := len(v.cache) / 2
	for k := range v.cache {
		if len(v.cache) <= n {
			break
		}
		delete(v.cache, k)
	}
}

// MaxSubject bounds the sub (and tenant) claim a token may carry.
const MaxSubject = 256

// headerSafe reports whether s may be a header field value: no control characters (CR, LF,
// NUL, ...), at most max bytes.
func headerSafe(s string, max int) bool {
	if len(s) > max {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < ' ' || c == 0x7f {
			return false
		}
	}
	return true
}

func reason(err error) string {
	switch {
	case errors.Is(err, jwt.ErrTokenExpired):
		return "expired"
	case errors.Is(err, jwt.ErrTokenNotValidYet), errors.Is(err, jwt.ErrTokenUsedBeforeIssued):
		return "not valid yet"
	case errors.Is(err, jwt.ErrTokenInvalidAudience):
		return "wrong audience"
	case errors.Is(err, jwt.ErrTokenInvalidIssuer):
		return "wrong issuer"
	case errors.Is(err, jwt.ErrTokenSignatureInvalid), errors.Is(err, jwt.ErrTokenUnverifiable):
		return "bad signature"
	case errors.Is(err, jwt.ErrTokenMalformed):
		return "malformed"
	}
	return "invalid"
}
