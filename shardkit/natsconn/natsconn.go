// Package natsconn connects tenantmesh processes to NATS with settings that suit a control
// plane: reconnect forever and quickly, bounded dial and flush times, and the credentials and
// TLS a secured server asks for.
//
// Every binary takes the same flags (AddFlags): --nats-url, --nats-creds, --nats-nkey,
// --nats-user/--nats-password, --nats-token, --nats-tls-ca, --nats-tls-cert/--nats-tls-key,
// each also read from its TM_* variable. A credential the server refuses or a certificate that
// does not verify fails Connect at once with an error naming the setting to fix; a server that
// is not up yet is retried in the background.
package natsconn

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/internal/envflag"
	"github.com/tenantmesh/tenantmesh/internal/natsinbox"
)

// Options say where NATS is and how to prove who we are. Files are paths; at most one of
// Creds, NKey, User/Password and Token is set.
type Options struct {
	// URL is one or more server URLs, comma-separated.
	URL string
	// Creds is a .creds file: the user's JWT and nkey seed (decentralized auth).
	Creds string
	// NKey is a file holding a user nkey seed (SU...).
	NKey string
	// User and Password authenticate with a user of the server's config.
	User, Password string
	// Token authenticates with the server's authorization token.
	Token string
	// TLSCA is a PEM file of CAs that sign the server's certificate.
	TLSCA string
	// TLSCert and TLSKey are a client certificate and its key, for servers that verify clients.
	TLSCert, TLSKey string
	// InboxPrefix replaces _INBOX for reply subjects. Empty: the name in the creds file's JWT
	// gives _INBOX_<name> (what tenantmesh's roles may subscribe to), else _INBOX.
	InboxPrefix string
}

// DefaultURL is where a process looks for NATS when nothing says otherwise.
const DefaultURL = "nats://127.0.0.1:4222"

// AddFlags defines the connection flags on fs, each defaulting to its TM_* variable.
func (o *Options) AddFlags(fs *flag.FlagSet) {
	envflag.String(fs, &o.URL, "nats-url", DefaultURL, "NATS server URL(s), comma-separated")
	envflag.String(fs, &o.Creds, "nats-creds", "", "NATS credentials file (JWT and nkey seed), as `rebalance auth init` writes them")
	envflag.String(fs, &o.NKey, "nats-nkey", "", "file holding a NATS user nkey seed")
	envflag.String(fs, &o.User, "nats-user", "", "NATS user name (with --nats-password)")
	envflag.Secret(fs, &o.Password, "nats-password", "NATS password (prefer the environment variable: a flag shows in ps)")
	envflag.Secret(fs, &o.Token, "nats-token", "NATS authorization token (prefer the environment variable)")
	envflag.String(fs, &o.TLSCA, "nats-tls-ca", "", "PEM file of CAs that sign the NATS server's certificate")
	envflag.String(fs, &o.TLSCert, "nats-tls-cert", "", "client certificate (PEM) for NATS servers that verify clients")
	envflag.String(fs, &o.TLSKey, "nats-tls-key", "", "key (PEM) of --nats-tls-cert")
	envflag.String(fs, &o.InboxPrefix, "nats-inbox-prefix", "", "reply subject prefix; default _INBOX_<user> from the creds file, else _INBOX")
}

// Env is o as TM_* variables, for starting a child process that connects the same way.
// Secrets travel in the environment, never on a command line.
func (o Options) Env() []string {
	var env []string
	add := func(name, v string) {
		if v != "" {
			env = append(env, envflag.Var(name)+"="+v)
		}
	}
	add("nats-url", o.URL)
	add("nats-creds", o.Creds)
	add("nats-nkey", o.NKey)
	add("nats-user", o.User)
	add("nats-password", o.Password)
	add("nats-token", o.Token)
	add("nats-tls-ca", o.TLSCA)
	add("nats-tls-cert", o.TLSCert)
	add("nats-tls-key", o.TLSKey)
	add("nats-inbox-prefix", o.InboxPrefix)
	return env
}

// Redacted is the URL with any user information removed, for logs and errors.
func (o Options) Redacted() string { return redact(o.URL) }

func redact(urls string) string {
	parts := strings.Split(urls, ",")
	for i, p := range parts {
		if u, err := url.Parse(strings.TrimSpace(p)); err == nil && u.User != nil {
			u.User = nil
			parts[i] = u.String()
		}
	}
	return strings.Join(parts, ",")
}

