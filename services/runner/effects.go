package runner

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/mail"
	"net/smtp"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"

	"github.com/tenantmesh/tenantmesh/internal/backoff"
	"github.com/tenantmesh/tenantmesh/internal/tracing"
)

// Effect is one kind of side effect the runner executes for jobs and sagas: a log line, an
// HTTP webhook, a transactional email. The contract is stable; new providers (SMS, push)
// implement it and are registered by name in Config.Effects.
//
// Do is called at least once per Request.Key and, unless an instance dies mid-delivery, exactly
// once (see the outbox). A provider that talks to a remote system passes Key along (the
// webhook sends it as Idempotency-Key) so the receiver can drop the rare repeat. Do returns an
// error wrapping ErrPermanent when retrying cannot help (a 4xx answer, a bad address).
type Effect interface {
	Name() string
	Do(ctx context.Context, req Request) (Result, error)
}

// Request is one effect to execute, as recorded in the outbox.
type Request struct {
	// Key is the dedupe key: <tenant>.<source>.<id>.<n>, unique per effect for ever.
	Key    string `json:"key"`
	Tenant string `json:"tenant"`
	// Effect names the provider ("log", "webhook", "email").
	Effect string `json:"effect"`
	// To is the webhook URL or the email recipient; unused by log.
	To string `json:"to,omitempty"`
	// Subject is the email subject.
	Subject string `json:"subject,omitempty"`
	// Body is the webhook's JSON body or the email's text.
	Body json.RawMessage `json:"body,omitempty"`
	// Trace is the W3C traceparent of the job run that asked for the effect, when it was
	// traced: the delivery continues its trace.
	Trace string `json:"trace,omitempty"`
}

// Result is what a provider reports about a delivery.
type Result struct {
	// Attempts is how many tries the provider needed.
	Attempts int    `json:"attempts"`
	Detail   string `json:"detail,omitempty"`
}

// ErrPermanent is wrapped by effect errors that a retry cannot fix.
var ErrPermanent = errors.New("permanent effect failure")

// EffectFunc adapts a function to Effect.
type EffectFunc struct {
	N string
	F func(ctx context.Context, req Request) (Result, error)
}

// Name implements Effect.
func (e EffectFunc) Name() string { return e.N }

// Do implements Effect.
func (e EffectFunc) Do(ctx context.Context, req Request) (Result, error) { return e.F(ctx, req) }

// LogEffect writes the effect to a logger; useful in development and as a fallback.
type LogEffect struct {
	// Logger; if nil, logs are discarded.
	Logger *slog.Logger
}

// Name implements Effect.
func (LogEffect) Name() string { return "log" }

// Do implements Effect.
func (l LogEffect) Do(_ context.Context, req Request) (Result, error) {
	if l.Logger != nil {
		l.Logger.Info("effect", "key", req.Key, "tenant", req.Tenant, "to", req.To, "subject", req.Subject, "body", string(req.Body))
	}
	return Result{Attempts: 1}, nil
}

// Webhook POSTs the request body as JSON to Request.To, with Idempotency-Key set to the dedupe
// key, retrying transient failures (network errors, 408, 429, 5xx) with exponential backoff
// and jitter. Any other 4xx is permanent.
type Webhook struct {
	// Client sends the requests. Default: an http.Client with Timeout that dials only what
	// Allow admits and follows no redirect (webhookguard.go). A Client set here is used as
	// it is: its guard is the caller's.
	Client *http.Client
	// Allow lists the destinations a webhook may reach, checked on the address dialled:
	// "public" (any public address), IPs, CIDR prefixes (10.1.2.0/24) and host names (any
	// address they resolve to). Default ["public"]: no loopback, private, link-local (cloud
	// metadata), CGNAT or reserved address. A redirect is never followed (a 3xx fails the
	// delivery for good).
	Allow []string
	// Timeout bounds one attempt. Default 5s.
	Timeout time.Duration
	// Attempts bounds the tries per Do. Default 5.
	Attempts int
	// Backoff is the first pause between tries, doubled each time up to MaxBackoff.
	// Defaults 100ms and 5s.
	Backoff, MaxBackoff time.Duration

	once     sync.Once
	client   *http.Client
	allowErr error // Allow did not parse: every delivery fails with it
}

