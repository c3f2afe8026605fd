// Package sweeper finds dead instances and cleans up after them (Aether routing and the multi-host design): an
// instance whose heartbeat is older than the offline threshold is marked offline in the
// directory, announced with an AGENT_OFFLINE alert to a webhook, removed from every route of
// the route registry and, for affinity kinds, from the owners of its tenants.
//
// # Overview
//
// Only the rebalancer leader sweeps. [Sweeper.Run] first does a full stale-route cleanup (Aether
// routing's cleanup on leader activation: every route loses the instances that are absent from the
// directory or offline), then sweeps every Interval. Marking offline is a compare-and-set on
// the entry as read, so a heartbeat that lands meanwhile wins and the instance stays online;
// the sweep that wins the compare-and-set is the only one that alerts, so an instance going
// offline alerts once. An instance that comes back heartbeats itself online and re-publishes
// its routes.
package sweeper

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/backoff"
	"github.com/tenantmesh/tenantmesh/internal/promreg"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Config configures a Sweeper. Zero fields take the documented defaults.
type Config struct {
	Store *schema.Store
	// Health decides statuses; its Thresholds.OfflineAfter (default 2m) is the offline rule.
	Health rebalancer.Health
	// Interval between sweeps. Default 15s.
	Interval time.Duration
	// Webhook, if set, receives an AGENT_OFFLINE alert (JSON POST) per instance gone offline.
	Webhook string
	// WebhookTimeout bounds one POST. Default 5s.
	WebhookTimeout time.Duration
	// WebhookRetries is how many times a failed POST is retried (with doubling backoff from
	// 500ms, jittered, at most 30s). Default 3; negative: no retry.
	WebhookRetries int
	// Client posts alerts. Default a plain http.Client.
	Client *http.Client
	// Actor names the sweeper in the audit journal. Default "rebalancer/sweeper".
	Actor string
	// OnEvent, if set, is called for every instance status change the sweeper sees (for the
	// dashboard's event stream).
	OnEvent func(Event)
	// Now is the clock. Default time.Now.
	Now func() time.Time
	// Logger; if nil, logs are discarded.
	Logger *slog.Logger
	// Registerer, if set, receives the sweeper's metrics.
	Registerer prometheus.Registerer
}

// Event is an instance status change.
type Event struct {
	Instance string        `json:"instance"`
	Kind     string        `json:"kind"`
	Shard    string        `json:"shard"`
	From     schema.Status `json:"from,omitempty"`
	To       schema.Status `json:"to"`
	Time     time.Time     `json:"time"`
}

// Alert is the body POSTed to the webhook. Content repeats Text so a Discord webhook shows it.
type Alert struct {
	Type          string    `json:"type"`
	Instance      string    `json:"instance"`
	Kind          string    `json:"kind"`
	Shard         string    `json:"shard"`
	URL           string    `json:"url"`
	LastHeartbeat time.Time `json:"last_heartbeat"`
	OfflineAfter  string    `json:"offline_after"`
	Time          time.Time `json:"time"`
	Text          string    `json:"text"`
	Content       string    `json:"content"`
}

// AlertAgentOffline is the alert type of an instance gone offline (the multi-host design).
const AlertAgentOffline = "AGENT_OFFLINE"

// Sweeper marks dead instances offline and removes them from routes.
type Sweeper struct {
	cfg     Config
	offline time.Duration
	last    map[string]schema.Status // instance key -> status at the last sweep
	cleaned map[string]bool          // offline instances already removed from routes and owners
	m       metrics
}

type metrics struct {
	marked, routes, owners prometheus.Counter
	alerts                 *prometheus.CounterVec
	sweeps                 prometheus.Counter
}

