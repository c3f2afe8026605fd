package deploy

import (
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// --- Prometheus ------------------------------------------------------------------------------

// promConfig is the part of Prometheus' configuration these files use; decoding is strict, so a
// misspelt key fails here rather than in Prometheus.
type promConfig struct {
	Global struct {
		ScrapeInterval     string            `yaml:"scrape_interval"`
		EvaluationInterval string            `yaml:"evaluation_interval"`
		ExternalLabels     map[string]string `yaml:"external_labels"`
	} `yaml:"global"`
	RuleFiles     []string `yaml:"rule_files"`
	ScrapeConfigs []struct {
		JobName       string `yaml:"job_name"`
		MetricsPath   string `yaml:"metrics_path"`
		StaticConfigs []struct {
			Targets []string          `yaml:"targets"`
			Labels  map[string]string `yaml:"labels"`
		} `yaml:"static_configs"`
		DNSSDConfigs []struct {
			Names           []string `yaml:"names"`
			Type            string   `yaml:"type"`
			Port            int      `yaml:"port"`
			RefreshInterval string   `yaml:"refresh_interval"`
		} `yaml:"dns_sd_configs"`
		KubernetesSDConfigs []struct {
			Role       string `yaml:"role"`
			Namespaces struct {
				Names []string `yaml:"names"`
			} `yaml:"namespaces"`
		} `yaml:"kubernetes_sd_configs"`
		RelabelConfigs []struct {
			SourceLabels []string `yaml:"source_labels"`
			Separator    string   `yaml:"separator"`
			Regex        string   `yaml:"regex"`
			TargetLabel  string   `yaml:"target_label"`
			Replacement  string   `yaml:"replacement"`
			Action       string   `yaml:"action"`
		} `yaml:"relabel_configs"`
	} `yaml:"scrape_configs"`
}

func loadProm(t *testing.T, path string) promConfig {
	t.Helper()
	var p promConfig
	strictYAML(t, path, &p)
	jobs := map[string]bool{}
	for _, sc := range p.ScrapeConfigs {
		if sc.JobName == "" || jobs[sc.JobName] {
			t.Errorf("%s: job_name %q empty or repeated", path, sc.JobName)
		}
		jobs[sc.JobName] = true
		for _, r := range sc.RelabelConfigs {
			switch r.Action {
			case "", "replace", "keep", "drop", "labelmap", "labeldrop", "labelkeep", "hashmod", "lowercase", "uppercase":
			default:
				t.Errorf("%s job %s: relabel action %q", path, sc.JobName, r.Action)
			}
			if r.Regex != "" {
				if _, err := regexp.Compile("^(?:" + r.Regex + ")$"); err != nil {
					t.Errorf("%s job %s: regex %q: %v", path, sc.JobName, r.Regex, err)
				}
			}
			if (r.Action == "" || r.Action == "replace") && r.TargetLabel == "" {
				t.Errorf("%s job %s: replace without target_label", path, sc.JobName)
			}
		}
	}
	return p
}

func TestPrometheusCompose(t *testing.T) {
	c := loadCompose(t)
	p := loadProm(t, "prometheus/prometheus.yml")
	scraped := map[string]bool{}
	for _, sc := range p.ScrapeConfigs {
		for _, st := range sc.StaticConfigs {
			for _, target := range st.Targets {
				host, port, ok := strings.Cut(target, ":")
				if !ok {
					t.Errorf("job %s: target %q without port", sc.JobName, target)
					continue
				}
				if host == "localhost" && sc.JobName == "prometheus" {
					continue
				}
				svc, exists := c.Services[host]
				if !exists {
					t.Errorf("job %s: target %s is not a compose service", sc.JobName, host)
					continue
				}
				if lp := listenPort(svc.Command, svc.env()); lp != port {
					t.Errorf("job %s: target %s, but %s listens on port %q", sc.JobName, target, host, lp)
				}
				scraped[host] = true
			}
		}
		for _, dns := range sc.DNSSDConfigs {
			if dns.Type != "A" || dns.Port == 0 {
				t.Errorf("job %s: dns_sd type %q port %d", sc.JobName, dns.Type, dns.Port)
			}
			for _, n := range dns.Names {
				svc, exists := c.Services[n]
				if !exists {
					t.Errorf("job %s: dns_sd name %s is not a compose service", sc.JobName, n)
					continue
				}
				if lp := listenPort(svc.Command, svc.env()); lp != strconv.Itoa(dns.Port) {
					t.Errorf("job %s: port %d, but %s listens on port %q", sc.JobName, dns.Port, n, lp)
				}
				if !strings.HasPrefix(n, sc.JobName+"-") {
					t.Errorf("job %s scrapes %s: the job is the shard's kind", sc.JobName, n)
				}
				scraped[n] = true
			}
		}
	}
	for name, s := range c.Services {
		if s.Image == "tenantmesh:dev" && !scraped[name] {
			t.Errorf("compose service %s is not scraped", name)
		}
	}
	// The compose prometheus service runs this file; Grafana's data source is that service.
	prom := c.Services["prometheus"]
	if !slices.Contains(prom.Volumes, "../prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro") {
		t.Errorf("compose prometheus does not mount deploy/prometheus/prometheus.yml: %v", prom.Volumes)
	}
	// The alert rules are loaded (rule_files, relative to the config) and mounted beside it.
	if !slices.Equal(p.RuleFiles, []string{alertRulesFile}) {
		t.Errorf("prometheus.yml rule_files %v, want [%s]", p.RuleFiles, alertRulesFile)
	}
	if !slices.Contains(prom.Volumes, "../prometheus/"+alertRulesFile+":/etc/prometheus/"+alertRulesFile+":ro") {
		t.Errorf("compose prometheus does not mount deploy/prometheus/%s beside its config: %v", alertRulesFile, prom.Volumes)
	}
}

func TestPrometheusKubernetes(t *testing.T) {
	objs := loadK8s(t)
	p := loadProm(t, "prometheus/prometheus-k8s.yml")
	if len(p.ScrapeConfigs) == 0 {
		t.Fatal("no scrape configs")
	}
	if !slices.Equal(p.RuleFiles, []string{alertRulesFile}) {
		t.Errorf("prometheus-k8s.yml rule_files %v, want [%s]", p.RuleFiles, alertRulesFile)
	}
	usedLabels := map[string]bool{}
	for _, sc := range p.ScrapeConfigs {
		if len(sc.KubernetesSDConfigs) == 0 {
			t.Errorf("job %s: no kubernetes_sd_configs", sc.JobName)
		}
		for _, k := range sc.KubernetesSDConfigs {
			if k.Role != "pod" || !slices.Equal(k.Namespaces.Names, []string{namespace}) {
				t.Errorf("job %s: role %q namespaces %v", sc.JobName, k.Role, k.Namespaces.Names)
			}
		}
		keepsAnnotated := false
		for _, r := range sc.RelabelConfigs {
			for _, l := range r.SourceLabels {
				if name, ok := strings.CutPrefix(l, "__meta_kubernetes_pod_label_"); ok {
					usedLabels[name] = true
				}
				if l == "__meta_kubernetes_pod_annotation_prometheus_io_scrape" && r.Action == "keep" {
					keepsAnnotated = true
				}
			}
		}
		if !keepsAnnotated {
			t.Errorf("job %s: does not keep only prometheus.io/scrape pods", sc.JobName)
		}
	}
	// Prometheus sanitizes label names: app.kubernetes.io/name -> app_kubernetes_io_name.
	sanitize := strings.NewReplacer(".", "_", "/", "_", "-", "_")
	for _, w := range byKind(objs, "Deployment", "StatefulSet") {
		labels := getMap(w.o, "spec", "template", "metadata", "labels")
		if getStr(w.o, "metadata", "name") == "nats" {
			continue
		}
		have := map[string]bool{}
		for k := range labels {
			have[sanitize.Replace(k)] = true
		}
		for l := range usedLabels {
			if l == "tenantmesh_io_shard" && w.kind() != "StatefulSet" {
				continue
			}
			if !have[l] {
				t.Errorf("%v: pods lack the label Prometheus reads as %s", w, l)
			}
		}
	}
}