// httpClient is Client, or a client that keeps enough idle connections per receiver for the
// instance's concurrent runs (http.DefaultTransport keeps 2).
func (w *Webhook) httpClient(timeout time.Duration) *http.Client {
	if w.Client != nil {
		return w.Client
	}
	w.once.Do(func() {
		d, err := parseDestinations(w.Allow)
		if err != nil {
			w.allowErr = err
			d = &destinations{} // admits nothing
		}
		w.client = guardedClient(d, timeout)
	})
	return w.client
}

// Name implements Effect.
func (*Webhook) Name() string { return "webhook" }

// Do implements Effect.
func (w *Webhook) Do(ctx context.Context, req Request) (Result, error) {
	timeout, attempts := w.Timeout, w.Attempts
	if timeout <= 0 {
		timeout = 5 * time.Second
	}
	if attempts <= 0 {
		attempts = 5
	}
	pause, maxPause := w.Backoff, w.MaxBackoff
	if pause <= 0 {
		pause = 100 * time.Millisecond
	}
	if maxPause <= 0 {
		maxPause = 5 * time.Second
	}
	client := w.httpClient(timeout)
	if w.allowErr != nil {
		return Result{}, fmt.Errorf("%w: %w", ErrPermanent, w.allowErr)
	}
	if !strings.HasPrefix(req.To, "http://") && !strings.HasPrefix(req.To, "https://") {
		return Result{}, fmt.Errorf("%w: webhook url %q must be http(s)", ErrPermanent, req.To)
	}
	tries := 0
	err := backoff.Retry(ctx, backoff.Policy{Initial: pause, Max: maxPause, Jitter: backoff.Half, Tries: attempts,
		RetryIf: func(err error) bool { return !errors.Is(err, ErrPermanent) },
	}, func(ctx context.Context) error {
		tries++
		return w.post(ctx, client, timeout, req)
	})
	switch {
	case err == nil || errors.Is(err, ErrPermanent):
		return Result{Attempts: tries}, err
	case tries < attempts && ctx.Err() != nil:
		return Result{Attempts: tries}, fmt.Errorf("webhook %s: %w (last error: %w)", req.Key, ctx.Err(), err)
	}
	return Result{Attempts: tries}, fmt.Errorf("webhook %s: gave up after %d attempts: %w", req.Key, attempts, err)
}

func (w *Webhook) post(ctx context.Context, client *http.Client, timeout time.Duration, req Request) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	body := req.Body
	if len(body) == 0 {
		body = json.RawMessage("null")
	}
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, req.To, bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("%w: %w", ErrPermanent, err)
	}
	hr.Header.Set("Content-Type", "application/json")
	hr.Header.Set("Idempotency-Key", req.Key)
	hr.Header.Set("X-Tenant-Id", req.Tenant)
	if tracing.On() {
		otel.GetTextMapPropagator().Inject(ctx, propagation.HeaderCarrier(hr.Header))
	}
	resp, err := client.Do(hr)
	if errors.Is(err, ErrDestination) {
		return fmt.Errorf("%w: post %s: %w", ErrPermanent, req.To, err)
	}
	if err != nil {
		return fmt.Errorf("post %s: %w", req.To, err)
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	switch {
	case resp.StatusCode < 300:
		return nil
	case resp.StatusCode == http.StatusRequestTimeout, resp.StatusCode == http.StatusTooManyRequests, resp.StatusCode >= 500:
		return fmt.Errorf("post %s: %s", req.To, resp.Status)
	default:
		return fmt.Errorf("%w: post %s: %s", ErrPermanent, req.To, resp.Status)
	}
}

// SMTP sends transactional email (the Cloudlysis PRD section 5: reset links, verification links,
// security alerts) through an SMTP relay with net/smtp. The message carries the dedupe key as
// its Message-ID, so a relay or mailbox that drops repeated Message-IDs sees one email.
type SMTP struct {
	// Addr is the relay, host:port; required.
	Addr string
	// From is the envelope and header sender; required.
	From string
	// Auth, if set, authenticates (for example smtp.PlainAuth); net/smtp refuses it without TLS
	// except on localhost.
	Auth smtp.Auth
	// TLS configures STARTTLS, used whenever the relay offers it. Default: verify the relay's
	// certificate for its host name, TLS 1.2 or later.
	TLS *tls.Config
	// Timeout bounds one delivery, dial included. Default 10s.
	Timeout time.Duration
}

// Name implements Effect.
func (*SMTP) Name() string { return "email" }

