package deploy

import (
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
)

// --- compose ---------------------------------------------------------------------------------

type composeFile struct {
	Name     string                    `yaml:"name"`
	Services map[string]composeService `yaml:"services"`
	Volumes  map[string]any            `yaml:"volumes"`
	Networks map[string]any            `yaml:"networks"`
	Ext      map[string]any            `yaml:",inline"` // x-* extension fields
}

type composeService struct {
	Image string `yaml:"image"`
	Build *struct {
		Context    string `yaml:"context"`
		Dockerfile string `yaml:"dockerfile"`
	} `yaml:"build"`
	Command     []string       `yaml:"command"`
	Entrypoint  []string       `yaml:"entrypoint"`
	Environment map[string]any `yaml:"environment"`
	Ports       []string       `yaml:"ports"`
	Expose      []string       `yaml:"expose"`
	Volumes     []string       `yaml:"volumes"`
	DependsOn   map[string]struct {
		Condition string `yaml:"condition"`
	} `yaml:"depends_on"`
	Healthcheck *struct {
		Test          []string `yaml:"test"`
		Interval      string   `yaml:"interval"`
		Timeout       string   `yaml:"timeout"`
		Retries       int      `yaml:"retries"`
		StartPeriod   string   `yaml:"start_period"`
		StartInterval string   `yaml:"start_interval"`
	} `yaml:"healthcheck"`
	Hostname        string            `yaml:"hostname"`
	Restart         string            `yaml:"restart"`
	StopGracePeriod string            `yaml:"stop_grace_period"`
	Labels          map[string]string `yaml:"labels"`
	User            string            `yaml:"user"`
}

func (s composeService) env() map[string]string {
	out := map[string]string{}
	for k, v := range s.Environment {
		out[k] = fmt.Sprint(v)
	}
	return out
}

func loadCompose(t *testing.T) composeFile {
	t.Helper()
	var c composeFile
	strictYAML(t, "compose/docker-compose.yml", &c)
	for k := range c.Ext {
		if !strings.HasPrefix(k, "x-") {
			t.Errorf("docker-compose.yml: unknown top-level key %q", k)
		}
	}
	return c
}

