package deploy

// A structural schema for the Kubernetes objects in deploy/k8s: the subset of the API these
// manifests use, as Go types decoded strictly, so a misspelt or misplaced field, or a value of
// the wrong type (replicas: "3"), fails here instead of at kubectl apply. Fields the API has but
// these manifests do not use are absent: using one means adding it here.

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"go.yaml.in/yaml/v3"
)

type k8sMeta struct {
	Name        string            `yaml:"name"`
	Namespace   string            `yaml:"namespace"`
	Labels      map[string]string `yaml:"labels"`
	Annotations map[string]string `yaml:"annotations"`
}

type k8sLabelSelector struct {
	MatchLabels map[string]string `yaml:"matchLabels"`
}

type k8sEnvVar struct {
	Name      string `yaml:"name"`
	Value     string `yaml:"value"`
	ValueFrom *struct {
		FieldRef *struct {
			FieldPath string `yaml:"fieldPath"`
		} `yaml:"fieldRef"`
		SecretKeyRef *struct {
			Name     string `yaml:"name"`
			Key      string `yaml:"key"`
			Optional bool   `yaml:"optional"`
		} `yaml:"secretKeyRef"`
		ConfigMapKeyRef *struct {
			Name string `yaml:"name"`
			Key  string `yaml:"key"`
		} `yaml:"configMapKeyRef"`
	} `yaml:"valueFrom"`
}

type k8sProbe struct {
	HTTPGet *struct {
		Path string `yaml:"path"`
		Port any    `yaml:"port"` // int or port name
	} `yaml:"httpGet"`
	Exec *struct {
		Command []string `yaml:"command"`
	} `yaml:"exec"`
	InitialDelaySeconds int `yaml:"initialDelaySeconds"`
	PeriodSeconds       int `yaml:"periodSeconds"`
	TimeoutSeconds      int `yaml:"timeoutSeconds"`
	SuccessThreshold    int `yaml:"successThreshold"`
	FailureThreshold    int `yaml:"failureThreshold"`
}

type k8sResources struct {
	Requests map[string]string `yaml:"requests"`
	Limits   map[string]string `yaml:"limits"`
}

type k8sContainer struct {
	Name            string      `yaml:"name"`
	Image           string      `yaml:"image"`
	ImagePullPolicy string      `yaml:"imagePullPolicy"`
	Command         []string    `yaml:"command"`
	Args            []string    `yaml:"args"`
	Env             []k8sEnvVar `yaml:"env"`
	Ports           []struct {
		Name          string `yaml:"name"`
		ContainerPort int    `yaml:"containerPort"`
		Protocol      string `yaml:"protocol"`
	} `yaml:"ports"`
	StartupProbe   *k8sProbe    `yaml:"startupProbe"`
	ReadinessProbe *k8sProbe    `yaml:"readinessProbe"`
	LivenessProbe  *k8sProbe    `yaml:"livenessProbe"`
	Resources      k8sResources `yaml:"resources"`
	Lifecycle      *struct {
		PreStop *struct {
			Exec *struct {
				Command []string `yaml:"command"`
			} `yaml:"exec"`
		} `yaml:"preStop"`
	} `yaml:"lifecycle"`
	SecurityContext *struct {
		RunAsNonRoot             *bool `yaml:"runAsNonRoot"`
		RunAsUser                *int  `yaml:"runAsUser"`
		AllowPrivilegeEscalation *bool `yaml:"allowPrivilegeEscalation"`
		ReadOnlyRootFilesystem   *bool `yaml:"readOnlyRootFilesystem"`
		Capabilities             *struct {
			Drop []string `yaml:"drop"`
			Add  []string `yaml:"add"`
		} `yaml:"capabilities"`
	} `yaml:"securityContext"`
	VolumeMounts []struct {
		Name      string `yaml:"name"`
		MountPath string `yaml:"mountPath"`
		ReadOnly  bool   `yaml:"readOnly"`
		SubPath   string `yaml:"subPath"`
	} `yaml:"volumeMounts"`
}

type k8sAffinityTerm struct {
	TopologyKey   string           `yaml:"topologyKey"`
	LabelSelector k8sLabelSelector `yaml:"labelSelector"`
}