// Do implements Effect.
func (s *SMTP) Do(ctx context.Context, req Request) (Result, error) {
	msg, err := s.Message(req)
	if err != nil {
		return Result{}, err
	}
	timeout := s.Timeout
	if timeout <= 0 {
		timeout = 10 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", s.Addr)
	if err != nil {
		return Result{}, fmt.Errorf("smtp dial %s: %w", s.Addr, err)
	}
	defer conn.Close()
	deadline, _ := ctx.Deadline()
	_ = conn.SetDeadline(deadline)
	host, _, _ := net.SplitHostPort(s.Addr)
	c, err := smtp.NewClient(conn, host)
	if err != nil {
		return Result{}, fmt.Errorf("smtp hello %s: %w", s.Addr, err)
	}
	defer c.Close()
	if ok, _ := c.Extension("STARTTLS"); ok {
		cfg := s.TLS
		if cfg == nil {
			cfg = &tls.Config{ServerName: host, MinVersion: tls.VersionTLS12}
		}
		if err := c.StartTLS(cfg); err != nil {
			return Result{}, fmt.Errorf("smtp STARTTLS with %s: %w", s.Addr, err)
		}
	}
	if s.Auth != nil {
		if err := c.Auth(s.Auth); err != nil {
			return Result{}, fmt.Errorf("%w: smtp auth: %w", ErrPermanent, err)
		}
	}
	if err := c.Mail(s.From); err != nil {
		return Result{}, fmt.Errorf("smtp MAIL FROM: %w", err)
	}
	if err := c.Rcpt(req.To); err != nil {
		return Result{}, fmt.Errorf("%w: smtp RCPT TO %s: %w", ErrPermanent, req.To, err)
	}
	wc, err := c.Data()
	if err != nil {
		return Result{}, fmt.Errorf("smtp DATA: %w", err)
	}
	if _, err := wc.Write(msg); err != nil {
		return Result{}, fmt.Errorf("smtp write: %w", err)
	}
	if err := wc.Close(); err != nil {
		return Result{}, fmt.Errorf("smtp end of data: %w", err)
	}
	_ = c.Quit()
	return Result{Attempts: 1}, nil
}

// Message builds the RFC 5322 message for req: From, To, Subject, Message-ID (from the dedupe
// key), Date and a text/plain UTF-8 body (Body as a JSON string, or raw JSON otherwise).
func (s *SMTP) Message(req Request) ([]byte, error) {
	to, err := mail.ParseAddress(req.To)
	if err != nil {
		return nil, fmt.Errorf("%w: email recipient %q: %w", ErrPermanent, req.To, err)
	}
	from, err := mail.ParseAddress(s.From)
	if err != nil {
		return nil, fmt.Errorf("%w: email sender %q: %w", ErrPermanent, s.From, err)
	}
	if strings.ContainsAny(req.Subject, "\r\n") {
		return nil, fmt.Errorf("%w: email subject has a line break", ErrPermanent)
	}
	text := string(req.Body)
	var str string
	if json.Unmarshal(req.Body, &str) == nil {
		text = str
	}
	domain := "tenantmesh.invalid"
	if at := strings.LastIndexByte(from.Address, '@'); at >= 0 {
		domain = from.Address[at+1:]
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, "From: %s\r\nTo: %s\r\nSubject: %s\r\n", from.String(), to.String(), mimeWord(req.Subject))
	fmt.Fprintf(&b, "Message-ID: <%s@%s>\r\nDate: %s\r\n", req.Key, domain, time.Now().UTC().Format(time.RFC1123Z))
	b.WriteString("MIME-Version: 1.0\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Transfer-Encoding: 8bit\r\n")
	b.WriteString("X-Tenant-Id: " + req.Tenant + "\r\n\r\n")
	for line := range strings.Lines(text) {
		// net/smtp's DATA writer does the dot-stuffing.
		b.WriteString(strings.TrimRight(line, "\r\n") + "\r\n")
	}
	return b.Bytes(), nil
}

// mimeWord encodes a header value that is not plain ASCII (RFC 2047).
func mimeWord(s string) string {
	for i := 0; i < len(s); i++ {
		if s[i] >= 0x80 {
			return "=?utf-8?q?" + qEncode(s) + "?="
		}
	}
	return s
}

func qEncode(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == ' ':
			b.WriteByte('_')
		case c >= '0' && c <= '9', c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z':
			b.WriteByte(c)
		default:
			b.WriteString("=" + strings.ToUpper(strconv.FormatUint(uint64(c)|0x100, 16)[1:]))
		}
	}
	return b.String()
}
