// Command fastproxy is an experiment, not a product: the least a Go tenant router can do per
// request, to measure how far the gateway is from what Go can reach in the benchmark's setup.
//
// It routes by x-tenant-id through the same placement watcher as the gateway, but with a
// purpose-built HTTP/1.1 loop instead of net/http: one goroutine per client connection that owns
// its upstream connections (no pool, no hand-off), request and response heads parsed in place
// in reused buffers, headers forwarded as bytes (x-tm-* and hop-by-hop dropped, epoch and shard
// added), bodies by Content-Length only, no allocation per request. No holds, retries, breakers,
// rate limits, metrics or chunked bodies: what it leaves out is exactly what the gateway adds.
package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/url"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"
	"unsafe"

	"github.com/tenantmesh/tenantmesh/shardkit/natsconn"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

const kind = "aggregate"

func main() {
	addr := flag.String("addr", "127.0.0.1:9085", "listen address")
	var nats natsconn.Options
	nats.AddFlags(flag.CommandLine)
	flag.Parse()
	if err := run(*addr, nats); err != nil {
		log.Fatal(err)
	}
}

func run(addr string, nats natsconn.Options) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	nc, err := natsconn.Connect(nats, "fastproxy", nil)
	if err != nil {
		return err
	}
	defer nc.Close()
	octx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	st, err := schema.Open(octx, nc, schema.Options{Attach: true})
	if err != nil {
		return err
	}
	insts, err := st.Instances(octx, kind)
	if err != nil {
		return err
	}
	shards := map[string]string{}
	for _, in := range insts {
		u, err := url.Parse(in.URL)
		if err != nil {
			return err
		}
		shards[in.Shard] = u.Host
	}
	w, err := placement.New(placement.Config{Store: st, Kinds: []string{kind}})
	if err != nil {
		return err
	}
	go func() { _ = w.Run(ctx) }()
	if err := w.WaitReady(octx); err != nil {
		return err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	go func() { <-ctx.Done(); ln.Close() }()
	for {
		c, err := ln.Accept()
		if err != nil {
			return nil
		}
		go (&conn{c: c, w: w, shards: shards, up: map[string]*upstream{}}).serve()
	}
}

type upstream struct {
	c  net.Conn
	br *bufio.Reader
	bw *bufio.Writer
}

type conn struct {
	c      net.Conn
	w      *placement.Watcher
	shards map[string]string
	up     map[string]*upstream
	num    [20]byte
}

