package autopilot

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// State is what the autopilot keeps in tm_rebalance (key schema.AutopilotState), so a new leader
// carries on where the last one stopped: the operators' freezes and maintenance marks, and
// the moves the autopilot made lately (its budgets and per-tenant cool-downs count them).
type State struct {
	Freezes     []Freeze      `json:"freezes,omitempty"`
	Maintenance []Maintenance `json:"maintenance,omitempty"`
	Moves       []Moved       `json:"moves,omitempty"`

	Revision uint64 `json:"-"`
}

// Freeze stops the autopilot's balance, fill and evacuate plans from From to Until (a change
// freeze). Failover still runs: it brings tenants back, it does not rearrange them.
type Freeze struct {
	From   time.Time `json:"from"`
	Until  time.Time `json:"until"`
	Reason string    `json:"reason"`
	By     string    `json:"by"`
}

// Maintenance marks a shard an operator is taking down: the autopilot empties it (evacuate)
// and moves nothing onto it until the mark is cleared.
type Maintenance struct {
	Kind   string    `json:"kind"`
	Shard  string    `json:"shard"`
	Reason string    `json:"reason"`
	By     string    `json:"by"`
	At     time.Time `json:"at"`
}

// Moved is one move the autopilot made.
type Moved struct {
	At       time.Time `json:"at"`
	Kind     string    `json:"kind"`
	Tenant   string    `json:"tenant"`
	Bytes    uint64    `json:"bytes,omitempty"`
	Plan     string    `json:"plan"`
	Failover bool      `json:"failover,omitempty"`
}

// ReadState reads the autopilot's state (empty if none was written).
func ReadState(ctx context.Context, st *schema.Store) (State, error) {
	var s State
	rev, err := st.Rebalance().Latest(ctx, schema.AutopilotState, &s)
	if errors.Is(err, schema.ErrNotFound) {
		return State{}, nil
	}
	if err != nil {
		return State{}, err
	}
	s.Revision = rev
	return s, nil
}

// UpdateState applies change to the stored state by compare-and-set, reading again when
// another writer was first, and returns the state as written.
func UpdateState(ctx context.Context, st *schema.Store, change func(*State) error) (State, error) {
	for range 16 {
		s, err := ReadState(ctx, st)
		if err != nil {
			return s, err
		}
		if err := change(&s); err != nil {
			return s, err
		}
		var rev uint64
		if s.Revision == 0 {
			rev, err = st.Rebalance().Create(ctx, schema.AutopilotState, s)
		} else {
			rev, err = st.Rebalance().Update(ctx, schema.AutopilotState, s.Revision, s)
		}
		if err == nil {
			s.Revision = rev
			return s, nil
		}
		if !errors.Is(err, schema.ErrConflict) {
			return s, err
		}
	}
	return State{}, errors.New("autopilot: its state kept changing underneath")
}

// Frozen is the freeze in force at now, if any.
func (s State) Frozen(now time.Time) (Freeze, bool) {
	for _, f := range s.Freezes {
		if !now.Before(f.From) && now.Before(f.Until) {
			return f, true
		}
	}
	return Freeze{}, false
}

// InMaintenance reports whether kind's shard is marked for maintenance.
func (s State) InMaintenance(kind, shard string) bool {
	return slices.ContainsFunc(s.Maintenance, func(m Maintenance) bool { return m.Kind == kind && m.Shard == shard })
}

// prune drops freezes that ended and moves older than keep.
func (s *State) prune(now time.Time, keep time.Duration) {
	s.Freezes = slices.DeleteFunc(s.Freezes, func(f Freeze) bool { return !now.Before(f.Until) })
	s.Moves = slices.DeleteFunc(s.Moves, func(m Moved) bool { return now.Sub(m.At) > keep })
}

// usage counts the moves and bytes the autopilot made within window before now.
func (s State) usage(now time.Time, window time.Duration) (moves int, bytes uint64) {
	for _, m := range s.Moves {
		if now.Sub(m.At) <= window {
			moves++
			bytes += m.Bytes
		}
	}
	return moves, bytes
}