// auth names the setting that carries our identity, for error messages.
func (o Options) auth() string {
	switch {
	case o.Creds != "":
		return "--nats-creds " + o.Creds + " (TM_NATS_CREDS)"
	case o.NKey != "":
		return "--nats-nkey " + o.NKey + " (TM_NATS_NKEY)"
	case o.User != "":
		return "--nats-user/--nats-password (TM_NATS_USER, TM_NATS_PASSWORD)"
	case o.Token != "":
		return "--nats-token (TM_NATS_TOKEN)"
	}
	return ""
}

// Check validates the options without dialing: one way to authenticate, files that exist.
func (o Options) Check() error {
	n := 0
	for _, v := range []string{o.Creds, o.NKey, o.User, o.Token} {
		if v != "" {
			n++
		}
	}
	if n > 1 {
		return errors.New("natsconn: set one of --nats-creds, --nats-nkey, --nats-user or --nats-token, not several")
	}
	if (o.User == "") != (o.Password == "") {
		return errors.New("natsconn: --nats-user and --nats-password go together (TM_NATS_USER, TM_NATS_PASSWORD)")
	}
	if (o.TLSCert == "") != (o.TLSKey == "") {
		return errors.New("natsconn: --nats-tls-cert and --nats-tls-key go together")
	}
	for flagName, path := range map[string]string{"nats-creds": o.Creds, "nats-nkey": o.NKey,
		"nats-tls-ca": o.TLSCA, "nats-tls-cert": o.TLSCert, "nats-tls-key": o.TLSKey} {
		if path == "" {
			continue
		}
		if _, err := os.Stat(path); err != nil {
			return fmt.Errorf("natsconn: --%s (%s): %w", flagName, envflag.Var(flagName), err)
		}
	}
	return nil
}

// options are the nats.go options that carry o's identity and TLS.
func (o Options) options() ([]nats.Option, error) {
	if err := o.Check(); err != nil {
		return nil, err
	}
	var opts []nats.Option
	switch {
	case o.Creds != "":
		opts = append(opts, nats.UserCredentials(o.Creds))
	case o.NKey != "":
		opt, err := nats.NkeyOptionFromSeed(o.NKey)
		if err != nil {
			return nil, fmt.Errorf("natsconn: --nats-nkey %s: %w", o.NKey, err)
		}
		opts = append(opts, opt)
	case o.User != "":
		opts = append(opts, nats.UserInfo(o.User, o.Password))
	case o.Token != "":
		opts = append(opts, nats.Token(o.Token))
	}
	if o.TLSCA != "" {
		opts = append(opts, nats.RootCAs(o.TLSCA))
	}
	if o.TLSCert != "" {
		opts = append(opts, nats.ClientCert(o.TLSCert, o.TLSKey))
	}
	prefix := o.InboxPrefix
	if prefix == "" && o.Creds != "" {
		name, err := credsUser(o.Creds)
		if err != nil {
			return nil, fmt.Errorf("natsconn: --nats-creds %s: %w", o.Creds, err)
		}
		if name != "" {
			prefix = natsinbox.Prefix(name) // the only inbox its role may read
		}
	}
	if prefix != "" {
		opts = append(opts, nats.CustomInboxPrefix(prefix))
	}
	return opts, nil
}

// credsUser reads the user name from a creds file's JWT.
func credsUser(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	tok, err := jwt.ParseDecoratedJWT(b)
	if err != nil {
		return "", fmt.Errorf("not a credentials file: %w", err)
	}
	uc, err := jwt.DecodeUserClaims(tok)
	if err != nil {
		return "", fmt.Errorf("not a user JWT: %w", err)
	}
	return uc.Name, nil
}

