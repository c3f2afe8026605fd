// Command backend is the benchmark's shard stand-in: a minimal HTTP/1.1 server that answers
// every request with 200 and a short body.
package main

import (
	"flag"
	"log"
	"net/http"
	"time"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:9101", "listen address")
	name := flag.String("name", "b1", "name sent in x-backend")
	flag.Parse()
	body := []byte("ok " + *name + "\n")
	srv := &http.Server{
		Addr:              *addr,
		ReadHeaderTimeout: 5 * time.Second,
		IdleTimeout:       2 * time.Minute,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			h := w.Header()
			h["X-Backend"] = []string{*name}
			h["Content-Type"] = []string{"text/plain"}
			_, _ = w.Write(body)
		}),
	}
	log.Fatal(srv.ListenAndServe())
}