// New makes a sweeper.
func New(cfg Config) (*Sweeper, error) {
	if cfg.Store == nil {
		return nil, errors.New("sweeper: Store is required")
	}
	if cfg.Interval <= 0 {
		cfg.Interval = 15 * time.Second
	}
	if cfg.WebhookTimeout <= 0 {
		cfg.WebhookTimeout = 5 * time.Second
	}
	if cfg.WebhookRetries == 0 {
		cfg.WebhookRetries = 3
	}
	if cfg.Client == nil {
		cfg.Client = &http.Client{}
	}
	if cfg.Actor == "" {
		cfg.Actor = "rebalancer/sweeper"
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	off := cfg.Health.Thresholds.OfflineAfter
	if off <= 0 {
		off = 2 * time.Minute
	}
	s := &Sweeper{cfg: cfg, offline: off, last: map[string]schema.Status{}, cleaned: map[string]bool{}}
	s.m = metrics{
		marked: prometheus.NewCounter(prometheus.CounterOpts{Name: "tm_sweeper_instances_marked_offline_total", Help: "Instances the sweeper marked offline."}),
		routes: prometheus.NewCounter(prometheus.CounterOpts{Name: "tm_sweeper_routes_cleaned_total", Help: "Route entries the sweeper removed dead instances from."}),
		owners: prometheus.NewCounter(prometheus.CounterOpts{Name: "tm_sweeper_owners_removed_total", Help: "Affinity placements a dead instance was removed from."}),
		alerts: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "tm_sweeper_alerts_total", Help: "Offline alerts by result (sent, failed)."}, []string{"result"}),
		sweeps: prometheus.NewCounter(prometheus.CounterOpts{Name: "tm_sweeper_sweeps_total", Help: "Sweeps run."}),
	}
	if cfg.Registerer != nil {
		s.m.marked = promreg.Register(cfg.Registerer, s.m.marked)
		s.m.routes = promreg.Register(cfg.Registerer, s.m.routes)
		s.m.owners = promreg.Register(cfg.Registerer, s.m.owners)
		s.m.alerts = promreg.Register(cfg.Registerer, s.m.alerts)
		s.m.sweeps = promreg.Register(cfg.Registerer, s.m.sweeps)
	}
	return s, nil
}

// Run cleans stale routes, then sweeps every Interval until ctx ends. Errors of one sweep are
// logged and the next sweep tries again.
func (s *Sweeper) Run(ctx context.Context) error {
	if n, err := s.CleanupRoutes(ctx); err != nil {
		s.cfg.Logger.Warn("stale-route cleanup failed", "err", err)
	} else if n > 0 {
		s.cfg.Logger.Info("stale routes cleaned on leader start", "removed", n)
	}
	t := time.NewTicker(s.cfg.Interval)
	defer t.Stop()
	for {
		if _, err := s.Sweep(ctx); err != nil && ctx.Err() == nil {
			s.cfg.Logger.Warn("sweep failed", "err", err)
		}
		select {
		case <-t.C:
		case <-ctx.Done():
			return nil
		}
	}
}

// Result is what one sweep did.
type Result struct {
	// Offline are the instances this sweep marked offline.
	Offline []string `json:"offline"`
	// Routes is how many route entries lost an instance.
	Routes int `json:"routes"`
	// Owners is how many affinity placements lost an owner.
	Owners int `json:"owners"`
}

// Sweep runs one pass over the directory. An offline instance is removed from routes and
// owners once per Sweeper (again if it comes back and dies again); routes left behind by
// instances that vanished from the directory are the job of CleanupRoutes at leader start.
// Sweep is not safe for concurrent use.
func (s *Sweeper) Sweep(ctx context.Context) (Result, error) {
	s.m.sweeps.Inc()
	var res Result
	insts, err := s.cfg.Store.Directory().Instances(ctx, "")
	if err != nil {
		return res, err
	}
	now := s.cfg.Now()
	seen := map[string]bool{}
	var errs []error
	for _, i := range insts {
		key := i.Key()
		seen[key] = true
		st := s.cfg.Health.Status(i, now)
		if now.Sub(i.Heartbeat) >= s.offline && i.Reported != schema.StatusOffline {
			if err := s.cfg.Store.Directory().MarkOffline(ctx, i); err != nil {
				if !errors.Is(err, schema.ErrConflict) { // a heartbeat landed: it lives
					errs = append(errs, fmt.Errorf("mark %s offline: %w", key, err))
				}
				continue
			}
			st = schema.StatusOffline
			s.m.marked.Inc()
			res.Offline = append(res.Offline, key)
			s.cfg.Logger.Warn("instance offline", "instance", key, "last_heartbeat", i.Heartbeat, "offline_after", s.offline)
			s.audit(ctx, i, "instance.offline", fmt.Sprintf("no heartbeat for %s (last %s)", s.offline, i.Heartbeat.Format(time.RFC3339)))
			s.alert(ctx, i, now)
		}
		switch {
		case st != schema.StatusOffline:
			delete(s.cleaned, key)
		case !s.cleaned[key]:
			n, o, err := s.forget(ctx, i.InstanceID)
			res.Routes += n
			res.Owners += o
			if err != nil {
				errs = append(errs, err)
			} else {
				s.cleaned[key] = true
			}
		}
		if prev, ok := s.last[key]; !ok || prev != st {
			if ok && s.cfg.OnEvent != nil {
				s.cfg.OnEvent(Event{Instance: key, Kind: i.Kind, Shard: i.Shard, From: prev, To: st, Time: now})
			}
			// The history keeps the newest change; a first sight after a leader change adds
			// nothing when the status is what the history already ends in.
			c := schema.StatusChange{From: prev, To: st, Time: now, Reason: s.reason(i, st, now)}
			if err := s.cfg.Store.Directory().AppendStatus(ctx, i.InstanceID, c); err != nil {
				errs = append(errs, fmt.Errorf("status history of %s: %w", key, err))
				continue // the next sweep tries again
			}
			s.last[key] = st
		}
	}
	for k := range s.last {
		if !seen[k] {
			delete(s.last, k)
			delete(s.cleaned, k)
			if id, err := schema.ParseInstanceID(k); err == nil {
				if err := s.cfg.Store.Directory().DeleteHistory(ctx, id); err != nil {
					errs = append(errs, fmt.Errorf("status history of %s: %w", k, err))
				}
			}
		}
	}
	return res, errors.Join(errs...)
}

