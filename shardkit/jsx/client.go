// Package jsx is the JetStream plumbing under tenantmesh's schema, usable on its own: streams,
// buckets and object stores created idempotently on a cluster that may still be forming; reads
// bounded and retried while NATS is briefly unavailable; compare-and-set writes whose lost
// answers are recognised; reads answered by a stream's leader; one-off ordered reads that leave
// no consumer behind; and one bucket's JSON records (Client.Records), with leases.
//
// It names no bucket or subject of its own: shardkit/schema does.
package jsx

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Options configure how a Client creates buckets and streams. The zero value suits one
// embedded server: one replica, file storage.
type Options struct {
	// Replicas for every bucket and stream the client creates: 1 embedded, 3 in a cluster.
	Replicas int
	// Storage for buckets and streams. Default: file.
	Storage jetstream.StorageType
	// Timeout bounds each NATS call that the caller's context leaves unbounded. Default: 5s.
	Timeout time.Duration
	// Logger receives warnings (for example skipped corrupt values). If nil, they are discarded.
	Logger *slog.Logger
	// Attach opens shared buckets and streams without creating or changing them: one that is
	// missing is waited for (see EnsureStream), since a process whose credentials may not
	// create it relies on another to provision it. EnsureKV with Own still creates.
	Attach bool
}

func (o Options) withDefaults() Options {
	if o.Replicas <= 0 {
		o.Replicas = 1
	}
	if o.Timeout <= 0 {
		o.Timeout = 5 * time.Second
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return o
}

// Client does JetStream calls for tenantmesh. It is safe for concurrent use.
type Client struct {
	nc   *nats.Conn
	js   jetstream.JetStream
	opts Options
}

// New is a Client on nc.
func New(nc *nats.Conn, opts Options) (*Client, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	return &Client{nc: nc, js: js, opts: opts.withDefaults()}, nil
}

// Conn is the client's NATS connection, for core NATS publishing and subscribing.
func (c *Client) Conn() *nats.Conn { return c.nc }

// JetStream is the client's JetStream context, for what this package does not wrap (consumers,
// watches).
func (c *Client) JetStream() jetstream.JetStream { return c.js }

// Options returns the options the client was made with, defaults applied.
func (c *Client) Options() Options { return c.opts }

// Logger is where the client logs.
func (c *Client) Logger() *slog.Logger { return c.opts.Logger }
