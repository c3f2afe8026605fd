package load

import (
	"math"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"
)

type clock struct{ t time.Time }

func (c *clock) now() time.Time          { return c.t }
func (c *clock) advance(d time.Duration) { c.t = c.t.Add(d) }

// setScore makes key's smoothed score exactly s (first report: no smoothing). cpu carries it.
func setScore(tr *Tracker, key string, s float64) {
	tr.mu.Lock()
	delete(tr.scores, key)
	tr.mu.Unlock()
	tr.Observe(key, 0, 0, s/0.3*100)
}

func TestScoreAndEMA(t *testing.T) {
	if got := Score(50, 100, 50); math.Abs(got-(0.2+0.15+0.15)) > 1e-9 {
		t.Fatalf("Score = %v", got)
	}
	tr := New(Config{}, nil, func() float64 { return 0 })
	tr.Observe("a", 100, 0, 0) // 0.4
	tr.Observe("a", 0, 0, 0)   // 0.3*0 + 0.7*0.4
	if got := tr.Load("a"); math.Abs(got-0.28) > 1e-9 {
		t.Fatalf("EMA = %v, want 0.28", got)
	}
}

// TestDecisionTable is the Queen coordinator's "Affinity vs Load Thresholds" table, row by row, with a fixed
// random draw and a fake clock.
func TestDecisionTable(t *testing.T) {
	tests := []struct {
		name       string
		target     float64 // the affinity target's load
		alt        float64 // the least-loaded alternative's load
		draw       float64 // the random draw
		want       Decision
		wantServer string
	}{
		{"below 70%: respect, even with a much better peer", 0.69, 0.0, 0.0, Respect, "a"},
		{"below 70%: respect, peer equal", 0.30, 0.30, 0.0, Respect, "a"},
		{"70-90%, gain under 15%: respect", 0.80, 0.70, 0.0, Respect, "a"},
		{"70-90%, gain exactly 15%: respect", 0.75, 0.60, 0.0, Respect, "a"},
		{"70-90%, gain 20%, draw under the gain: migrate", 0.80, 0.60, 0.19, Migrate, "b"},
		{"70-90%, gain 20%, draw over the gain: respect", 0.80, 0.60, 0.21, Respect, "a"},
		{"70-90%, gain 40%, draw 0.35: migrate", 0.85, 0.45, 0.35, Migrate, "b"},
		{"70-90%, gain 40%, draw 0.45: respect", 0.85, 0.45, 0.45, Respect, "a"},
		{"at 70%, gain 50%, draw 0.49: migrate", 0.70, 0.20, 0.49, Migrate, "b"},
		{"at 90%: break", 0.90, 0.85, 0.99, Break, "b"},
		{"above 90%: break even when the peer is barely better", 0.95, 0.94, 0.99, Break, "b"},
		{"above 90% but the target is still the least loaded: respect", 0.95, 0.97, 0.0, Respect, "a"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := &clock{t: time.Unix(1000, 0)}
			tr := New(Config{}, c.now, func() float64 { return tc.draw })
			setScore(tr, "a", 0)
			setScore(tr, "b", 0.5)
			if got, d := tr.Choose("t1", []string{"a", "b"}, "a"); got != "a" || d != Local {
				t.Fatalf("first choice %s %s, want a local", got, d)
			}
			setScore(tr, "a", tc.target)
			setScore(tr, "b", tc.alt)
			c.advance(time.Second)
			got, d := tr.Choose("t1", []string{"a", "b"}, "a")
			if got != tc.wantServer || d != tc.want {
				t.Fatalf("Choose = %s %s, want %s %s", got, d, tc.wantServer, tc.want)
			}
			if aff, _ := tr.Affinity("t1"); aff != tc.wantServer {
				t.Fatalf("affinity now %s, want %s", aff, tc.wantServer)
			}
		})
	}
}

