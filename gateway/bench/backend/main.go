// Command backend is the benchmark's shard stand-in: a minimal HTTP/1.1 server that answers
// every request with 200: "ok <name>\n" on /, and on /bytes/<n> a body of n bytes (up to 1 MiB)
// that starts with the same line; on /fields the names of the forwarding and tenantmesh fields the
// request carried (X-Forwarded-*, X-Request-Id, X-Tm-*), sorted, one per line, so the benchmark
// can check that every proxy sends the same. With -grpc it is a gRPC server (grpc-go's own HTTP/2
// transport, h2c) whose every method reads one message and answers, whatever the message:
// /bench.v1.Bench/Unary one message of -msg bytes, /bench.v1.Bench/Stream -stream messages of
// -msg bytes (gateway/bench/grpc.sh).
package main

import (
	"bytes"
	"flag"
	"log"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:9101", "listen address")
	name := flag.String("name", "b1", "name sent in x-backend")
	grpcMode := flag.Bool("grpc", false, "serve gRPC (h2c) instead of HTTP/1.1")
	msg := flag.Int("msg", 64, "gRPC answer message size")
	stream := flag.Int("stream", 100, "messages a /bench.v1.Bench/Stream call answers")
	flag.Parse()
	if *grpcMode {
		log.Fatal(serveGRPC(*addr, *name, *msg, *stream))
	}
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
			if r.URL.Path == "/fields" {
				var names []string
				for n := range r.Header {
					if strings.HasPrefix(n, "X-Forwarded-") || strings.HasPrefix(n, "X-Tm-") || n == "X-Request-Id" {
						names = append(names, n)
					}
				}
				slices.Sort(names)
				_, _ = w.Write([]byte(strings.Join(names, "\n") + "\n"))
				return
			}
			h["Content-Type"] = []string{"text/plain"}
			b := bodyOf(r.URL.Path)
			h["Content-Length"] = []string{strconv.Itoa(len(b))} // not chunked, whatever the size
			_, _ = w.Write(b)
		}),
	}
	log.Fatal(srv.ListenAndServe())
}
