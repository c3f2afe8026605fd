package gateway

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"

	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// The lean path proxies plain HTTP/1.1 request/response exchanges without httputil.ReverseProxy:
// it forwards the inbound request's header map in place instead of cloning the request and its
// headers, and copies the response headers by reference. It does what Rewrite mode does for these
// requests: hop-by-hop headers removed (also those named in Connection), X-Forwarded-For,
// -Host and -Proto set afresh, no default User-Agent added, trailers passed on, streamed
// responses flushed as they come. Upgrades and requests with trailers go through ReverseProxy.

// hopHeaders are removed in both directions (RFC 9110 7.6.1).
var hopHeaders = []string{"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}

// leanable reports whether the lean path can carry r.
func leanable(r *http.Request) bool {
	if r.ProtoMajor != 1 || len(r.Trailer) > 0 {
		return false
	}
	_, up := r.Header["Upgrade"]
	return !up
}

func removeHopHeaders(h http.Header) {
	for _, f := range h["Connection"] {
		for sf := range strings.SplitSeq(f, ",") {
			if sf = strings.TrimSpace(sf); sf != "" {
				h.Del(sf)
			}
		}
	}
	for _, k := range hopHeaders {
		delete(h, k)
	}
}

var emptyValue = []string{""}

func (g *Gateway) proxyLean(w http.ResponseWriter, r *http.Request, ctx context.Context, st *reqState) {
	out := r.WithContext(ctx)
	u := *r.URL
	out.URL = &u
	out.RequestURI = ""
	out.Close = false
	if out.ContentLength == 0 {
		out.Body = nil
	}
	h := out.Header
	removeHopHeaders(h)
	for k := range h {
		if len(k) >= len(tmhttp.HeaderPrefixTM) && strings.EqualFold(k[:len(tmhttp.HeaderPrefixTM)], tmhttp.HeaderPrefixTM) {
			delete(h, k)
		}
	}
	delete(h, "Forwarded")
	if ip, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		h["X-Forwarded-For"] = []string{ip}
	} else {
		delete(h, "X-Forwarded-For")
	}
	h["X-Forwarded-Host"] = []string{r.Host}
	if r.TLS != nil {
		h["X-Forwarded-Proto"] = protoHTTPS
	} else {
		h["X-Forwarded-Proto"] = protoHTTP
	}
	if _, ok := h["User-Agent"]; !ok {
		h["User-Agent"] = emptyValue // Request.Write then sends none, as ReverseProxy does
	}
	if st.reqID != "" {
		h[tmhttp.HeaderRequestID] = []string{st.reqID}
	}
	h[tmhttp.HeaderKind] = st.ke.kindHdr
	if st.subject != nil {
		h[tmhttp.HeaderSubject] = st.subject
	}
	u.Scheme = "http"

	resp, err := g.forward(out, st)
	if err != nil {
		g.proxyError(w, r.WithContext(context.WithValue(ctx, stateKey{}, st)), err)
		return
	}
	defer resp.Body.Close()
	removeHopHeaders(resp.Header)
	dst := w.Header()
	for k, vv := range resp.Header {
		dst[k] = vv
	}
	if len(resp.Trailer) > 0 {
		keys := make([]string, 0, len(resp.Trailer))
		for k := range resp.Trailer {
			keys = append(keys, k)
		}
		dst["Trailer"] = []string{strings.Join(keys, ", ")}
	}
	w.WriteHeader(resp.StatusCode)
	stream := resp.ContentLength == -1 || strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")
	if err := copyBody(w, resp.Body, stream); err != nil {
		if !errors.Is(err, context.Canceled) {
			g.log.Debug("copying the response failed", "kind", st.ke.name, "err", err)
		}
		panic(http.ErrAbortHandler) // the client must not take a cut-off body for a whole one
	}
	for k, vv := range resp.Trailer {
		dst[http.TrailerPrefix+k] = vv
	}
}

var (
	protoHTTP  = []string{"http"}
	protoHTTPS = []string{"https"}
)

// copyBody copies src to w with a pooled buffer, flushing after each write when streaming.
func copyBody(w http.ResponseWriter, src io.Reader, stream bool) error {
	bp := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(bp)
	buf := *bp
	var fl http.Flusher
	if stream {
		fl, _ = w.(http.Flusher)
	}
	for {
		n, rerr := src.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return werr
			}
			if fl != nil {
				fl.Flush()
			}
		}
		if rerr == io.EOF {
			return nil
		}
		if rerr != nil {
			return rerr
		}
	}
}