// New affinities: forward only when a peer is more than 10% better; ties favour local.
func TestNewAffinity(t *testing.T) {
	tests := []struct {
		name, local string
		a, b        float64
		want        string
		d           Decision
	}{
		{"equal: local", "a", 0.5, 0.5, "a", Local},
		{"peer 10% better: local", "a", 0.5, 0.4, "a", Local},
		{"peer 11% better: forward", "a", 0.5, 0.39, "b", Forward},
		{"local is best", "b", 0.5, 0.2, "b", Local},
		{"no local: least loaded", "", 0.5, 0.45, "b", Forward},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tr := New(Config{}, (&clock{t: time.Unix(0, 0)}).now, func() float64 { return 0 })
			setScore(tr, "a", tc.a)
			setScore(tr, "b", tc.b)
			if got, d := tr.Choose("t1", []string{"a", "b"}, tc.local); got != tc.want || d != tc.d {
				t.Fatalf("Choose = %s %s, want %s %s", got, d, tc.want, tc.d)
			}
		})
	}
}

// The affinity expires after the TTL without use and when its instance goes away.
func TestAffinityTTL(t *testing.T) {
	c := &clock{t: time.Unix(0, 0)}
	tr := New(Config{}, c.now, func() float64 { return 0 })
	setScore(tr, "a", 0.3)
	setScore(tr, "b", 0.3)
	if got, _ := tr.Choose("t1", []string{"a", "b"}, "a"); got != "a" {
		t.Fatal(got)
	}
	setScore(tr, "a", 0.5) // b is now 20% better, but a is under 70%: respected
	c.advance(4 * time.Minute)
	if got, d := tr.Choose("t1", []string{"a", "b"}, "b"); got != "a" || d != Respect {
		t.Fatalf("within TTL: %s %s", got, d)
	}
	c.advance(5*time.Minute + time.Second)
	if _, ok := tr.Affinity("t1"); ok {
		t.Fatal("affinity survived its TTL")
	}
	if got, d := tr.Choose("t1", []string{"a", "b"}, "b"); got != "b" || d != Local {
		t.Fatalf("after TTL: %s %s", got, d)
	}
	tr.Forget("b")
	if _, ok := tr.Affinity("t1"); ok {
		t.Fatal("affinity to a dead instance survived")
	}
	if got, _ := tr.Choose("t1", []string{"a"}, "a"); got != "a" {
		t.Fatal(got)
	}
	if n := tr.Sweep(); n != 1 {
		t.Fatalf("Sweep left %d", n)
	}
}

func TestBalance(t *testing.T) {
	tr := New(Config{}, nil, func() float64 { return 0 })
	setScore(tr, "a", 0.45)
	setScore(tr, "b", 0.52)
	s, imb, ok := tr.Balance([]string{"a", "b"})
	if len(s) != 2 || math.Abs(imb-0.07) > 1e-9 || !ok {
		t.Fatalf("%v %v %v", s, imb, ok)
	}
	setScore(tr, "b", 0.9)
	if _, _, ok := tr.Balance([]string{"a", "b"}); ok {
		t.Fatal("0.45 vs 0.9 reported balanced")
	}
}

// The Queen coordinator's rows "70-90%, 15-30% better: 15-30% chance" and "> 30% better: 30-50% chance":
// with a fixed random source, the share of migrations matches the gain.
func TestMigrationProbability(t *testing.T) {
	for _, tc := range []struct{ target, alt float64 }{{0.80, 0.60}, {0.75, 0.50}, {0.85, 0.50}, {0.89, 0.40}} {
		rng := rand.New(rand.NewPCG(7, 11))
		c := &clock{t: time.Unix(0, 0)}
		tr := New(Config{}, c.now, rng.Float64)
		const trials = 20000
		migrated := 0
		for i := range trials {
			tenant := "t" + strconv.Itoa(i)
			setScore(tr, "a", 0)
			setScore(tr, "b", 0.5)
			tr.Choose(tenant, []string{"a", "b"}, "a")
			setScore(tr, "a", tc.target)
			setScore(tr, "b", tc.alt)
			if _, d := tr.Choose(tenant, []string{"a", "b"}, "a"); d == Migrate {
				migrated++
			}
		}
		gain := tc.target - tc.alt
		if got := float64(migrated) / trials; math.Abs(got-gain) > 0.02 {
			t.Errorf("target %.2f alt %.2f: migrated %.3f of the time, want about %.2f", tc.target, tc.alt, got, gain)
		}
	}
}