type k8sPodTemplate struct {
	Metadata k8sMeta `yaml:"metadata"`
	Spec     struct {
		AutomountServiceAccountToken *bool `yaml:"automountServiceAccountToken"`
		ImagePullSecrets             []struct {
			Name string `yaml:"name"`
		} `yaml:"imagePullSecrets"`
		NodeSelector map[string]string `yaml:"nodeSelector"`
		Tolerations  []struct {
			Key               string `yaml:"key"`
			Operator          string `yaml:"operator"`
			Value             string `yaml:"value"`
			Effect            string `yaml:"effect"`
			TolerationSeconds *int   `yaml:"tolerationSeconds"`
		} `yaml:"tolerations"`
		ServiceAccountName            string `yaml:"serviceAccountName"`
		TerminationGracePeriodSeconds *int   `yaml:"terminationGracePeriodSeconds"`
		SecurityContext               *struct {
			RunAsNonRoot   *bool `yaml:"runAsNonRoot"`
			RunAsUser      *int  `yaml:"runAsUser"`
			RunAsGroup     *int  `yaml:"runAsGroup"`
			FSGroup        *int  `yaml:"fsGroup"`
			SeccompProfile *struct {
				Type string `yaml:"type"`
			} `yaml:"seccompProfile"`
		} `yaml:"securityContext"`
		Affinity *struct {
			PodAntiAffinity *struct {
				Preferred []struct {
					Weight          int             `yaml:"weight"`
					PodAffinityTerm k8sAffinityTerm `yaml:"podAffinityTerm"`
				} `yaml:"preferredDuringSchedulingIgnoredDuringExecution"`
				Required []k8sAffinityTerm `yaml:"requiredDuringSchedulingIgnoredDuringExecution"`
			} `yaml:"podAntiAffinity"`
		} `yaml:"affinity"`
		TopologySpreadConstraints []struct {
			MaxSkew           int              `yaml:"maxSkew"`
			TopologyKey       string           `yaml:"topologyKey"`
			WhenUnsatisfiable string           `yaml:"whenUnsatisfiable"`
			LabelSelector     k8sLabelSelector `yaml:"labelSelector"`
		} `yaml:"topologySpreadConstraints"`
		Containers []k8sContainer `yaml:"containers"`
		Volumes    []struct {
			Name      string `yaml:"name"`
			ConfigMap *struct {
				Name string `yaml:"name"`
			} `yaml:"configMap"`
			Secret *struct {
				SecretName  string `yaml:"secretName"`
				DefaultMode int    `yaml:"defaultMode"`
				Items       []struct {
					Key  string `yaml:"key"`
					Path string `yaml:"path"`
				} `yaml:"items"`
			} `yaml:"secret"`
			EmptyDir *struct {
				Medium    string `yaml:"medium"`
				SizeLimit string `yaml:"sizeLimit"`
			} `yaml:"emptyDir"`
		} `yaml:"volumes"`
	} `yaml:"spec"`
}

type k8sDeployment struct {
	APIVersion string  `yaml:"apiVersion"`
	Kind       string  `yaml:"kind"`
	Metadata   k8sMeta `yaml:"metadata"`
	Spec       struct {
		Replicas             *int             `yaml:"replicas"`
		RevisionHistoryLimit *int             `yaml:"revisionHistoryLimit"`
		Selector             k8sLabelSelector `yaml:"selector"`
		Strategy             *struct {
			Type          string `yaml:"type"`
			RollingUpdate *struct {
				MaxUnavailable any `yaml:"maxUnavailable"`
				MaxSurge       any `yaml:"maxSurge"`
			} `yaml:"rollingUpdate"`
		} `yaml:"strategy"`
		Template k8sPodTemplate `yaml:"template"`
	} `yaml:"spec"`
}

type k8sStatefulSet struct {
	APIVersion string  `yaml:"apiVersion"`
	Kind       string  `yaml:"kind"`
	Metadata   k8sMeta `yaml:"metadata"`
	Spec       struct {
		ServiceName         string           `yaml:"serviceName"`
		Replicas            *int             `yaml:"replicas"`
		PodManagementPolicy string           `yaml:"podManagementPolicy"`
		Selector            k8sLabelSelector `yaml:"selector"`
		UpdateStrategy      *struct {
			Type string `yaml:"type"`
		} `yaml:"updateStrategy"`
		Template             k8sPodTemplate `yaml:"template"`
		VolumeClaimTemplates []struct {
			Metadata k8sMeta `yaml:"metadata"`
			Spec     struct {
				AccessModes      []string     `yaml:"accessModes"`
				StorageClassName string       `yaml:"storageClassName"`
				Resources        k8sResources `yaml:"resources"`
			} `yaml:"spec"`
		} `yaml:"volumeClaimTemplates"`
	} `yaml:"spec"`
}

