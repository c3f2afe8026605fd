package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"hash/fnv"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// The prerender manager's HTTP registration API ("Manager APIs"), for servers that do not embed
// shardkit. A registered server is an instance of an affinity kind (?kind=, default "render")
// in its own shard; a realm is a tenant.
const (
	HeaderServerURL = "X-Prerender-Server-Url"
	HeaderServerID  = "X-Prerender-Server-Id"
	// DefaultAffinityKind is the kind a registration names when it has no ?kind=.
	DefaultAffinityKind = "render"
)

func (g *Gateway) registerServerRoutes(mux *http.ServeMux) {
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, _ *http.Request) {
		tmhttp.WriteJSON(w, http.StatusOK, map[string]bool{"ready": true})
	})
	// A registered server receives tenants' traffic: registering needs the registration token
	// or the admin token; a gateway with neither refuses it.
	reg := tmhttp.RequireBearer("", "--registration-token (TM_REGISTRATION_TOKEN) or --admin-token")
	if g.cfg.RegistrationToken != "" || g.cfg.AdminToken != "" {
		reg = eitherBearer(g.cfg.RegistrationToken, g.cfg.AdminToken)
	}
	mux.Handle("POST /prerender-servers", reg(http.HandlerFunc(g.registrar().handleRegister)))
	mux.Handle("DELETE /prerender-servers", reg(http.HandlerFunc(g.registrar().handleUnregister)))
	mux.Handle("DELETE /prerender-servers/realms/{realm}", reg(http.HandlerFunc(g.registrar().handleReleaseRealm)))
}

// eitherBearer lets through requests whose bearer token is one of tokens (empty ones never
// match) and answers 401 problem+json to the others.
func eitherBearer(tokens ...string) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if got, ok := tmhttp.BearerToken(r); ok && tmhttp.TokenIn(got, tokens...) {
				next.ServeHTTP(w, r)
				return
			}
			w.Header().Set("WWW-Authenticate", `Bearer realm="tenantmesh registration"`)
			tmhttp.WriteProblem(w, r, tmhttp.Problem{Type: tmhttp.TypeBase + "unauthorized", Title: "Unauthorized", Status: http.StatusUnauthorized,
				Detail: "registering a server needs Authorization: Bearer <the gateway's --registration-token or --admin-token>"})
		})
	}
}

// registration is the JSON:API body of POST /prerender-servers.
type registration struct {
	Data struct {
		Type       string `json:"type"`
		Attributes struct {
			URL      string         `json:"url"`
			Capacity *int           `json:"capacity"`
			Meta     map[string]any `json:"meta"`
		} `json:"attributes"`
	} `json:"data"`
}

func badRegistration(w http.ResponseWriter, r *http.Request, detail string) {
	tmhttp.WriteProblem(w, r, tmhttp.Problem{Type: tmhttp.TypeBase + "bad-registration", Title: "Invalid registration",
		Status: http.StatusBadRequest, Detail: detail})
}

// affinityKind returns the kind a registration call names, if it is an affinity kind.
func (c registrar) affinityKind(w http.ResponseWriter, r *http.Request) (*kindEntry, bool) {
	g := c.g
	kind := r.URL.Query().Get("kind")
	if kind == "" {
		kind = DefaultAffinityKind
	}
	ke := g.reg.snap.Load().kinds[kind]
	if ke == nil || ke.config() == nil || ke.config().Policy != schema.PolicyAffinity {
		badRegistration(w, r, "kind "+kind+" is not registered with the affinity policy")
		return nil, false
	}
	return ke, true
}

// serverURL is the server's URL: the explicit one, else the X-Prerender-Server-Url header, else
// http://<peer address>:<DefaultPort>.
func serverURL(r *http.Request, explicit string, port int) (string, error) {
	u := explicit
	if u == "" {
		u = r.Header.Get(HeaderServerURL)
	}
	if u == "" {
		host, _, err := net.SplitHostPort(r.RemoteAddr)
		if err != nil {
			return "", err
		}
		u = "http://" + net.JoinHostPort(host, strconv.Itoa(port))
	}
	pu, err := url.Parse(u)
	if err != nil || (pu.Scheme != "http" && pu.Scheme != "https") || pu.Host == "" {
		return "", errors.New("url " + strconv.Quote(u) + " is not an absolute http(s) URL")
	}
	return strings.TrimSuffix(pu.String(), "/"), nil
}

// serverID is the stable instance id of a server URL: the same URL registers the same id.
func serverID(kind, u string) schema.InstanceID {
	h := fnv.New64a()
	_, _ = io.WriteString(h, u)
	name := "srv-" + strconv.FormatUint(h.Sum64(), 36)
	return schema.InstanceID{Kind: kind, Shard: name, Instance: name}
}

