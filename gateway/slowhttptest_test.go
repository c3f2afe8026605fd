package gateway

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"sort"
	"strings"
	"testing"
	"time"
)

// TestSlowHTTPTest runs slowhttptest (Debian package slowhttptest) against a gateway with its
// default bounds, in its slow-body (R-U-Dead-Yet), slow-read and slow-headers (Slowloris)
// modes, while another client address sends a request every 100 ms: every one of those must
// be answered, within a second. It takes about a minute, so it runs only with
// TM_SLOWHTTPTEST=1 (make slowhttptest); docs/security.md has its figures.
func TestSlowHTTPTest(t *testing.T) {
	bin, err := exec.LookPath("slowhttptest")
	if err != nil || os.Getenv("TM_SLOWHTTPTEST") == "" {
		t.Skip("set TM_SLOWHTTPTEST=1 with slowhttptest installed (apt-get install slowhttptest)")
	}
	big := bytes.Repeat([]byte("x"), 1<<20)
	e, _ := slowEnv(t, Config{}, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/agg/big" {
			_, _ = w.Write(big)
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		_, _ = io.WriteString(w, "ok")
	})
	// slowhttptest has no option for another header: its Accept value carries x-tenant-id.
	accept := "*/*\r\nx-tenant-id: t1"
	modes := []struct {
		name string
		args []string
	}{
		{"slow body", []string{"-B", "-c", "800", "-r", "200", "-i", "2", "-s", "65536", "-x", "16", "-u", e.url + "/agg/upload"}},
		{"slow read", []string{"-X", "-c", "800", "-r", "200", "-w", "1", "-y", "16", "-n", "3", "-z", "16", "-k", "4", "-u", e.url + "/agg/big"}},
		{"slow headers", []string{"-H", "-c", "800", "-r", "200", "-i", "2", "-x", "16", "-u", e.url + "/agg/x"}},
	}
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
			defer cancel()
			args := append(append([]string{}, m.args...), "-l", "20", "-p", "3", "-m", accept)
			var out bytes.Buffer
			cmd := exec.CommandContext(ctx, bin, args...)
			cmd.Stdout, cmd.Stderr = &out, &out
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- cmd.Wait() }()
			base := heapInUse()
			lat, failed, heap, gor := probe(t, e, done)
			sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
			t.Logf("%s: other client %d requests, %d failed, p50 %v p99 %v max %v; heap at most %+d MB, goroutines at most %d",
				m.name, len(lat)+failed, failed, lat[len(lat)/2], lat[len(lat)*99/100], lat[len(lat)-1], (int64(heap)-int64(base))>>20, gor)
			if s := summary(out.String()); s != "" {
				t.Logf("slowhttptest: %s", s)
			}
			if failed > 0 || lat[len(lat)-1] > time.Second {
				t.Fatalf("the gateway did not keep serving another client: %d failed, slowest %v", failed, lat[len(lat)-1])
			}
		})
	}
}

// probe sends a request every 100 ms from 127.0.0.2 until done, and returns the latencies,
// the failures, and the largest heap and goroutine count of the process (the gateway's).
func probe(t *testing.T, e *env, done <-chan error) (lat []time.Duration, failed int, heap uint64, gor int) {
	tr := &http.Transport{DialContext: (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}}).DialContext}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr, Timeout: 5 * time.Second}
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-done:
			return lat, failed, heap, gor
		case <-tick.C:
		}
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		heap, gor = max(heap, ms.HeapAlloc), max(gor, runtime.NumGoroutine())
		req, _ := http.NewRequest("GET", e.url+"/agg/probe", nil)
		req.Header.Set("x-tenant-id", "t1")
		t0 := time.Now()
		resp, err := hc.Do(req)
		if err != nil || resp.StatusCode != 200 {
			failed++
		} else {
			lat = append(lat, time.Since(t0))
		}
		if resp != nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}
}

var ansi = regexp.MustCompile("\x1b\\[[0-9;]*m")

// summary is slowhttptest's last status lines.
func summary(out string) string {
	lines := strings.Split(strings.TrimSpace(ansi.ReplaceAllString(out, "")), "\n")
	var keep []string
	for _, l := range lines {
		if strings.Contains(l, "closed:") || strings.Contains(l, "connected:") || strings.Contains(l, "Exit status") {
			keep = append(keep, strings.Join(strings.Fields(l), " "))
		}
	}
	if len(keep) > 3 {
		keep = keep[len(keep)-3:]
	}
	return strings.Join(keep, "; ")
}
