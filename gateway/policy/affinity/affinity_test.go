package affinity

import (
	"slices"
	"testing"
	"time"
)

func keys(plan []Attempt) []string {
	out := make([]string, len(plan))
	for i, a := range plan {
		out[i] = a.Key
	}
	return out
}

// serve plays one successful request: the plan's first attempt serves and, if new, joins.
func serve(s *Selector, tenant string, servers []Server, m int) Attempt {
	plan := s.Plan(tenant, servers, m)
	a := plan[0]
	if a.New {
		owners := append([]string{a.Key}, s.Owners(tenant)...)
		if len(owners) > m {
			owners = owners[:m]
		}
		s.SetOwners(tenant, owners)
	}
	s.Served(tenant, a.Key)
	return a
}

// The prerender manager: selection with M=1 is sticky; new tenants go round-robin.
func TestSelectionMultiplex1(t *testing.T) {
	s := New(nil)
	servers := []Server{{"a", 4}, {"b", 4}}
	first := serve(s, "r1", servers, 1).Key
	for range 5 {
		if got := serve(s, "r1", servers, 1).Key; got != first {
			t.Fatalf("r1 moved from %s to %s", first, got)
		}
	}
	if second := serve(s, "r2", servers, 1).Key; second == first {
		t.Fatalf("r2 went to %s as well: no round-robin", second)
	}
}

// The prerender manager: M=2 grows organically to two owners and alternates between them.
func TestSelectionMultiplex2(t *testing.T) {
	s := New(nil)
	servers := []Server{{"a", 1}, {"b", 1}}
	var got []string
	for range 6 {
		got = append(got, serve(s, "r1", servers, 2).Key)
	}
	for i := 1; i < len(got); i++ {
		if got[i] == got[i-1] {
			t.Fatalf("not alternating: %v", got)
		}
	}
	if s.Count("a") != 1 || s.Count("b") != 1 {
		t.Fatalf("counts a=%d b=%d", s.Count("a"), s.Count("b"))
	}
}

// The prerender manager: eviction shrinks the deque and frees the capacity.
func TestSelectionEviction(t *testing.T) {
	s := New(nil)
	servers := []Server{{"a", 1}, {"b", 1}}
	s.SetOwners("r1", []string{"a", "b"})
	s.SetOwners("r1", []string{"b"})
	if s.Count("a") != 0 {
		t.Fatal("a still counted")
	}
	if got := serve(s, "r1", servers, 2).Key; got != "b" {
		t.Fatalf("after eviction from a: %s", got)
	}
	if got := serve(s, "r2", servers, 1).Key; got != "a" {
		t.Fatalf("freed capacity not used: %s", got)
	}
}

// The prerender manager: the round-robin fallback prefers servers with room.
func TestSelectionCapacity(t *testing.T) {
	s := New(nil)
	servers := []Server{{"a", 2}, {"b", 4}}
	for _, r := range []string{"r1", "r2", "r3", "r4", "r5"} {
		serve(s, r, servers, 1)
	}
	if s.Count("a") != 2 || s.Count("b") != 3 {
		t.Fatalf("a=%d b=%d", s.Count("a"), s.Count("b"))
	}
	// Owners fail: the fallback goes to a server with room.
	plan := s.Plan("r1", servers, 1)
	last := plan[len(plan)-1]
	if !last.Fallback || last.Key != "b" && s.Owners("r1")[0] == "a" {
		t.Fatalf("fallback %+v", plan)
	}
}

// The prerender manager: all full -> pressure mode, to the owner of the globally least-recently-used tenant.
func TestSelectionPressure(t *testing.T) {
	now := time.Unix(0, 0)
	s := New(func() time.Time { return now })
	servers := []Server{{"a", 1}, {"b", 1}}
	serve(s, "old", servers, 1)
	now = now.Add(time.Second)
	serve(s, "new", servers, 1)
	now = now.Add(time.Second)
	serve(s, "new", servers, 1)
	oldOwner := s.Owners("old")[0]
	plan := s.Plan("third", servers, 1)
	if !plan[0].Pressure || !plan[0].New || plan[0].Key != oldOwner {
		t.Fatalf("pressure plan %+v, want the owner of old (%s)", plan, oldOwner)
	}
	if s.Count(oldOwner) != 1 {
		t.Fatal("pressure planning changed the counts")
	}
	if !slices.Contains(keys(plan), "a") || !slices.Contains(keys(plan), "b") {
		t.Fatalf("no fallback: %+v", plan)
	}
	if s.Plan("x", nil, 1) != nil {
		t.Fatal("plan without servers")
	}
}
