package scale

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// Every part of the platform runs in a process of its own, so what each part uses is its
// process's: CPU time from /proc/PID/stat (user + system), resident memory from
// /proc/PID/status (VmRSS now, VmHWM the peak since it started). The harness itself (the
// traffic's clients, loading, plans) is the test process.

// usage is one process's CPU time so far and its memory now.
type usage struct {
	CPU      time.Duration
	RSS, HWM int64 // bytes
}

// clockTicks is the unit of /proc/PID/stat's times (USER_HZ, 100 on every Linux platform Go runs on).
const clockTicks = 100

// readUsage reads process pid's usage (pid 0: the test process).
func readUsage(pid int) (usage, error) {
	proc := "/proc/self"
	if pid != 0 {
		proc = "/proc/" + strconv.Itoa(pid)
	}
	var u usage
	stat, err := os.ReadFile(proc + "/stat")
	if err != nil {
		return u, fmt.Errorf("process %d: %w", pid, err)
	}
	// The fields after the command's name (in parentheses, which may hold spaces): state is
	// the 3rd field of the line, utime the 14th, stime the 15th.
	i := strings.LastIndexByte(string(stat), ')')
	f := strings.Fields(string(stat[i+1:]))
	if i < 0 || len(f) < 13 {
		return u, fmt.Errorf("process %d: cannot read %s/stat: %q", pid, proc, stat)
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return u, fmt.Errorf("process %d: cannot read the CPU times in %s/stat: %q", pid, proc, stat)
	}
	u.CPU = time.Duration(utime+stime) * time.Second / clockTicks
	status, err := os.ReadFile(proc + "/status")
	if err != nil {
		return u, fmt.Errorf("process %d: %w", pid, err)
	}
	for _, line := range strings.Split(string(status), "\n") {
		name, v, ok := strings.Cut(line, ":")
		if !ok || (name != "VmRSS" && name != "VmHWM") {
			continue
		}
		var kb int64
		if _, err := fmt.Sscanf(strings.TrimSpace(v), "%d kB", &kb); err != nil {
			return u, fmt.Errorf("process %d: %s in %s/status: %w", pid, name, proc, err)
		}
		if name == "VmRSS" {
			u.RSS = kb << 10
		} else {
			u.HWM = kb << 10
		}
	}
	return u, nil
}

// procUse is what one process used over a window: cores (CPU time / the window) and its
// memory at the window's end.
type procUse struct {
	Name, Role string
	Cores      float64
	RSS, HWM   int64
}

// sample reads every running process's usage, by name ("harness": the test process).
func (h *harness) sample() map[string]usage {
	out := map[string]usage{}
	self, err := readUsage(0)
	if err != nil {
		h.t.Fatal(err)
	}
	out[roleHarness] = self
	for _, m := range h.members() {
		u, err := readUsage(m.PID())
		if err != nil {
			h.t.Fatalf("%s: %v (has it exited?)\n%s", m.Name, err, m.Tail(3<<10))
		}
		out[m.Name] = u
	}
	return out
}

// usageOver is each process's use between samples a and b, d apart, in start order (the
// harness first).
func (h *harness) usageOver(a, b map[string]usage, d time.Duration) []procUse {
	use := func(name, role string) procUse {
		x, y := a[name], b[name]
		return procUse{Name: name, Role: role, Cores: (y.CPU - x.CPU).Seconds() / d.Seconds(), RSS: y.RSS, HWM: y.HWM}
	}
	out := []procUse{use(roleHarness, roleHarness)}
	for _, m := range h.members() {
		out = append(out, use(m.Name, m.role))
	}
	return out
}

// byRole sums f over the processes of role, and counts them.
func byRole(ps []procUse, role string, f func(procUse) float64) (sum float64, n int) {
	for _, p := range ps {
		if p.Role == role {
			sum += f(p)
			n++
		}
	}
	return sum, n
}
