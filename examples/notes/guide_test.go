package main

import (
	"archive/zip"
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// block is one fenced code block of the README's guide, with the directive of the HTML comment
// just before it: "" (run it), "background" (another terminal), "under load" (run it while
// the test writes notes) or "file NAME" (save it as NAME).
type block struct {
	lang, directive, text string
}

// guideBlocks reads the "Make your service a shard" section of the README.
func guideBlocks(t *testing.T, readme string) []block {
	t.Helper()
	b, err := os.ReadFile(readme)
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(b), "\n## Make your service a shard\n")
	if !ok {
		t.Fatal("the README has no section \"Make your service a shard\"")
	}
	section, _, _ = strings.Cut(section, "\n## ")
	var out []block
	var cur *block
	directive := ""
	for line := range strings.Lines(section) {
		switch {
		case cur != nil && strings.TrimSpace(line) == "```":
			out = append(out, *cur)
			cur, directive = nil, ""
		case cur != nil:
			cur.text += line
		case strings.HasPrefix(line, "<!-- guide: "):
			directive = strings.TrimSuffix(strings.TrimSpace(strings.TrimPrefix(line, "<!-- guide: ")), "-->")
			directive = strings.TrimSpace(directive)
		case strings.HasPrefix(line, "```"):
			cur = &block{lang: strings.TrimSpace(strings.TrimPrefix(line, "```")), directive: directive}
		}
	}
	return out
}

// TestGuide runs the README's guide word for word in a new module: tenantmesh comes from a
// module proxy serving this working tree, the platform (devstack: embedded NATS, gateway,
// rebalancer) and two notes shards run as processes on free ports, and while the guide moves
// alice from notes-1 to notes-2 the test writes her notes through the gateway: no request may
// fail and every acknowledged note must be there after the move.
func TestGuide(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the platform and runs it as processes")
	}
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	blocks := guideBlocks(t, filepath.Join(root, "README.md"))
	work := t.TempDir()
	env := guideEnv(t, root)
	ports := freePorts(t, 5)
	for i, name := range []string{"TM_NATS_PORT", "TM_GATEWAY_PORT", "TM_REBALANCER_PORT", "NOTES_1_PORT", "NOTES_2_PORT"} {
		env = append(env, name+"="+strconv.Itoa(ports[i]))
	}
	sh := startShell(t, work, env)
	bgLog := &syncLog{}
	var bg []*proc
	t.Cleanup(func() {
		for i := len(bg) - 1; i >= 0; i-- { // shards before the platform
			bg[i].stop()
		}
		if t.Failed() {
			t.Logf("the processes' output:\n%s", tail(bgLog.String(), 150))
		}
	})
	gw := "http://127.0.0.1:" + strconv.Itoa(ports[1])
	for i, b := range blocks {
		switch {
		case strings.HasPrefix(b.directive, "file "):
			name := strings.TrimPrefix(b.directive, "file ")
			if want, err := os.ReadFile(name); err != nil || string(want) != b.text {
				t.Fatalf("the README's %s is not examples/notes/%s (%v): keep them the same", name, name, err)
			}
			if err := os.WriteFile(filepath.Join(work, name), []byte(b.text), 0o644); err != nil {
				t.Fatal(err)
			}
		case b.lang != "sh":
		case b.directive == "background":
			bg = append(bg, startBackground(t, work, env, bgLog, b.text))
		case b.directive == "under load":
			l := startLoad(gw, "alice")
			sh.run(t, i, b.text, 3*time.Minute)
			l.stop()
			l.check(t, "notes.notes-2.a")
		default:
			sh.run(t, i, b.text, 5*time.Minute)
		}
	}
}

// guideEnv is the environment the guide runs in: this machine's Go settings, with a module
// proxy serving the working tree as github.com/tenantmesh/tenantmesh in front of the usual
// one. The checksum database cannot know that version, so it is not asked; the other modules
// come from the module cache the repository's own build filled.
func guideEnv(t *testing.T, root string) []string {
	t.Helper()
	proxy := moduleProxy(t, root)
	out, err := exec.Command("go", "env", "GOPROXY").Output()
	if err != nil {
		t.Fatal(err)
	}
	var env []string
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(name, "TM_") || name == "GOFLAGS" || name == "GOPROXY" || name == "GOSUMDB" || name == "GOWORK" {
			continue
		}
		env = append(env, kv)
	}
	return append(env, "GOPROXY=file://"+proxy+","+strings.TrimSpace(string(out)), "GOSUMDB=off", "GOWORK=off",
		"GOTOOLCHAIN=local", "GOFLAGS=-modcacherw")
}

