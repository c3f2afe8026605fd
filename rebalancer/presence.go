package rebalancer

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"maps"
	"net"
	"net/url"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/shardkit/kvwatch"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// PresenceConfig tunes a Presence. Zero fields take the defaults.
type PresenceConfig struct {
	// SuspectAfter: an instance whose load reports (about one a second) have stopped this long
	// is probed. Default 1.5s.
	SuspectAfter time.Duration
	// DeadAfter: an instance silent this long that does not answer its probes is dead (frozen,
	// or cut off from NATS with its connection still open). Default 4s.
	DeadAfter time.Duration
	// ProbeTimeout bounds one probe; ProbeEvery is how often a silent instance is probed again.
	// Defaults 250ms and 250ms.
	ProbeTimeout, ProbeEvery time.Duration
	// MaxProbes bounds the probes in flight at once. Default 64.
	MaxProbes int
	Logger    *slog.Logger
}

func (c PresenceConfig) withDefaults() PresenceConfig {
	if c.SuspectAfter <= 0 {
		c.SuspectAfter = 1500 * time.Millisecond
	}
	if c.DeadAfter <= 0 {
		c.DeadAfter = 4 * time.Second
	}
	c.DeadAfter = max(c.DeadAfter, c.SuspectAfter)
	if c.ProbeTimeout <= 0 {
		c.ProbeTimeout = 250 * time.Millisecond
	}
	if c.ProbeEvery <= 0 {
		c.ProbeEvery = 250 * time.Millisecond
	}
	if c.MaxProbes <= 0 {
		c.MaxProbes = 64
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// Presence tells which instances are alive within seconds, where the directory's heartbeat
// ages take minutes: it follows the memberships (tm_members: who is registered) and hears every
// load report (about one per instance per second). An instance whose reports stop is probed on
// its ping subject (schema.PingSubject): an answer means it lives; "no responders" means its
// NATS connection is gone, so the process died or its server dropped it (gone, in one round
// trip); a probe that times out means it is frozen or cut off with its connection still open,
// and after DeadAfter of silence it is dead. Time is read from this process's monotonic clock
// only: no instance's clock is trusted.
type Presence struct {
	st  *schema.Store
	nc  *nats.Conn
	cfg PresenceConfig

	mu      sync.Mutex
	members map[string]*member // instance key -> member
	started time.Time
	synced  bool
	changed chan struct{} // closed and replaced when an instance's liveness may have changed
	probes  chan struct{} // a slot per probe in flight
}

// member is one registered instance as presence sees it.
type member struct {
	inst  schema.Instance
	heard time.Time // when its last load report (or probe answer) arrived; zero: never
	// gone is when the newest probe that found no responders was sent (zero: none since heard).
	gone      time.Time
	probing   bool
	lastProbe time.Time
}

// NewPresence makes a presence tracker; it follows nothing until Run, and hears reports through
// Heard.
func NewPresence(st *schema.Store, cfg PresenceConfig) *Presence {
	cfg = cfg.withDefaults()
	return &Presence{st: st, nc: st.JS().Conn(), cfg: cfg, members: map[string]*member{}, changed: make(chan struct{}),
		probes: make(chan struct{}, cfg.MaxProbes)}
}

// Config is the presence's configuration, with its defaults.
func (p *Presence) Config() PresenceConfig { return p.cfg }

// Run follows the memberships and probes silent instances until ctx ends.
func (p *Presence) Run(ctx context.Context) error {
	p.mu.Lock()
	p.started = time.Now()
	p.mu.Unlock()
	f, err := kvwatch.New(kvwatch.Config{JS: p.st.JS().JetStream(), Bucket: schema.BucketMembers, Logger: p.cfg.Logger.With("watch", schema.BucketMembers)}, p)
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	wg.Go(func() { _ = f.Run(ctx) })
	defer wg.Wait()
	t := time.NewTicker(p.cfg.ProbeEvery / 2)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			p.probeSilent(ctx, &wg)
		case <-ctx.Done():
			return nil
		}
	}
}