// reason says why i has status st at now, for its status history.
func (s *Sweeper) reason(i schema.Instance, st schema.Status, now time.Time) string {
	switch st {
	case schema.StatusOffline:
		return "no heartbeat since " + i.Heartbeat.Format(time.RFC3339)
	case schema.StatusDraining:
		return "the instance reports draining"
	case schema.StatusDegraded:
		switch {
		case i.Flag != nil && i.Flag.Degraded:
			return strings.TrimSpace("flagged degraded by " + i.Flag.By + ": " + i.Flag.Reason)
		case i.Reported == schema.StatusDegraded:
			return "the instance reports degraded (error rate over its kind's degraded_error_rate)"
		case i.Metrics != nil && s.cfg.Health.Status(i, now) == schema.StatusDegraded && s.cfg.Health.Thresholds.Status(i, now) == schema.StatusOnline:
			return fmt.Sprintf("error rate %.2f", i.Metrics.ErrorRate)
		}
		return "heartbeat late: last " + i.Heartbeat.Format(time.RFC3339)
	}
	return ""
}

// forget removes a dead instance from every route and from affinity owners.
func (s *Sweeper) forget(ctx context.Context, id schema.InstanceID) (routes, owners int, err error) {
	routes, err = s.cfg.Store.Routes().RemoveInstanceEverywhere(ctx, id)
	s.m.routes.Add(float64(routes))
	if err != nil {
		return routes, 0, fmt.Errorf("remove %s from routes: %w", id.Key(), err)
	}
	if routes > 0 {
		s.cfg.Logger.Info("dead instance removed from routes", "instance", id.Key(), "routes", routes)
	}
	owners, err = s.removeOwner(ctx, id)
	s.m.owners.Add(float64(owners))
	return routes, owners, err
}

// removeOwner drops id from the owners of every placement of its kind, if the kind uses the
// affinity policy. A placement left without owners is deleted, so the gateway assigns the
// tenant afresh on its next request.
func (s *Sweeper) removeOwner(ctx context.Context, id schema.InstanceID) (int, error) {
	kc, err := s.cfg.Store.Kinds().Get(ctx, id.Kind)
	if err != nil || kc.Policy != schema.PolicyAffinity {
		return 0, nil
	}
	pls, _, err := s.cfg.Store.Placements(id.Kind).List(ctx)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, p := range pls {
		if !slices.Contains(p.Owners, id.Key()) {
			continue
		}
		next := p
		next.Owners = slices.DeleteFunc(slices.Clone(p.Owners), func(o string) bool { return o == id.Key() })
		next.UpdatedBy = s.cfg.Actor
		var after any
		if len(next.Owners) == 0 {
			err = s.cfg.Store.Placements(p.Kind).Delete(ctx, p.Tenant, p.Revision)
		} else {
			after, err = s.cfg.Store.Placements(next.Kind).Update(ctx, p, next)
		}
		if errors.Is(err, schema.ErrConflict) {
			continue // changed meanwhile; the next sweep looks again
		}
		if err != nil {
			return n, fmt.Errorf("remove %s from the owners of %s: %w", id.Key(), p.Tenant, err)
		}
		n++
		_ = s.cfg.Store.Audit().Append(ctx, schema.AuditEvent{Actor: s.cfg.Actor, Action: "placement.owner-removed", Kind: p.Kind, Tenant: p.Tenant,
			Before: p, After: after, Detail: "owner " + id.Key() + " is offline"})
	}
	return n, nil
}