type k8sService struct {
	APIVersion string  `yaml:"apiVersion"`
	Kind       string  `yaml:"kind"`
	Metadata   k8sMeta `yaml:"metadata"`
	Spec       struct {
		Type                     string            `yaml:"type"`
		ClusterIP                string            `yaml:"clusterIP"`
		PublishNotReadyAddresses bool              `yaml:"publishNotReadyAddresses"`
		Selector                 map[string]string `yaml:"selector"`
		Ports                    []struct {
			Name       string `yaml:"name"`
			Port       int    `yaml:"port"`
			TargetPort any    `yaml:"targetPort"`
			Protocol   string `yaml:"protocol"`
		} `yaml:"ports"`
	} `yaml:"spec"`
}

type k8sPDB struct {
	APIVersion string  `yaml:"apiVersion"`
	Kind       string  `yaml:"kind"`
	Metadata   k8sMeta `yaml:"metadata"`
	Spec       struct {
		MinAvailable   any              `yaml:"minAvailable"`
		MaxUnavailable any              `yaml:"maxUnavailable"`
		Selector       k8sLabelSelector `yaml:"selector"`
	} `yaml:"spec"`
}

type k8sHPA struct {
	APIVersion string  `yaml:"apiVersion"`
	Kind       string  `yaml:"kind"`
	Metadata   k8sMeta `yaml:"metadata"`
	Spec       struct {
		ScaleTargetRef struct {
			APIVersion string `yaml:"apiVersion"`
			Kind       string `yaml:"kind"`
			Name       string `yaml:"name"`
		} `yaml:"scaleTargetRef"`
		MinReplicas int `yaml:"minReplicas"`
		MaxReplicas int `yaml:"maxReplicas"`
		Metrics     []struct {
			Type     string `yaml:"type"`
			Resource struct {
				Name   string `yaml:"name"`
				Target struct {
					Type               string `yaml:"type"`
					AverageUtilization int    `yaml:"averageUtilization"`
				} `yaml:"target"`
			} `yaml:"resource"`
		} `yaml:"metrics"`
		Behavior *struct {
			ScaleDown *struct {
				StabilizationWindowSeconds int `yaml:"stabilizationWindowSeconds"`
			} `yaml:"scaleDown"`
			ScaleUp *struct {
				StabilizationWindowSeconds int `yaml:"stabilizationWindowSeconds"`
			} `yaml:"scaleUp"`
		} `yaml:"behavior"`
	} `yaml:"spec"`
}

type k8sConfigMap struct {
	APIVersion string            `yaml:"apiVersion"`
	Kind       string            `yaml:"kind"`
	Metadata   k8sMeta           `yaml:"metadata"`
	Data       map[string]string `yaml:"data"`
}

type k8sNamespace struct {
	APIVersion string  `yaml:"apiVersion"`
	Kind       string  `yaml:"kind"`
	Metadata   k8sMeta `yaml:"metadata"`
}

type k8sSecret struct {
	APIVersion string            `yaml:"apiVersion"`
	Kind       string            `yaml:"kind"`
	Metadata   k8sMeta           `yaml:"metadata"`
	Type       string            `yaml:"type"`
	Data       map[string]string `yaml:"data"`
	StringData map[string]string `yaml:"stringData"`
}

// k8sServiceMonitor is the Prometheus Operator's ServiceMonitor (monitoring.coreos.com/v1).
type k8sServiceMonitor struct {
	APIVersion string  `yaml:"apiVersion"`
	Kind       string  `yaml:"kind"`
	Metadata   k8sMeta `yaml:"metadata"`
	Spec       struct {
		JobLabel          string           `yaml:"jobLabel"`
		Selector          k8sLabelSelector `yaml:"selector"`
		NamespaceSelector struct {
			MatchNames []string `yaml:"matchNames"`
			Any        bool     `yaml:"any"`
		} `yaml:"namespaceSelector"`
		Endpoints []struct {
			Port        string `yaml:"port"`
			Path        string `yaml:"path"`
			Interval    string `yaml:"interval"`
			Relabelings []struct {
				SourceLabels []string `yaml:"sourceLabels"`
				TargetLabel  string   `yaml:"targetLabel"`
				Regex        string   `yaml:"regex"`
				Replacement  string   `yaml:"replacement"`
				Action       string   `yaml:"action"`
			} `yaml:"relabelings"`
		} `yaml:"endpoints"`
	} `yaml:"spec"`
}

