// Package sidecar is shardkit-sidecar's shard (shardkit/cmd/shardkit-sidecar, whose package
// comment is the user's guide and the hook contract): a shardmain.App that sends each request
// the gate admits to a service in any language over HTTP (gRPC over HTTP/2), and takes part in
// moves by calling the service's hooks.
package sidecar

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/envflag"

	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/shardmain"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// Options are the sidecar's own flags (AddFlags).
type Options struct {
	Upstream       string        // --upstream: the service's base URL
	Routes         RouteList     // --route: the routes the service serves
	Hooks          string        // --hooks: warm,applied,fence,release (none: a stateless service)
	HooksPath      string        // --hooks-path: the hooks' path prefix on the upstream
	HookTimeout    time.Duration // --hook-timeout: bound on the applied, fence and release calls
	WarmTimeout    time.Duration // --warm-timeout: bound on one warm call
	HookSecretFile string        // --hooks-secret-file: file holding the secret hook calls carry
}

// HeaderHookToken carries the hooks' secret on every hook call (--hooks-secret-file): the
// service should refuse a hook call without it, so nothing but its sidecar can warm or release
// a tenant.
const HeaderHookToken = "X-Tm-Hook-Token"

// RouteList is the repeatable --route flag: "METHOD /prefix".
type RouteList []schema.Route

func (r *RouteList) String() string {
	var s []string
	for _, rt := range *r {
		s = append(s, rt.Method+" "+rt.Prefix)
	}
	return strings.Join(s, ",")
}

func (r *RouteList) Set(v string) error {
	for _, one := range strings.Split(v, ",") {
		method, prefix, ok := strings.Cut(strings.TrimSpace(one), " ")
		prefix = strings.TrimSpace(prefix)
		if !ok || method == "" || !strings.HasPrefix(prefix, "/") {
			return fmt.Errorf("route %q: write METHOD /prefix, e.g. 'POST /notes'", one)
		}
		*r = append(*r, schema.Route{Method: strings.ToUpper(method), Prefix: prefix})
	}
	return nil
}

// AddFlags adds the sidecar's flags to fs (a shardmain.Main's Extra).
func (o *Options) AddFlags(fs *flag.FlagSet) {
	envflag.String(fs, &o.Upstream, "upstream", "", "URL of the service this sidecar fronts, e.g. http://127.0.0.1:8000")
	fs.Var(&o.Routes, "route", "a route the service serves, 'METHOD /prefix' (repeat, or comma-separate) (env "+envflag.Var("routes")+")")
	if v, ok := os.LookupEnv(envflag.Var("routes")); ok {
		_ = o.Routes.Set(v) // checked again by New: no routes is an error
	}
	envflag.String(fs, &o.Hooks, "hooks", "", "hooks the service implements: warm,applied,fence,release (none: a stateless service)")
	envflag.String(fs, &o.HooksPath, "hooks-path", "/tenantmesh", "path prefix of the hooks on the upstream")
	envflag.Duration(fs, &o.HookTimeout, "hook-timeout", 5*time.Second, "bound on the applied, fence and release calls")
	envflag.Duration(fs, &o.WarmTimeout, "warm-timeout", 60*time.Second, "bound on one warm call")
	envflag.String(fs, &o.HookSecretFile, "hooks-secret-file", "", "file with a secret every hook call carries in "+HeaderHookToken+" (the service should refuse hook calls without it)")
}

// Sidecar is the shardmain.App that fronts the upstream.
type Sidecar struct {
	o        Options
	upstream *url.URL
	hooks    map[string]bool
	hc       *http.Client // hooks
	proxy    *httputil.ReverseProxy
	// grpcProxy sends gRPC calls to the service over HTTP/2 (h2c with prior knowledge to an
	// http:// upstream, h2 by ALPN to https://), each message flushed as it comes, trailers
	// relayed.
	grpcProxy *httputil.ReverseProxy
	log       *slog.Logger // the shard's, from Build; discarded before
	secret    string       // sent with every hook call; "" without --hooks-secret-file
}