// CleanupRoutes removes from every route the instances that are absent from the directory or
// offline (Aether routing's cleanup on leader start). Routes are read before the directory, so an
// instance that registers meanwhile (directory first, routes second) is never removed.
func (s *Sweeper) CleanupRoutes(ctx context.Context) (int, error) {
	routes, err := s.cfg.Store.Routes().List(ctx)
	if err != nil {
		return 0, err
	}
	insts, err := s.cfg.Store.Directory().Instances(ctx, "")
	if err != nil {
		return 0, err
	}
	now := s.cfg.Now()
	alive := map[string]bool{}
	for _, i := range insts {
		if s.cfg.Health.Thresholds.Status(i, now) != schema.StatusOffline {
			alive[i.Key()] = true
		}
	}
	n := 0
	for _, r := range routes {
		for _, k := range r.Instances {
			if alive[k] {
				continue
			}
			id, err := schema.ParseInstanceID(k)
			if err != nil {
				continue
			}
			if _, err := s.cfg.Store.Routes().RemoveInstance(ctx, r, id); err != nil {
				return n, err
			}
			n++
		}
	}
	s.m.routes.Add(float64(n))
	return n, nil
}

func (s *Sweeper) audit(ctx context.Context, i schema.Instance, action, detail string) {
	if err := s.cfg.Store.Audit().Append(ctx, schema.AuditEvent{Actor: s.cfg.Actor, Action: action, Kind: i.Kind, Detail: i.Key() + ": " + detail}); err != nil {
		s.cfg.Logger.Warn("audit failed", "action", action, "err", err)
	}
}

// alert posts the AGENT_OFFLINE alert, retrying with backoff. A webhook that keeps failing is
// logged and counted; the alert is not repeated by later sweeps.
func (s *Sweeper) alert(ctx context.Context, i schema.Instance, now time.Time) {
	if s.cfg.Webhook == "" {
		return
	}
	text := fmt.Sprintf("%s: instance %s (%s) is offline: no heartbeat for %s, last at %s",
		AlertAgentOffline, i.Key(), i.URL, s.offline, i.Heartbeat.UTC().Format(time.RFC3339))
	body, _ := json.Marshal(Alert{Type: AlertAgentOffline, Instance: i.Key(), Kind: i.Kind, Shard: i.Shard, URL: i.URL,
		LastHeartbeat: i.Heartbeat, OfflineAfter: s.offline.String(), Time: now.UTC(), Text: text, Content: text})
	err := backoff.Retry(ctx, backoff.Policy{Initial: 500 * time.Millisecond, Max: 30 * time.Second, Tries: 1 + max(s.cfg.WebhookRetries, 0)},
		func(ctx context.Context) error {
			retry, err := s.post(ctx, body)
			if err != nil && !retry {
				return backoff.Permanent(err)
			}
			return err
		})
	switch {
	case err == nil:
		s.m.alerts.WithLabelValues("sent").Inc()
		return
	case ctx.Err() != nil:
		return
	}
	s.m.alerts.WithLabelValues("failed").Inc()
	s.cfg.Logger.Error("offline alert failed", "instance", i.Key(), "webhook", s.cfg.Webhook, "err", err)
}

func (s *Sweeper) post(ctx context.Context, body []byte) (retry bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.WebhookTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.cfg.Webhook, bytes.NewReader(body))
	if err != nil {
		return false, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := s.cfg.Client.Do(req)
	if err != nil {
		return true, err
	}
	resp.Body.Close()
	if resp.StatusCode >= 200 && resp.StatusCode < 300 {
		return false, nil
	}
	return resp.StatusCode >= 500 || resp.StatusCode == http.StatusTooManyRequests, fmt.Errorf("webhook answered %s", resp.Status)
}