// Connect dials o.URL as name. A server that is not up yet is retried in the background, so a
// process can start before NATS does; credentials the server refuses and certificates that do
// not verify fail at once, with the setting to fix named. extra options come last.
func Connect(o Options, name string, log *slog.Logger, extra ...nats.Option) (*nats.Conn, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	auth, err := o.options()
	if err != nil {
		return nil, err
	}
	opts := append([]nats.Option{
		nats.Name(name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.ReconnectJitter(100*time.Millisecond, 100*time.Millisecond),
		nats.Timeout(2 * time.Second),
		nats.PingInterval(5 * time.Second),
		nats.MaxPingsOutstanding(2),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			log.Warn("nats disconnected", "err", err)
		}),
		nats.ReconnectHandler(func(c *nats.Conn) {
			log.Info("nats reconnected", "url", c.ConnectedUrlRedacted())
		}),
		nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
			// Permission violations arrive here: a role asked for a subject it may not use.
			attrs := []any{"err", err}
			if sub != nil {
				attrs = append(attrs, "subject", sub.Subject)
			}
			log.Error("nats", attrs...)
		}),
	}, auth...)
	opts = append(opts, extra...)
	// One plain attempt first: if the server is up and refuses us, say so now.
	nc, err := nats.Connect(o.URL, opts...)
	if err == nil {
		return nc, nil
	}
	if fatal := o.explain(err); fatal != nil {
		return nil, fatal
	}
	log.Warn("NATS not reachable yet; retrying in the background", "url", o.Redacted(), "err", err)
	nc, err = nats.Connect(o.URL, append(opts, nats.RetryOnFailedConnect(true))...)
	if err != nil {
		return nil, fmt.Errorf("connect to NATS at %s: %w", o.Redacted(), err)
	}
	return nc, nil
}

// Dial connects once, for short-lived commands: no background retry.
func Dial(o Options, name string, timeout time.Duration) (*nats.Conn, error) {
	auth, err := o.options()
	if err != nil {
		return nil, err
	}
	nc, err := nats.Connect(o.URL, append([]nats.Option{nats.Name(name), nats.Timeout(timeout)}, auth...)...)
	if err != nil {
		if fatal := o.explain(err); fatal != nil {
			return nil, fatal
		}
		return nil, fmt.Errorf("cannot reach NATS at %s (set --nats-url or TM_NATS_URL): %w", o.Redacted(), err)
	}
	return nc, nil
}

// explain turns a refused credential or a failed TLS handshake into an error naming the
// setting to fix. Other errors (server down) give nil: those are worth retrying.
func (o Options) explain(err error) error {
	where := o.Redacted()
	switch {
	case isAuth(err):
		if a := o.auth(); a != "" {
			return fmt.Errorf("NATS at %s refused our credentials from %s: %w; check the setting points at this role's credentials for this server", where, a, err)
		}
		return fmt.Errorf("NATS at %s needs credentials: set --nats-creds (TM_NATS_CREDS) to this role's .creds file: %w", where, err)
	case errors.Is(err, nats.ErrSecureConnRequired):
		return fmt.Errorf("NATS at %s requires TLS: use a tls:// URL and set --nats-tls-ca (TM_NATS_TLS_CA) to the CA that signs its certificate: %w", where, err)
	case errors.Is(err, nats.ErrSecureConnWanted):
		return fmt.Errorf("NATS at %s does not offer TLS but TLS settings were given: drop --nats-tls-* or enable TLS on the server: %w", where, err)
	case isTLS(err):
		return fmt.Errorf("TLS with NATS at %s failed: check --nats-tls-ca (TM_NATS_TLS_CA) names the CA that signs the server's certificate, and --nats-tls-cert/--nats-tls-key if the server verifies clients: %w", where, err)
	}
	return nil
}

func isAuth(err error) bool {
	if errors.Is(err, nats.ErrAuthorization) || errors.Is(err, nats.ErrAuthExpired) ||
		errors.Is(err, nats.ErrAuthRevoked) || errors.Is(err, nats.ErrAccountAuthExpired) {
		return true
	}
	s := strings.ToLower(err.Error())
	return strings.Contains(s, "authorization violation") || strings.Contains(s, "authentication")
}

func isTLS(err error) bool {
	var unknownCA x509.UnknownAuthorityError
	var host x509.HostnameError
	var invalid x509.CertificateInvalidError
	var verify *tls.CertificateVerificationError
	var rec tls.RecordHeaderError
	if errors.As(err, &unknownCA) || errors.As(err, &host) || errors.As(err, &invalid) ||
		errors.As(err, &verify) || errors.As(err, &rec) {
		return true
	}
	return strings.Contains(err.Error(), "tls:") || strings.Contains(err.Error(), "x509:")
}