// Apply implements kvwatch.Handler: a membership registered, changed or removed.
func (p *Presence) Apply(e kvwatch.Entry) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var inst schema.Instance
	if e.Op != kvwatch.Put || json.Unmarshal(e.Value, &inst) != nil || inst.Key() != e.Key {
		if _, ok := p.members[e.Key]; ok {
			delete(p.members, e.Key)
			p.wake()
		}
		return
	}
	m := p.members[e.Key]
	if m == nil {
		m = &member{}
		p.members[e.Key] = m
		p.wake()
	}
	if !m.inst.Started.Equal(inst.Started) && !m.inst.Started.IsZero() {
		m.gone = time.Time{} // a new process under the same name registered
	}
	m.inst = inst
}

// Synced implements kvwatch.Handler.
func (p *Presence) Synced() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.synced = true
	p.wake()
}

// Heard records a load report: its instance lives.
func (p *Presence) Heard(r schema.LoadReport) {
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	m := p.members[r.Key()]
	if m == nil {
		return // not registered (yet): its membership brings it
	}
	wasDead := p.deadLocked(m, now)
	m.heard, m.gone = now, time.Time{}
	if wasDead {
		p.wake()
	}
}

func (p *Presence) wake() {
	close(p.changed)
	p.changed = make(chan struct{})
}

// Changed is closed when an instance's liveness may have changed (a membership, a report from
// a dead instance, a probe's finding).
func (p *Presence) Changed() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.changed
}

// silentSince is when m's silence began: its last report, or, for one never heard, when this
// presence started (it had no chance to hear it before).
func (p *Presence) silentSince(m *member) time.Time {
	if m.heard.IsZero() {
		return p.started
	}
	return m.heard
}

// deadLocked reports whether m is dead at now: a probe found its connection gone after its
// last report, or it has been silent DeadAfter. Caller holds mu.
func (p *Presence) deadLocked(m *member, now time.Time) bool {
	return !m.gone.IsZero() || now.Sub(p.silentSince(m)) >= p.cfg.DeadAfter
}

// probeSilent sends a probe to every instance silent for SuspectAfter that has none in flight
// and was not probed within ProbeEvery.
func (p *Presence) probeSilent(ctx context.Context, wg *sync.WaitGroup) {
	now := time.Now()
	p.mu.Lock()
	var due []*member
	for _, m := range p.members {
		if m.probing || now.Sub(p.silentSince(m)) < p.cfg.SuspectAfter || now.Sub(m.lastProbe) < p.cfg.ProbeEvery {
			continue
		}
		m.probing, m.lastProbe = true, now
		due = append(due, m)
	}
	p.mu.Unlock()
	for _, m := range due {
		select {
		case p.probes <- struct{}{}:
		case <-ctx.Done():
			return
		}
		wg.Go(func() {
			defer func() { <-p.probes }()
			p.probe(ctx, m)
		})
	}
}

// probe asks m's ping subject once and records what it found.
func (p *Presence) probe(ctx context.Context, m *member) {
	p.mu.Lock()
	id, addr := m.inst.InstanceID, m.inst.URL
	p.mu.Unlock()
	sent := time.Now()
	pctx, cancel := context.WithTimeout(ctx, p.cfg.ProbeTimeout)
	_, err := p.nc.RequestWithContext(pctx, schema.PingSubject(id), nil)
	cancel()
	noProcess := errors.Is(err, nats.ErrNoResponders) && p.refused(ctx, addr)
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	m.probing = false
	if p.members[id.Key()] != m {
		return // unregistered meanwhile
	}
	switch {
	case err == nil:
		wasDead := p.deadLocked(m, now)
		m.heard, m.gone = now, time.Time{}
		if wasDead {
			p.wake()
		}
	case errors.Is(err, nats.ErrNoResponders) && !noProcess:
		// Its connection is closed, but something still listens at its address (or the address
		// does not answer at all): a live process that lost NATS serves under its lease until
		// the lease runs out. Not gone: silent, and dead after DeadAfter.
		if !p.deadLocked(m, sent) && p.deadLocked(m, now) {
			p.wake()
		}
	case errors.Is(err, nats.ErrNoResponders):
		if m.heard.Before(sent) {
			if m.gone.IsZero() {
				p.cfg.Logger.Info("instance gone: its NATS connection is closed", "instance", id.Key(),
					"silent", now.Sub(p.silentSince(m)).Round(time.Millisecond))
				p.wake()
			}
			m.gone = sent
		}
	default:
		if !p.deadLocked(m, sent) && p.deadLocked(m, now) {
			p.wake()
		}
	}
}