// moduleProxy writes a GOPROXY directory serving the files git knows in root (tracked, or new
// and not ignored; nested modules and the workspace file left out) as one pseudo-version named
// by their hash.
func moduleProxy(t *testing.T, root string) string {
	t.Helper()
	const mod = "github.com/tenantmesh/tenantmesh"
	out, err := exec.Command("git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard").Output()
	if err != nil {
		t.Fatalf("git ls-files: %v", err)
	}
	var files []string
	for f := range strings.SplitSeq(strings.TrimRight(string(out), "\x00"), "\x00") {
		if st, err := os.Stat(filepath.Join(root, f)); err == nil && st.Mode().IsRegular() && !strings.HasPrefix(f, "examples/") &&
			f != "go.work" && f != "go.work.sum" {
			files = append(files, f)
		}
	}
	h := sha256.New()
	for _, f := range files {
		b, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(h, "%s %d\n", f, len(b))
		h.Write(b)
	}
	version := "v0.0.0-20260101000000-" + hex.EncodeToString(h.Sum(nil))[:12]
	dir := filepath.Join(t.TempDir(), "proxy")
	vdir := filepath.Join(dir, mod, "@v")
	if err := os.MkdirAll(vdir, 0o755); err != nil {
		t.Fatal(err)
	}
	var zb bytes.Buffer
	zw := zip.NewWriter(&zb)
	for _, f := range files {
		w, err := zw.Create(mod + "@" + version + "/" + f)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := os.ReadFile(filepath.Join(root, f))
		_, _ = w.Write(b)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	gomod, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	info := fmt.Sprintf(`{"Version":%q,"Time":"2026-01-01T00:00:00Z"}`, version)
	for name, b := range map[string][]byte{
		"list": nil, version + ".info": []byte(info), version + ".mod": gomod, version + ".zip": zb.Bytes(),
	} {
		if err := os.WriteFile(filepath.Join(vdir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, mod, "@latest"), []byte(info), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// freePorts finds n ports free now (a process may take one before ours binds it; the guide's
// processes fail loudly then).
func freePorts(t *testing.T, n int) []int {
	t.Helper()
	var out []int
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		out = append(out, ln.Addr().(*net.TCPAddr).Port)
	}
	return out
}

// syncLog collects the output of the guide's processes.
type syncLog struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *syncLog) add(prefix, line string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.b.WriteString(prefix + line + "\n")
}

func (l *syncLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// proc is a process the guide started, in its own process group.
type proc struct {
	cmd  *exec.Cmd
	done chan struct{}
}

// start starts cmd with its output line by line to log, each line after prefix.
func start(t *testing.T, cmd *exec.Cmd, lines func(string)) *proc {
	t.Helper()
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{cmd: cmd, done: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			lines(sc.Text())
		}
		_, _ = io.Copy(io.Discard, pr)
	}()
	go func() {
		_ = cmd.Wait()
		pw.Close()
		close(p.done)
	}()
	return p
}

// stop sends SIGTERM to the process group (Ctrl-C in its terminal), and SIGKILL if it has not
// stopped within 30 s.
func (p *proc) stop() {
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.done
	}
}

// shell is the terminal the guide's commands run in, one after another, so an export carries.
type shell struct {
	dir   string
	in    io.WriteCloser
	log   *syncLog
	marks chan string
}

func startShell(t *testing.T, dir string, env []string) *shell {
	t.Helper()
	cmd := exec.Command("bash", "--noprofile", "--norc")
	cmd.Dir, cmd.Env = dir, env
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	s := &shell{dir: dir, in: in, log: &syncLog{}, marks: make(chan string, 16)}
	p := start(t, cmd, func(line string) {
		if strings.HasPrefix(line, "@@guide ") {
			s.marks <- line
		} else {
			s.log.add("  ", line)
		}
	})
	go func() {
		<-p.done
		close(s.marks)
	}()
	t.Cleanup(func() { in.Close(); p.stop() })
	if _, err := io.WriteString(in, "set -euo pipefail\n"); err != nil {
		t.Fatal(err)
	}
	return s
}

// run runs block i's text in the shell (stdin from /dev/null) and waits for it to succeed.
func (s *shell) run(t *testing.T, i int, text string, timeout time.Duration) {
	t.Helper()
	path := filepath.Join(s.dir, fmt.Sprintf(".guide-%d.sh", i))
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	s.log.add("", "$ "+strings.ReplaceAll(strings.TrimSpace(text), "\n", "\n$ "))
	if _, err := fmt.Fprintf(s.in, "source %s </dev/null\necho '@@guide %d'\n", path, i); err != nil {
		t.Fatalf("shell gone: %v\n%s", err, tail(s.log.String(), 60))
	}
	select {
	case m, ok := <-s.marks:
		if !ok || m != fmt.Sprintf("@@guide %d", i) {
			t.Fatalf("the guide's block %d failed:\n%s\n--- output:\n%s", i, text, tail(s.log.String(), 80))
		}
	case <-time.After(timeout):
		t.Fatalf("the guide's block %d did not finish within %s:\n%s\n--- output:\n%s", i, timeout, text, tail(s.log.String(), 80))
	}
}

// startBackground runs a block as another terminal would, until the test ends.
func startBackground(t *testing.T, dir string, env []string, log *syncLog, text string) *proc {
	t.Helper()
	cmd := exec.Command("bash", "--noprofile", "--norc", "-c", "exec "+strings.TrimSpace(text))
	cmd.Dir, cmd.Env = dir, env
	name := strings.Fields(text)[0]
	if f := strings.Fields(text); len(f) > 2 && f[1] == "--shard" {
		name = f[2]
	}
	prefix := fmt.Sprintf("%-12s| ", name)
	return start(t, cmd, func(line string) { log.add(prefix, line) })
}

// load writes notes for one tenant through the gateway until stopped, from 4 writers each
// writing every 25 ms, and remembers which were acknowledged.
type load struct {
	gw, tenant string
	done       chan struct{}
	wg         sync.WaitGroup

	mu       sync.Mutex
	acked    map[string]bool
	failures []string
	requests int
}

func startLoad(gw, tenant string) *load {
	l := &load{gw: gw, tenant: tenant, done: make(chan struct{}), acked: map[string]bool{}}
	hc := &http.Client{Timeout: 15 * time.Second}
	for w := range 4 {
		l.wg.Go(func() {
			tick := time.NewTicker(25 * time.Millisecond)
			defer tick.Stop()
			for i := 0; i < 100000; i++ {
				select {
				case <-l.done:
					return
				case <-tick.C:
				}
				id := fmt.Sprintf("load-%d-%d", w, i)
				code, body, err := l.post(hc, id)
				l.mu.Lock()
				l.requests++
				switch {
				case err != nil:
					l.failures = append(l.failures, id+": "+err.Error())
				case code != http.StatusCreated:
					l.failures = append(l.failures, fmt.Sprintf("%s: %d %s", id, code, body))
				default:
					l.acked[id] = true
				}
				l.mu.Unlock()
			}
		})
	}
	return l
}

func (l *load) post(hc *http.Client, id string) (int, string, error) {
	req, _ := http.NewRequest("POST", l.gw+"/notes", strings.NewReader(`{"id":"`+id+`","text":"under load"}`))
	req.Header.Set("x-tenant-id", l.tenant)
	resp, err := hc.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	return resp.StatusCode, string(b), nil
}

func (l *load) stop() {
	close(l.done)
	l.wg.Wait()
}

// check: no request failed, and every acknowledged note is in the tenant's list.
func (l *load) check(t *testing.T, servedBy string) {
	t.Helper()
	if len(l.failures) > 0 {
		t.Errorf("%d of %d writes failed during the move, first: %s", len(l.failures), l.requests, strings.Join(l.failures[:min(5, len(l.failures))], "; "))
	}
	req, _ := http.NewRequest("GET", l.gw+"/notes", nil)
	req.Header.Set("x-tenant-id", l.tenant)
	resp, err := (&http.Client{Timeout: 15 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var got []note
	if err := json.NewDecoder(resp.Body).Decode(&got); err != nil {
		t.Fatalf("GET /notes: %d %v", resp.StatusCode, err)
	}
	have := map[string]bool{}
	for _, n := range got {
		have[n.ID] = true
	}
	lost := 0
	for id := range l.acked {
		if !have[id] {
			lost++
		}
	}
	if lost > 0 || !have["n1"] {
		t.Errorf("%d of %d acknowledged notes lost (n1 there: %v)", lost, len(l.acked), have["n1"])
	}
	if got := resp.Header.Get("X-Served-By"); got != servedBy {
		t.Errorf("after the move %s is served by %q, want %s", l.tenant, got, servedBy)
	}
	if len(l.acked) == 0 {
		t.Error("no write was acknowledged during the move")
	}
	t.Logf("during the move: %d writes, %d acknowledged, %d failed; %s serves %d notes", l.requests, len(l.acked), len(l.failures), resp.Header.Get("X-Served-By"), len(got))
}
