package cli

import (
	"strings"
	"testing"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/autopilot"
)

// Freezes and maintenance marks go into the autopilot's stored state and show in `rebalance
// autopilot` (without a service: the state alone); a plan is paused, resumed (applied here) and
// another cancelled from the CLI.
func TestAutopilotAndPlanControlCommands(t *testing.T) {
	e := newEnv(t)
	e.startShard(t, "s-1")
	e.startShard(t, "s-2")
	for _, tenant := range []string{"a", "b", "c"} {
		e.place(t, tenant, "s-1")
	}
	if r := e.run(t, "", "freeze", "--for", "1h"); r.code != 2 || !strings.Contains(r.stderr, "--reason") {
		t.Fatalf("a freeze without a reason: %d %q", r.code, r.stderr)
	}
	if r := e.run(t, "", "freeze", "--for", "1h", "--reason", "release train"); r.code != 0 || !strings.Contains(r.stdout, "frozen until") {
		t.Fatalf("freeze: %d %q %q", r.code, r.stdout, r.stderr)
	}
	if r := e.run(t, "", "maintenance", "aggregate", "s-2", "--reason", "kernel upgrade"); r.code != 0 {
		t.Fatalf("maintenance: %d %q", r.code, r.stderr)
	}
	r := e.run(t, "", "autopilot", "--output", "json")
	st := decode[autopilot.State](t, r.stdout)
	if len(st.Freezes) != 1 || st.Freezes[0].Reason != "release train" || len(st.Maintenance) != 1 || st.Maintenance[0].Shard != "s-2" {
		t.Fatalf("autopilot state %+v (%s)", st, r.stderr)
	}
	if r := e.run(t, "", "autopilot"); !strings.Contains(r.stdout, "release train") || !strings.Contains(r.stdout, "kernel upgrade") {
		t.Fatalf("autopilot table:\n%s", r.stdout)
	}
	if r := e.run(t, "", "freeze", "--off"); r.code != 0 || !strings.Contains(r.stdout, "not frozen") {
		t.Fatalf("unfreeze: %d %q", r.code, r.stdout)
	}
	if r := e.run(t, "", "maintenance", "aggregate", "s-2", "--off"); r.code != 0 || !strings.Contains(r.stdout, "no shard marked") {
		t.Fatalf("clear maintenance: %d %q", r.code, r.stdout)
	}

	plan := func(moves ...string) string {
		r := e.run(t, "", append([]string{"plan", "--output", "json", "manual", "--kind", "aggregate", "--collect", "0"}, moves...)...)
		if r.code != 0 {
			t.Fatalf("plan: %d %s", r.code, r.stderr)
		}
		return decode[PlanOutput](t, r.stdout).ID
	}
	id := plan("a=s-2", "b=s-2")
	if r := e.run(t, "", "pause", id); r.code != 0 || !strings.Contains(r.stdout, "pause") {
		t.Fatalf("pause: %d %q %q", r.code, r.stdout, r.stderr)
	}
	if r := e.run(t, "", "apply", id, "--yes"); r.code == 0 || !strings.Contains(r.stderr, "paused") {
		t.Fatalf("applying a paused plan: %d %q: it should say to resume it", r.code, r.stderr)
	}
	if r := e.run(t, "", "resume", id, "--output", "json"); r.code != 0 {
		t.Fatalf("resume: %d %q", r.code, r.stderr)
	} else if got := decode[PlanResult](t, r.stdout); got.Plan.Status != rebalancer.PlanDone {
		t.Fatalf("resumed plan %s", got.Plan.Status)
	}
	id = plan("c=s-2")
	if r := e.run(t, "", "cancel", id); r.code != 0 {
		t.Fatalf("cancel: %d %q", r.code, r.stderr)
	}
	r = e.run(t, "", "status", id, "--output", "json")
	if got := decode[PlanResult](t, r.stdout); got.Plan.Status != rebalancer.PlanCancelled || got.Moves[0].State != rebalancer.MoveSkipped {
		t.Fatalf("cancelled plan %s, move %s", got.Plan.Status, got.Moves[0].State)
	}
	if r := e.run(t, "", "resume", id); r.code != 1 || !strings.Contains(r.stderr, "cancelled") {
		t.Fatalf("resuming a cancelled plan: %d %q", r.code, r.stderr)
	}
}