// New checks o and makes the sidecar; Build is its shardmain.Builder.
func New(o Options) (*Sidecar, error) {
	u, err := url.Parse(o.Upstream)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("--upstream %q: want the service's base URL, e.g. http://127.0.0.1:8000", o.Upstream)
	}
	if len(o.Routes) == 0 {
		return nil, errors.New("--route: name at least one route the service serves, e.g. --route 'POST /notes'")
	}
	hooks := map[string]bool{}
	for _, h := range strings.Split(o.Hooks, ",") {
		switch h = strings.TrimSpace(h); h {
		case "":
		case "warm", "applied", "fence", "release":
			hooks[h] = true
		default:
			return nil, fmt.Errorf("--hooks %q: %q is not a hook; use warm, applied, fence, release", o.Hooks, h)
		}
	}
	tr := &http.Transport{
		DialContext:           (&net.Dialer{Timeout: 2 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:          512,
		MaxIdleConnsPerHost:   512,
		IdleConnTimeout:       90 * time.Second,
		ResponseHeaderTimeout: 60 * time.Second,
		TLSHandshakeTimeout:   5 * time.Second,
	}
	if !strings.HasPrefix(o.HooksPath, "/") || len(o.HooksPath) < 2 {
		return nil, fmt.Errorf("--hooks-path %q: want a path such as /tenantmesh", o.HooksPath)
	}
	s := &Sidecar{o: o, upstream: u, hooks: hooks, hc: &http.Client{Transport: tr}, log: slog.New(slog.DiscardHandler)}
	if o.HookSecretFile != "" {
		b, err := os.ReadFile(o.HookSecretFile)
		if err != nil {
			return nil, fmt.Errorf("--hooks-secret-file: %w", err)
		}
		if s.secret = strings.TrimSpace(string(b)); len(s.secret) < 16 {
			return nil, fmt.Errorf("--hooks-secret-file %s: the secret must be at least 16 characters", o.HookSecretFile)
		}
	}
	rewrite := func(r *httputil.ProxyRequest) {
		r.SetURL(u)
		r.Out.Host = r.In.Host
		for k := range r.Out.Header {
			// Names with an underscore read as the same CGI variable as their dashed form
			// (HTTP_X_TENANT_ID): only the gateway's fields may say who the tenant is.
			if strings.Contains(k, "_") {
				delete(r.Out.Header, k)
			}
		}
		r.Out.Header.Del(HeaderHookToken)
	}
	failed := func(w http.ResponseWriter, r *http.Request, err error) {
		if errors.Is(context.Cause(r.Context()), errTenantLeft) {
			tmhttp.WriteProblem(w, r, tenantLeft)
			return
		}
		s.log.Warn("upstream failed", "path", r.URL.Path, "err", err)
		tmhttp.WriteError(w, r, tmhttp.Errorf(http.StatusBadGateway, "upstream-failed", "Service unavailable",
			"the service behind the sidecar did not answer; check that it runs at --upstream"), shardkit.Tenant(r), "")
	}
	s.proxy = &httputil.ReverseProxy{
		Rewrite:      rewrite,
		Transport:    tr, // FlushInterval 0: a response is sent whole, a stream (unknown length, SSE) as it comes
		ErrorHandler: failed,
	}
	h2 := new(http.Protocols)
	h2.SetUnencryptedHTTP2(true)
	h2.SetHTTP2(true)
	s.grpcProxy = &httputil.ReverseProxy{
		Rewrite: rewrite,
		Transport: &http.Transport{
			DialContext:         (&net.Dialer{Timeout: 2 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			Protocols:           h2,
			ForceAttemptHTTP2:   true,
			DisableCompression:  true, // the call goes as the client sent it
			IdleConnTimeout:     90 * time.Second,
			TLSHandshakeTimeout: 5 * time.Second,
			// A silent connection is pinged, and closed when the ping goes unanswered.
			HTTP2: &http.HTTP2Config{SendPingTimeout: 15 * time.Second, PingTimeout: 5 * time.Second},
		},
		FlushInterval: -1, // each message of a stream as it comes
		ErrorHandler:  failed,
	}
	return s, nil
}

// Build is the shardmain.Builder: it returns s, logging with env's logger.
func (s *Sidecar) Build(_ context.Context, env shardmain.Env) (shardmain.App, error) {
	s.log = env.Logger.With("upstream", s.upstream.Redacted())
	return s, nil
}

// Routes are the service's routes, for the gateway.
func (s *Sidecar) Routes() []schema.Route {
	out := make([]schema.Route, len(s.o.Routes))
	copy(out, s.o.Routes)
	return out
}

// Handler sends every request behind the gate to the upstream, except those for the hooks'
// path: a tenant request routed here must never reach the service's hooks (a tenant could
// release or warm its state), so they are answered 404 here.
func (s *Sidecar) Handler(sk *shardkit.Shard) http.Handler {
	gated, gatedGRPC := sk.Gate(s.proxy), sk.Gate(http.HandlerFunc(s.serveGRPC))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s.underHooks(r.URL.Path) {
			tmhttp.WriteError(w, r, tmhttp.Errorf(http.StatusNotFound, "no-route", "Not found",
				"the service's hooks are not reachable through the sidecar"), shardkit.Tenant(r), "")
			return
		}
		if tmhttp.IsGRPC(r) { // gRPC calls reach a gRPC service over HTTP/2
			gatedGRPC.ServeHTTP(w, r)
			return
		}
		gated.ServeHTTP(w, r)
	})
}

// errTenantLeft ends the upstream part of a gRPC call whose tenant started to leave.
var errTenantLeft = errors.New("the tenant is leaving this instance")

// tenantLeft is the status of such a call: UNAVAILABLE, so its client calls again and the
// gateway sends the call to the tenant's new owner.
var tenantLeft = tmhttp.Problem{Status: http.StatusServiceUnavailable, Title: "Tenant moved",
	Detail: "the tenant is moving to another shard; call again (the gateway routes the call to its new owner)", RetryAfter: 1}

// serveGRPC proxies a gRPC call the gate admitted, and ends it UNAVAILABLE when its tenant
// starts to leave this instance (shardkit.Leaving): a server stream of the service would
// otherwise hold the tenant's drain until its bound.
func (s *Sidecar) serveGRPC(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithCancelCause(r.Context())
	defer cancel(nil)
	leaving := shardkit.Leaving(r.Context())
	go func() {
		select {
		case <-leaving:
			cancel(errTenantLeft)
		case <-ctx.Done():
		}
	}()
	defer func() {
		if !errors.Is(context.Cause(ctx), errTenantLeft) {
			return
		}
		// The answer began: ReverseProxy gave up copying it (its abort panic); its end is the
		// status, in the trailers.
		if v := recover(); v != nil && v != http.ErrAbortHandler {
			panic(v)
		}
		h := w.Header()
		h[http.TrailerPrefix+"Grpc-Status"] = []string{strconv.Itoa(tmhttp.GRPCUnavailable)}
		h[http.TrailerPrefix+"Grpc-Message"] = []string{tmhttp.EncodeGRPCMessage(tenantLeft.Title + ": " + tenantLeft.Detail)}
	}()
	s.grpcProxy.ServeHTTP(w, r.WithContext(ctx))
}

// underHooks reports whether path is the hooks' path or under it (in any letter case).
func (s *Sidecar) underHooks(path string) bool {
	hp := strings.TrimSuffix(s.o.HooksPath, "/")
	return len(path) >= len(hp) && strings.EqualFold(path[:len(hp)], hp) && (len(path) == len(hp) || path[len(hp)] == '/')
}

// Hooks are HTTP calls to the service, those it implements.
func (s *Sidecar) Hooks() shardkit.Hooks {
	var h shardkit.Hooks
	if s.hooks["warm"] {
		h.Warm = s.warm
	}
	if s.hooks["applied"] {
		h.Applied = func(tenant string) uint64 { return s.number("applied", tenant) }
	}
	if s.hooks["fence"] {
		h.Fence = func(tenant string) uint64 { return s.number("fence", tenant) }
	}
	if s.hooks["release"] {
		h.Release = s.release
	}
	return h
}

func (s *Sidecar) warm(ctx context.Context, tenant string, fence uint64) error {
	ctx, cancel := context.WithTimeout(ctx, s.o.WarmTimeout)
	defer cancel()
	return s.post(ctx, "warm", map[string]any{"tenant": tenant, "fence": fence})
}

func (s *Sidecar) release(ctx context.Context, tenant string) error {
	ctx, cancel := context.WithTimeout(ctx, s.o.HookTimeout)
	defer cancel()
	return s.post(ctx, "release", map[string]any{"tenant": tenant})
}

// post calls hook with body and wants a 2xx.
func (s *Sidecar) post(ctx context.Context, hook string, body any) error {
	b, _ := json.Marshal(body)
	req, err := http.NewRequestWithContext(ctx, "POST", s.hookURL(hook, ""), bytes.NewReader(b))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	s.sign(req)
	resp, err := s.hc.Do(req)
	if err != nil {
		return fmt.Errorf("hook %s: %w", hook, err)
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("hook %s: %s %s", hook, resp.Status, bytes.TrimSpace(msg))
	}
	return nil
}

// number calls GET hook?tenant= and reads {"<hook>": N}; a failure is logged and counts as 0.
func (s *Sidecar) number(hook, tenant string) uint64 {
	ctx, cancel := context.WithTimeout(context.Background(), s.o.HookTimeout)
	defer cancel()
	n, err := s.get(ctx, hook, tenant)
	if err != nil {
		s.log.Warn("hook failed; counting 0", "hook", hook, "tenant", tenant, "err", err)
	}
	return n
}

func (s *Sidecar) get(ctx context.Context, hook, tenant string) (uint64, error) {
	req, err := http.NewRequestWithContext(ctx, "GET", s.hookURL(hook, tenant), nil)
	if err != nil {
		return 0, err
	}
	s.sign(req)
	resp, err := s.hc.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return 0, fmt.Errorf("%s", resp.Status)
	}
	var out map[string]uint64
	if err := json.NewDecoder(io.LimitReader(resp.Body, 4096)).Decode(&out); err != nil {
		return 0, fmt.Errorf("want {%q: number}: %w", hook, err)
	}
	return out[hook], nil
}

// sign adds the hooks' secret to a hook call.
func (s *Sidecar) sign(req *http.Request) {
	if s.secret != "" {
		req.Header.Set(HeaderHookToken, s.secret)
	}
}

func (s *Sidecar) hookURL(hook, tenant string) string {
	u := *s.upstream
	u.Path = strings.TrimSuffix(u.Path, "/") + s.o.HooksPath + "/" + hook
	if tenant != "" {
		u.RawQuery = url.Values{"tenant": {tenant}}.Encode()
	}
	return u.String()
}
