package server

import (
	"net"
	"net/http"
	"strings"

	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// guard is the API's access check. Writes (anything but GET and HEAD) need the admin token.
// Reads of /api/ (tenant lists, instance URLs, the audit journal, plans, the event stream)
// need the read token or the admin token, as Authorization: Bearer or, for the event stream
// a browser opens (EventSource sends no header), ?access_token=; without a read token
// configured they are served to loopback clients only. The probes, /metrics, the OpenAPI
// document and the dashboard's static files stay open (the dashboard reads the API with the
// token it was opened with: #token=...).
func (s *Server) guard() func(http.Handler) http.Handler {
	writes := tmhttp.RequireBearer(s.cfg.AdminToken, "rebalance serve --admin-token or TM_ADMIN_TOKEN")
	return func(next http.Handler) http.Handler {
		guarded := writes(next)
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			switch {
			case r.Method != http.MethodGet && r.Method != http.MethodHead:
				guarded.ServeHTTP(w, r)
			case !strings.HasPrefix(r.URL.Path, "/api/") || s.mayRead(r):
				next.ServeHTTP(w, r)
			default:
				w.Header().Set("WWW-Authenticate", `Bearer realm="tenantmesh rebalancer"`)
				tmhttp.WriteProblem(w, r, tmhttp.Problem{Type: tmhttp.TypeBase + "unauthorized", Title: "Unauthorized", Status: http.StatusUnauthorized,
					Detail: "the API's reads need Authorization: Bearer <the read token (rebalance serve --read-token) or the admin token>; without a read token set, only clients on this host may read"})
			}
		})
	}
}

// mayRead reports whether r may read the API.
func (s *Server) mayRead(r *http.Request) bool {
	got, ok := tmhttp.BearerToken(r)
	if !ok {
		got = r.URL.Query().Get("access_token")
	}
	if got != "" {
		return tmhttp.TokenIn(got, s.cfg.ReadToken, s.cfg.AdminToken)
	}
	return s.cfg.ReadToken == "" && loopback(r.RemoteAddr)
}

func loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		host = addr
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
