// Package dashboard is the rebalancer's live web dashboard: plain HTML, CSS and JavaScript
// embedded in the binary, reading the rebalancer API (/api/instances, /api/plans, /api/audit,
// /api/leader) and its server-sent events (/api/events) for live updates. It shows the multi-host design's
// host view (status, last heartbeat, last metrics, labels), tenants per shard, plans with each
// move's phase and pause, and the audit journal.
package dashboard

import (
	"embed"
	"io/fs"
	"net/http"
)

//go:embed static
var static embed.FS

// Handler serves the dashboard's files; mount it at "/".
func Handler() http.Handler {
	sub, err := fs.Sub(static, "static")
	if err != nil {
		panic(err) // the embedded tree is fixed at build time
	}
	files := http.FileServerFS(sub)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", "no-cache")
		w.Header().Set("Content-Security-Policy", "default-src 'self'; style-src 'self' 'unsafe-inline'")
		files.ServeHTTP(w, r)
	})
}