// k8sPrometheusRule is the Prometheus Operator's PrometheusRule: Prometheus' rule groups.
type k8sPrometheusRule struct {
	APIVersion string     `yaml:"apiVersion"`
	Kind       string     `yaml:"kind"`
	Metadata   k8sMeta    `yaml:"metadata"`
	Spec       alertRules `yaml:"spec"`
}

// k8sNetworkPolicy is networking.k8s.io/v1 NetworkPolicy (ingress rules only).
type k8sNetworkPolicy struct {
	APIVersion string  `yaml:"apiVersion"`
	Kind       string  `yaml:"kind"`
	Metadata   k8sMeta `yaml:"metadata"`
	Spec       struct {
		PodSelector k8sLabelSelector `yaml:"podSelector"`
		PolicyTypes []string         `yaml:"policyTypes"`
		Ingress     []struct {
			From []struct {
				PodSelector       *k8sLabelSelector `yaml:"podSelector"`
				NamespaceSelector *k8sLabelSelector `yaml:"namespaceSelector"`
			} `yaml:"from"`
			Ports []struct {
				Port     int    `yaml:"port"`
				Protocol string `yaml:"protocol"`
			} `yaml:"ports"`
		} `yaml:"ingress"`
	} `yaml:"spec"`
}

// k8sSchemas maps a kind to a new value of its schema type.
var k8sSchemas = map[string]func() any{
	"Deployment":              func() any { return new(k8sDeployment) },
	"StatefulSet":             func() any { return new(k8sStatefulSet) },
	"Service":                 func() any { return new(k8sService) },
	"PodDisruptionBudget":     func() any { return new(k8sPDB) },
	"HorizontalPodAutoscaler": func() any { return new(k8sHPA) },
	"ConfigMap":               func() any { return new(k8sConfigMap) },
	"Namespace":               func() any { return new(k8sNamespace) },
	"Secret":                  func() any { return new(k8sSecret) },
	"ServiceMonitor":          func() any { return new(k8sServiceMonitor) },
	"PrometheusRule":          func() any { return new(k8sPrometheusRule) },
	"NetworkPolicy":           func() any { return new(k8sNetworkPolicy) },
}

// TestKubernetesSchema decodes every object strictly into its schema type.
func TestKubernetesSchema(t *testing.T) {
	checkK8sSchema(t, loadK8s(t))
}

// checkK8sSchema decodes every object strictly into its schema type.
func checkK8sSchema(t *testing.T, objs []k8sObject) {
	t.Helper()
	n := 0
	for _, k := range objs {
		mk, ok := k8sSchemas[k.kind()]
		if !ok {
			t.Errorf("%v: no schema for kind %s", k, k.kind())
			continue
		}
		b, err := yaml.Marshal(k.o)
		if err != nil {
			t.Fatal(err)
		}
		dec := yaml.NewDecoder(bytes.NewReader(b))
		dec.KnownFields(true)
		if err := dec.Decode(mk()); err != nil {
			t.Errorf("%v: %v", k, err)
		}
		n++
	}
	if n == 0 {
		t.Fatal("no objects")
	}
}

// TestKustomizeBuild renders deploy/k8s with kubectl's built-in kustomize when kubectl is
// installed (it needs no cluster) and checks it yields the same objects the other tests read.
func TestKustomizeBuild(t *testing.T) {
	kubectl, err := exec.LookPath("kubectl")
	if err != nil {
		t.Skip("kubectl is not installed")
	}
	var stderr bytes.Buffer
	cmd := exec.Command(kubectl, "kustomize", "k8s")
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("kubectl kustomize deploy/k8s: %v\n%s", err, stderr.Bytes())
	}
	tmp := filepath.Join(t.TempDir(), "built.yaml")
	if err := os.WriteFile(tmp, out, 0o600); err != nil {
		t.Fatal(err)
	}
	built := map[string]bool{}
	for _, o := range yamlDocs(t, tmp) {
		built[getStr(o, "kind")+"/"+getStr(o, "metadata", "name")] = true
		if ns := getStr(o, "metadata", "namespace"); getStr(o, "kind") != "Namespace" && ns != namespace {
			t.Errorf("built %s/%s: namespace %q", getStr(o, "kind"), getStr(o, "metadata", "name"), ns)
		}
	}
	for _, k := range loadK8s(t) {
		id := k.kind() + "/" + k.name()
		if !built[id] {
			t.Errorf("kustomize build lacks %s", id)
		}
		delete(built, id)
	}
	for id := range built {
		t.Errorf("kustomize build has %s, which no file defines", id)
	}
}