func (c registrar) handleRegister(w http.ResponseWriter, r *http.Request) {
	g := c.g
	ke, ok := g.registrar().affinityKind(w, r)
	if !ok {
		return
	}
	cfg := ke.config()
	var reg registration
	if r.ContentLength != 0 {
		if err := json.NewDecoder(io.LimitReader(r.Body, 64<<10)).Decode(&reg); err != nil && !errors.Is(err, io.EOF) {
			badRegistration(w, r, "the body is not a JSON:API prerender-server document: "+err.Error())
			return
		}
	}
	if t := reg.Data.Type; t != "" && t != "prerender-server" {
		badRegistration(w, r, "data.type must be prerender-server")
		return
	}
	capacity := cfg.Capacity
	if c := reg.Data.Attributes.Capacity; c != nil {
		if *c < 1 {
			badRegistration(w, r, "capacity must be at least 1")
			return
		}
		capacity = *c
	}
	u, err := serverURL(r, reg.Data.Attributes.URL, cfg.Affinity.DefaultPort)
	if err != nil {
		badRegistration(w, r, err.Error())
		return
	}
	if err := g.affCtl().probe(u, 5*time.Second); err != nil {
		badRegistration(w, r, "GET "+u+"/ failed, so the server cannot be registered: "+err.Error())
		return
	}
	id := serverID(ke.name, u)
	inst := schema.Instance{InstanceID: id, URL: u, Capacity: capacity, Labels: map[string]string{labelRegisteredBy: registeredByGW}}
	if name, ok := reg.Data.Attributes.Meta["name"].(string); ok && name != "" {
		inst.Labels["name"] = name
	}
	ctx, cancel := context.WithTimeout(r.Context(), assignTimeout)
	defer cancel()
	if _, err := g.store.Directory().Register(ctx, inst); err != nil {
		tmhttp.WriteError(w, r, err, "", ke.name)
		return
	}
	for _, rt := range g.registrar().kindRoutes(ke.name) {
		if _, err := g.store.Routes().AddInstance(ctx, rt, id); err != nil {
			tmhttp.WriteError(w, r, err, "", ke.name)
			return
		}
	}
	g.log.Info("server registered", "kind", ke.name, "instance", id.Key(), "url", u, "capacity", capacity)
	w.Header().Set(HeaderServerID, id.Key())
	w.WriteHeader(http.StatusNoContent)
}

// kindRoutes are the routes a registered server serves: the kind's routes in the registry, or
// "* /<kind>" if it has none yet.
func (c registrar) kindRoutes(kind string) []schema.Route {
	g := c.g
	var out []schema.Route
	for _, rt := range g.reg.snap.Load().routes {
		if rt.kind == kind {
			out = append(out, schema.Route{Method: rt.method, Prefix: rt.prefix, Kind: kind})
		}
	}
	if len(out) == 0 {
		out = append(out, schema.Route{Method: "*", Prefix: "/" + kind, Kind: kind})
	}
	return out
}

// callerID is the identity of the server calling: X-Prerender-Server-Url, else its peer
// address with the kind's default port.
func (c registrar) callerID(w http.ResponseWriter, r *http.Request) (*kindEntry, schema.InstanceID, bool) {
	g := c.g
	ke, ok := g.registrar().affinityKind(w, r)
	if !ok {
		return nil, schema.InstanceID{}, false
	}
	u, err := serverURL(r, "", ke.config().Affinity.DefaultPort)
	if err != nil {
		badRegistration(w, r, err.Error())
		return nil, schema.InstanceID{}, false
	}
	return ke, serverID(ke.name, u), true
}

func (c registrar) handleUnregister(w http.ResponseWriter, r *http.Request) {
	g := c.g
	ke, id, ok := g.registrar().callerID(w, r)
	if !ok {
		return
	}
	g.affCtl().unregisterServer(ke, id)
	w.WriteHeader(http.StatusNoContent)
}

func (c registrar) handleReleaseRealm(w http.ResponseWriter, r *http.Request) {
	g := c.g
	ke, id, ok := g.registrar().callerID(w, r)
	if !ok {
		return
	}
	// 204 for any realm, as the prerender manager answers ("even if mapping missing"): a
	// realm outside the tenant charset (a URL, say) can never have been placed, so there is
	// nothing to release.
	if realm := r.PathValue("realm"); schema.ValidTenant(realm) {
		g.affCtl().removeOwner(ke, realm, id.Key())
	} else {
		g.log.Debug("realm released that no tenant can be", "kind", ke.name, "server", id.Key(), "realm", realm)
	}
	w.WriteHeader(http.StatusNoContent)
}

// registrar serves the affinity servers' registration API.
type registrar struct{ g *Gateway }

func (g *Gateway) registrar() registrar { return registrar{g} }