// cooling lists kind's tenants the autopilot moved within cooldown before now.
func (s State) cooling(kind string, now time.Time, cooldown time.Duration) map[string]time.Time {
	out := map[string]time.Time{}
	for _, m := range s.Moves {
		if m.Kind == kind && now.Sub(m.At) <= cooldown {
			out[m.Tenant] = m.At
		}
	}
	return out
}

// Window is a recurring time of day (UTC) on some days of the week when the autopilot may
// rearrange tenants (a maintenance window): "Mon-Fri 22:00-06:00", "Sat 00:00-24:00",
// "02:00-04:00" (every day). An end before the start runs past midnight.
type Window struct {
	Days       [7]bool // by time.Weekday
	Start, End time.Duration
	text       string
}

func (w Window) String() string { return w.text }

// ParseWindows parses windows separated by ";".
func ParseWindows(s string) ([]Window, error) {
	var out []Window
	for part := range strings.SplitSeq(s, ";") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		w, err := parseWindow(part)
		if err != nil {
			return nil, err
		}
		out = append(out, w)
	}
	return out, nil
}

var weekdays = map[string]time.Weekday{"sun": time.Sunday, "mon": time.Monday, "tue": time.Tuesday, "wed": time.Wednesday,
	"thu": time.Thursday, "fri": time.Friday, "sat": time.Saturday}

func parseWindow(s string) (Window, error) {
	w := Window{text: s}
	bad := func(why string) (Window, error) {
		return Window{}, fmt.Errorf("autopilot: window %q: %s (write it as \"Mon-Fri 22:00-06:00\", \"Sat 00:00-24:00\" or \"02:00-04:00\", UTC)", s, why)
	}
	days, span, found := strings.Cut(s, " ")
	if !found {
		days, span = "", s
		for d := range w.Days {
			w.Days[d] = true
		}
	} else {
		from, to, isRange := strings.Cut(strings.ToLower(days), "-")
		a, ok1 := weekdays[from]
		b, ok2 := weekdays[to]
		if !isRange {
			b, ok2 = a, ok1
		}
		if !ok1 || !ok2 {
			return bad("days are Mon, Tue, ... or a range Mon-Fri")
		}
		for d := a; ; d = (d + 1) % 7 {
			w.Days[d] = true
			if d == b {
				break
			}
		}
	}
	from, to, ok := strings.Cut(strings.TrimSpace(span), "-")
	if !ok {
		return bad("the times are HH:MM-HH:MM")
	}
	var err error
	if w.Start, err = clock(from); err != nil {
		return bad(err.Error())
	}
	if w.End, err = clock(to); err != nil {
		return bad(err.Error())
	}
	if w.Start == w.End {
		return bad("it is empty")
	}
	return w, nil
}

func clock(s string) (time.Duration, error) {
	h, m, ok := strings.Cut(s, ":")
	hh, err1 := strconv.Atoi(h)
	mm, err2 := strconv.Atoi(m)
	if !ok || err1 != nil || err2 != nil || hh < 0 || hh > 24 || mm < 0 || mm > 59 || hh == 24 && mm > 0 {
		return 0, fmt.Errorf("%q is not a time HH:MM", s)
	}
	return time.Duration(hh)*time.Hour + time.Duration(mm)*time.Minute, nil
}

// Open reports whether t falls in the window.
func (w Window) Open(t time.Time) bool {
	t = t.UTC()
	day := t.Weekday()
	since := time.Duration(t.Hour())*time.Hour + time.Duration(t.Minute())*time.Minute + time.Duration(t.Second())*time.Second
	if w.Start < w.End {
		return w.Days[day] && since >= w.Start && since < w.End
	}
	// Past midnight: the evening belongs to day, the morning to the day before.
	return w.Days[day] && since >= w.Start || w.Days[(day+6)%7] && since < w.End
}
