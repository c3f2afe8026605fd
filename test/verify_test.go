package test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// Move verification in the end-to-end and chaos runs: after a plan, its moves' target states at
// the fence are compared with their sources' (GET /api/plans/{id}/verify).

// verdict is one move's verification as the rebalancer's API reports it.
type verdict struct {
	Move, Kind, Tenant, Result, Detail string
	Source, Target                     []struct {
		TookMicros int64 `json:"took_us"`
	}
}

// digestTook collects how long the digests of verified moves took, by kind and side (the
// target's is inside the handoff pause; so is the runner source's).
var digestTook = struct {
	sync.Mutex
	by map[string][]time.Duration
}{by: map[string][]time.Duration{}}

func noteDigests(v verdict) {
	digestTook.Lock()
	defer digestTook.Unlock()
	for _, r := range v.Source {
		digestTook.by[v.Kind+" source"] = append(digestTook.by[v.Kind+" source"], time.Duration(r.TookMicros)*time.Microsecond)
	}
	for _, r := range v.Target {
		digestTook.by[v.Kind+" target"] = append(digestTook.by[v.Kind+" target"], time.Duration(r.TookMicros)*time.Microsecond)
	}
}

// digestSummary is "aggregate source p50 40us p99 90us (12), ..." over the moves verified.
func digestSummary() string {
	digestTook.Lock()
	defer digestTook.Unlock()
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(digestTook.by)) {
		d := digestTook.by[k]
		parts = append(parts, fmt.Sprintf("%s p50 %s p99 %s max %s (%d)", k, pct(d, 0.5), pct(d, 0.99), pct(d, 1), len(d)))
	}
	return strings.Join(parts, "; ")
}

// verifyPlan judges plan id's moves through the rebalancer at base.
func verifyPlan(t testing.TB, base, id string) []verdict {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := adminClient.Get(base + "/api/plans/" + id + "/verify")
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			var out struct{ Verdicts []verdict }
			if resp.StatusCode == http.StatusOK && json.Unmarshal(b, &out) == nil {
				return out.Verdicts
			}
			err = fmt.Errorf("%s: %s", resp.Status, bytes.TrimSpace(b))
		}
		if time.Now().After(deadline) {
			t.Fatalf("verify plan %s: %v", id, err)
		}
		time.Sleep(100 * time.Millisecond) // the service may be restarting (chaos): ask again
	}
}

// requireVerified fails the test unless every move of plan id matches: its target's state at
// the fence equals its source's. The aggregate and the projection record their digests on
// every move; the runner only for a kind that verifies (enableVerify), so its move is let
// through unverified when the runner kind does not.
func requireVerified(t testing.TB, base, id string) {
	t.Helper()
	for _, v := range verifyPlan(t, base, id) {
		noteDigests(v)
		if v.Result == "unverified" && strings.Contains(v.Detail, "does not verify moves") {
			continue
		}
		if v.Result != "match" {
			t.Errorf("plan %s move %s (%s/%s): %s: %s", id, v.Move, v.Kind, v.Tenant, v.Result, v.Detail)
		}
	}
}

// requireNoMismatch fails the test if a move of plan id left its target differing from its
// source. Under faults a move may stay unverified (its source died before its fence digest,
// or it did not commit); that is reported, not failed.
func requireNoMismatch(t testing.TB, base, id string) {
	t.Helper()
	var other []string
	for _, v := range verifyPlan(t, base, id) {
		switch v.Result {
		case "mismatch":
			t.Errorf("plan %s move %s (%s/%s): the target differs from the source: %s", id, v.Move, v.Kind, v.Tenant, v.Detail)
		case "match":
		default:
			other = append(other, fmt.Sprintf("%s/%s %s (%s)", v.Kind, v.Tenant, v.Result, v.Detail))
		}
	}
	if len(other) > 0 {
		t.Logf("plan %s: %s", id, strings.Join(other, "; "))
	}
}

// enableVerify turns move verification on for the stack's three kinds (their other settings
// kept) and waits until every runner instance takes digests (it follows its kind's config).
func enableVerify(t testing.TB, base string) {
	t.Helper()
	for _, kind := range []string{"aggregate", "projection", "runner"} {
		resp, err := adminClient.Get(base + "/api/kinds")
		if err != nil {
			t.Fatal(err)
		}
		var kcs []map[string]any
		err = json.NewDecoder(resp.Body).Decode(&kcs)
		resp.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		for _, kc := range kcs {
			if kc["kind"] == kind {
				kc["verify"] = true
				put(t, base+"/api/kinds/"+kind, kc)
			}
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		on, total := runnersVerifying(t, base)
		if total > 0 && on == total {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d runner instances take digests 30s after verify was set", on, total)
		}
		time.Sleep(50 * time.Millisecond) // polling the runners' status
	}
}

// runnersVerifying counts the runner instances whose status says they take digests.
func runnersVerifying(t testing.TB, base string) (on, total int) {
	t.Helper()
	resp, err := adminClient.Get(base + "/api/instances?kind=runner")
	if err != nil {
		t.Fatal(err)
	}
	var insts []struct {
		URL    string
		Status string `json:"derived_status"`
	}
	err = json.NewDecoder(resp.Body).Decode(&insts)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	for _, in := range insts {
		if in.Status != "online" {
			continue
		}
		total++
		req, _ := http.NewRequest(http.MethodGet, strings.TrimSuffix(in.URL, "/")+"/admin/runner/status", nil)
		req.Header.Set("Authorization", "Bearer "+stackAdminToken)
		resp, err := adminClient.Do(req)
		if err != nil {
			continue
		}
		var st struct{ Verify bool }
		if json.NewDecoder(resp.Body).Decode(&st) == nil && st.Verify {
			on++
		}
		resp.Body.Close()
	}
	return on, total
}

func put(t testing.TB, url string, body any) {
	t.Helper()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequest(http.MethodPut, url, bytes.NewReader(b))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+stackAdminToken)
	resp, err := adminClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		out, _ := io.ReadAll(resp.Body)
		t.Fatalf("PUT %s: %d %s", url, resp.StatusCode, out)
	}
}
