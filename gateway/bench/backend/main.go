// Command backend is the benchmark's shard stand-in: a minimal HTTP/1.1 server that answers
// every request with 200: "ok <name>\n" on /, and on /bytes/<n> a body of n bytes (up to 1 MiB)
// that starts with the same line.
package main

import (
	"bytes"
	"flag"
	"log"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:9101", "listen address")
	name := flag.String("name", "b1", "name sent in x-backend")
	flag.Parse()
	line := []byte("ok " + *name + "\n")
	var mu sync.Mutex
	sized := map[int][]byte{}
	bodyOf := func(path string) []byte {
		n, err := strconv.Atoi(strings.TrimPrefix(path, "/bytes/"))
		if !strings.HasPrefix(path, "/bytes/") || err != nil || n < len(line) || n > 1<<20 {
			return line
		}
		mu.Lock()
		defer mu.Unlock()
		b := sized[n]
		if b == nil {
			b = append(append([]byte{}, line...), bytes.Repeat([]byte{'x'}, n-len(line))...)
			sized[n] = b
		}
		return b
	}
	srv := &http.Server{
		Addr:              *addr,
		ReadHeaderTimeout: 5 * time.Second,
		IdleTimeout:       2 * time.Minute,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			h := w.Header()
			h["X-Backend"] = []string{*name}
			h["Content-Type"] = []string{"text/plain"}
			b := bodyOf(r.URL.Path)
			h["Content-Length"] = []string{strconv.Itoa(len(b))} // not chunked, whatever the size
			_, _ = w.Write(b)
		}),
	}
	log.Fatal(srv.ListenAndServe())
}