func TestCompose(t *testing.T) {
	c := loadCompose(t)
	flags := allFlags(t)
	built := dockerBinaries(t)
	hostPorts := map[string]string{}
	for name, s := range c.Services {
		where := "compose " + name
		if s.Image == "" && s.Build == nil {
			t.Errorf("%s: neither image nor build", where)
		}
		if s.Build != nil {
			ctx := filepath.Join("compose", s.Build.Context)
			if _, err := os.Stat(filepath.Join(ctx, "go.mod")); err != nil {
				t.Errorf("%s: build context %s is not the module root: %v", where, s.Build.Context, err)
			}
			if _, err := os.Stat(filepath.Join(ctx, s.Build.Dockerfile)); err != nil {
				t.Errorf("%s: dockerfile: %v", where, err)
			}
		}
		for dep, cond := range s.DependsOn {
			d, ok := c.Services[dep]
			if !ok {
				t.Errorf("%s: depends on %s, which is not a service", where, dep)
				continue
			}
			switch cond.Condition {
			case "service_healthy":
				if d.Healthcheck == nil {
					t.Errorf("%s: waits for %s to be healthy, which has no healthcheck", where, dep)
				}
			case "", "service_started", "service_completed_successfully":
			default:
				t.Errorf("%s: depends_on %s condition %q", where, dep, cond.Condition)
			}
		}
		if s.Healthcheck == nil || len(s.Healthcheck.Test) < 2 || s.Healthcheck.Test[0] != "CMD" {
			t.Errorf("%s: no healthcheck (CMD form)", where)
		}
		for _, p := range s.Ports {
			// Published on the loopback address only (issue 34, item 13): a laptop's stack
			// must not answer the network it is on.
			parts := strings.Split(p, ":")
			if len(parts) != 3 || parts[0] != "127.0.0.1" {
				t.Errorf("%s: port %q: want 127.0.0.1:host:container", where, p)
				continue
			}
			if other, dup := hostPorts[parts[1]]; dup {
				t.Errorf("%s: host port %s is also published by %s", where, parts[1], other)
			}
			hostPorts[parts[1]] = name
		}
		for k, v := range s.env() {
			// A secret has no default everyone knows: ${VAR:?...} makes compose refuse to
			// start without it.
			if (strings.Contains(k, "TOKEN") || strings.Contains(k, "PASSWORD")) && !strings.Contains(v, ":?") {
				t.Errorf("%s: %s=%q: a secret must be required (${VAR:?...}), never defaulted", where, k, v)
			}
		}
		for _, v := range s.Volumes {
			src, _, ok := strings.Cut(v, ":")
			if !ok {
				t.Errorf("%s: volume %q: want source:target", where, v)
				continue
			}
			if strings.HasPrefix(src, "./nats-auth/") {
				continue // written by rebalance auth init before the first up (see the file's header)
			}
			if strings.HasPrefix(src, ".") || strings.HasPrefix(src, "/") {
				if _, err := os.Stat(filepath.Join("compose", src)); err != nil {
					t.Errorf("%s: bind mount: %v", where, err)
				}
			} else if _, ok := c.Volumes[src]; !ok {
				t.Errorf("%s: named volume %s is not declared", where, src)
			}
		}
		if s.Image != "tenantmesh:dev" {
			continue
		}
		// A tenantmesh process.
		if len(s.Command) == 0 {
			t.Errorf("%s: no command", where)
			continue
		}
		binary := s.Command[0]
		if binary == "sh" && len(s.Command) == 3 {
			binary = strings.Fields(s.Command[2])[1] // sh -c "exec <binary> ..."
		}
		if !slices.Contains(built, binary) {
			t.Errorf("%s: runs %q, which the image does not build", where, binary)
		}
		env := s.env()
		var names []string
		for k := range env {
			names = append(names, k)
		}
		sort.Strings(names)
		flags.checkEnv(t, where, binary, names)
		if env["TM_NATS_URL"] == "" {
			t.Errorf("%s: no TM_NATS_URL", where)
		}
		if creds := env["TM_NATS_CREDS"]; creds == "" {
			t.Errorf("%s: no TM_NATS_CREDS: NATS runs secured", where)
		} else if !slices.ContainsFunc(s.Volumes, func(v string) bool { return strings.Contains(v, ":"+creds+":") }) {
			t.Errorf("%s: TM_NATS_CREDS %s is not mounted", where, creds)
		}
		for _, u := range strings.Split(env["TM_NATS_URL"], ",") {
			pu, err := url.Parse(u)
			if err != nil || c.Services[pu.Hostname()].Image == "" {
				t.Errorf("%s: TM_NATS_URL %q is not a compose service", where, u)
			} else if _, ok := s.DependsOn[pu.Hostname()]; !ok {
				t.Errorf("%s: does not depend on %s", where, pu.Hostname())
			}
		}
		port := listenPort(s.Command, env)
		if port == "" {
			t.Errorf("%s: no listen address (--addr or TM_ADDR)", where)
		}
		if s.Healthcheck != nil && !strings.Contains(strings.Join(s.Healthcheck.Test, " "), ":"+port+"/readyz") {
			t.Errorf("%s: healthcheck %v does not probe /readyz on the TM_ADDR port %s", where, s.Healthcheck.Test, port)
		}
		flags.checkCluster(t, where, binary, env)
	}
	for _, s := range Shards {
		svc, ok := c.Services[s.Name()]
		if !ok {
			t.Errorf("compose: no service for shard %s", s.Name())
			continue
		}
		if svc.env()["TM_SHARD"] != s.Name() {
			t.Errorf("compose %s: TM_SHARD %q", s.Name(), svc.env()["TM_SHARD"])
		}
		if len(svc.Command) != 3 || !strings.HasPrefix(svc.Command[2], "exec "+s.Kind+" ") {
			t.Errorf("compose %s: command %q does not run %s", s.Name(), svc.Command, s.Kind)
		}
	}
	for _, name := range []string{"gateway", "rebalancer", "prometheus", "grafana"} {
		if _, ok := c.Services[name]; !ok {
			t.Errorf("compose: no %s service", name)
		}
	}
}