// refused reports whether a TCP connection to m's address is refused: no process listens
// there, so the instance serves nothing, whatever its lease says. A closed NATS connection alone
// does not prove that (a NATS server that restarts closes its clients' connections; a process
// that lost NATS keeps serving under its lease), nor does a dial that times out (a partition
// looks the same). The dial is bounded by ProbeTimeout.
func (p *Presence) refused(ctx context.Context, addr string) bool {
	u, err := url.Parse(addr)
	if err != nil || u.Host == "" {
		return false
	}
	host := u.Host
	if u.Port() == "" {
		port := "80"
		if u.Scheme == "https" {
			port = "443"
		}
		host = net.JoinHostPort(u.Hostname(), port)
	}
	dctx, cancel := context.WithTimeout(ctx, p.cfg.ProbeTimeout)
	defer cancel()
	c, err := (&net.Dialer{}).DialContext(dctx, "tcp", host)
	if err == nil {
		c.Close()
		return false
	}
	return errors.Is(err, syscall.ECONNREFUSED)
}

// Dead reports whether the instance key is registered and dead now (see Presence).
func (p *Presence) Dead(key string) bool {
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	m := p.members[key]
	return m != nil && p.deadLocked(m, now)
}

// ShardPresence is what presence knows of one shard's instances.
type ShardPresence struct {
	// Registered instances, and of them those live, gone (connection closed) and silent (dead
	// without a closed connection: frozen or cut off).
	Registered int `json:"registered"`
	Live       int `json:"live"`
	Gone       int `json:"gone"`
	Silent     int `json:"silent"`
	// Synced is false until the memberships were read once: nothing is known before.
	Synced bool `json:"synced"`
	// Lease is the longest lease the shard's instances serve under (0: none published).
	Lease time.Duration `json:"lease_ns"`
	// Since is when the shard's last live instance died (zero while one lives).
	Since time.Time `json:"since,omitzero"`
}

// Down reports whether the shard has no live instance.
func (s ShardPresence) Down() bool { return s.Synced && s.Live == 0 }

// Shard reports on kind's shard.
func (p *Presence) Shard(kind, shard string) ShardPresence {
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	out := ShardPresence{Synced: p.synced}
	for _, m := range p.members {
		if m.inst.Kind != kind || m.inst.Shard != shard {
			continue
		}
		out.Registered++
		out.Lease = max(out.Lease, time.Duration(m.inst.LeaseMS)*time.Millisecond)
		switch {
		case !m.gone.IsZero():
			out.Gone++
			out.Since = later(out.Since, m.gone)
		case p.deadLocked(m, now):
			out.Silent++
			out.Since = later(out.Since, p.silentSince(m).Add(p.cfg.DeadAfter))
		default:
			out.Live++
		}
	}
	if out.Live > 0 {
		out.Since = time.Time{}
	}
	return out
}

// GoneSince reports whether every registered instance of kind's shard was found gone by a
// probe sent after t (none registered counts): none of them can renew its lease without a new
// connection, and a new connection subscribes to its probe before anything else.
func (p *Presence) GoneSince(kind, shard string, t time.Time) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.synced {
		return false
	}
	for _, m := range p.members {
		if m.inst.Kind == kind && m.inst.Shard == shard && !m.gone.After(t) {
			return false
		}
	}
	return true
}

// Shards lists the shards of kind that have registered instances, sorted.
func (p *Presence) Shards(kind string) []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	set := map[string]bool{}
	for _, m := range p.members {
		if m.inst.Kind == kind {
			set[m.inst.Shard] = true
		}
	}
	return slices.Sorted(maps.Keys(set))
}

// Ready reports whether the memberships were read once.
func (p *Presence) Ready() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.synced
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