var (
	errBad      = errors.New("bad request")
	hdrTenant   = []byte("x-tenant-id")
	hdrCL       = []byte("content-length")
	hdrConn     = []byte("connection")
	hdrTE       = []byte("transfer-encoding")
	hdrKeep     = []byte("keep-alive")
	hdrUpgrade  = []byte("upgrade")
	prefixTM    = []byte("x-tm-")
	crlf        = []byte("\r\n")
	notFound    = []byte("HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
	badGateway  = []byte("HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
	badRequest  = []byte("HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
	servedByHdr = []byte("X-Served-By: ")
)

func (c *conn) serve() {
	defer c.c.Close()
	defer func() {
		for _, u := range c.up {
			u.c.Close()
		}
	}()
	br := bufio.NewReaderSize(c.c, 16<<10)
	bw := bufio.NewWriterSize(c.c, 16<<10)
	head := make([]byte, 0, 4096)
	for {
		head = head[:0]
		tenant, cl, err := c.readHead(br, &head)
		if err != nil {
			if err == errBad {
				_, _ = bw.Write(badRequest)
				_ = bw.Flush()
			}
			return
		}
		e, ok := c.w.Lookup(kind, unsafe.String(unsafe.SliceData(tenant), len(tenant)))
		if !ok {
			_, _ = br.Discard(int(cl))
			_, _ = bw.Write(notFound)
		} else if err := c.exchange(e, head, br, cl, bw); err != nil {
			_, _ = bw.Write(badGateway)
		}
		if br.Buffered() == 0 {
			if err := bw.Flush(); err != nil {
				return
			}
		}
	}
}

// readHead reads a request head into head, dropping x-tm-* and hop-by-hop headers, and returns
// the tenant (a slice of head) and the body length.
func (c *conn) readHead(br *bufio.Reader, head *[]byte) (tenant []byte, cl int64, err error) {
	line, err := br.ReadSlice('\n')
	if err != nil {
		return nil, 0, err
	}
	*head = append(*head, line...)
	tStart, tEnd := -1, -1
	for {
		line, err = br.ReadSlice('\n')
		if err != nil {
			return nil, 0, err
		}
		if len(line) <= 2 {
			break
		}
		colon := bytes.IndexByte(line, ':')
		if colon <= 0 {
			return nil, 0, errBad
		}
		name, val := line[:colon], bytes.TrimSpace(line[colon+1:])
		switch {
		case bytes.EqualFold(name, hdrTenant):
			tStart = len(*head) + colon + 1 + bytes.Index(line[colon+1:], val)
			tEnd = tStart + len(val)
		case bytes.EqualFold(name, hdrCL):
			var ok bool
			if cl, ok = parseLen(val); !ok {
				return nil, 0, errBad
			}
		case bytes.EqualFold(name, hdrTE), bytes.EqualFold(name, hdrUpgrade):
			return nil, 0, errBad // not in this experiment
		case bytes.EqualFold(name, hdrConn), bytes.EqualFold(name, hdrKeep),
			len(name) >= len(prefixTM) && bytes.EqualFold(name[:len(prefixTM)], prefixTM):
			continue
		}
		*head = append(*head, line...)
	}
	if tStart < 0 || tEnd-tStart < 1 || tEnd-tStart > schema.MaxTenantLen {
		return nil, 0, errBad
	}
	return (*head)[tStart:tEnd], cl, nil
}

func (c *conn) upstreamFor(shard string) (*upstream, error) {
	if u := c.up[shard]; u != nil {
		return u, nil
	}
	host, ok := c.shards[shard]
	if !ok {
		return nil, fmt.Errorf("no instance for %s", shard)
	}
	nc, err := net.DialTimeout("tcp", host, time.Second)
	if err != nil {
		return nil, err
	}
	u := &upstream{c: nc, br: bufio.NewReaderSize(nc, 16<<10), bw: bufio.NewWriterSize(nc, 16<<10)}
	c.up[shard] = u
	return u, nil
}

func (c *conn) exchange(e placement.Entry, head []byte, br *bufio.Reader, cl int64, bw *bufio.Writer) error {
	u, err := c.upstreamFor(e.Shard)
	if err != nil {
		_, _ = br.Discard(int(cl))
		return err
	}
	fail := func(err error) error {
		u.c.Close()
		delete(c.up, e.Shard)
		return err
	}
	_, _ = u.bw.Write(head)
	_, _ = u.bw.WriteString("X-Tm-Epoch: ")
	_, _ = u.bw.Write(strconv.AppendUint(c.num[:0], e.Epoch, 10))
	_, _ = u.bw.WriteString("\r\nX-Tm-Shard: ")
	_, _ = u.bw.WriteString(e.Shard)
	_, _ = u.bw.Write(crlf)
	if cl > 0 {
		_, _ = u.bw.WriteString("Content-Length: ")
		_, _ = u.bw.Write(strconv.AppendInt(c.num[:0], cl, 10))
		_, _ = u.bw.Write(crlf)
	}
	_, _ = u.bw.Write(crlf)
	if cl > 0 {
		if err := copyN(u.bw, br, cl); err != nil {
			return fail(err)
		}
	}
	if err := u.bw.Flush(); err != nil {
		return fail(err)
	}
	// Response head: forwarded as is, plus x-served-by.
	var rcl int64 = -1
	first := true
	for {
		line, err := u.br.ReadSlice('\n')
		if err != nil {
			return fail(err)
		}
		if len(line) <= 2 {
			break
		}
		if !first {
			if colon := bytes.IndexByte(line, ':'); colon > 0 {
				name := line[:colon]
				if bytes.EqualFold(name, hdrCL) {
					var ok bool
					if rcl, ok = parseLen(bytes.TrimSpace(line[colon+1:])); !ok {
						return fail(errors.New("bad Content-Length"))
					}
				} else if bytes.EqualFold(name, hdrTE) {
					return fail(errors.New("chunked responses are not in this experiment"))
				}
			}
		}
		first = false
		_, _ = bw.Write(line)
	}
	if rcl < 0 {
		return fail(errors.New("response without Content-Length"))
	}
	_, _ = bw.Write(servedByHdr)
	_, _ = bw.WriteString(e.Shard)
	_, _ = bw.Write(crlf)
	_, _ = bw.Write(crlf)
	if err := copyN(bw, u.br, rcl); err != nil {
		return fail(err)
	}
	return nil
}

// parseLen parses a Content-Length value without allocating.
func parseLen(b []byte) (int64, bool) {
	if len(b) == 0 || len(b) > 18 {
		return 0, false
	}
	var n int64
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int64(c-'0')
	}
	return n, true
}

// copyN copies n bytes from src's buffer to dst without allocating.
func copyN(dst *bufio.Writer, src *bufio.Reader, n int64) error {
	for n > 0 {
		if src.Buffered() == 0 {
			if _, err := src.Peek(1); err != nil {
				return err
			}
		}
		b, _ := src.Peek(int(min(n, int64(src.Buffered()))))
		if _, err := dst.Write(b); err != nil {
			return err
		}
		_, _ = src.Discard(len(b))
		n -= int64(len(b))
	}
	return nil
}
