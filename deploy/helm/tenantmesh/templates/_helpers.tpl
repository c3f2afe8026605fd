{{/* Labels every object carries. */}}
{{- define "tenantmesh.labels" -}}
app.kubernetes.io/part-of: tenantmesh
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The image of every tenantmesh container. */}}
{{- define "tenantmesh.image" -}}
image: {{ printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
{{- end -}}

{{/* The NATS client URL: the chart's cluster, or nats.url. */}}
{{- define "tenantmesh.natsURL" -}}
{{- if .Values.nats.enabled -}}
nats://nats:4222
{{- else -}}
{{- required "nats.url is required when nats.enabled is false" .Values.nats.url -}}
{{- end -}}
{{- end -}}

{{/* Environment every tenantmesh process gets: NATS, its credentials, replicas, log format. */}}
{{- define "tenantmesh.commonEnv" -}}
- name: TM_NATS_URL
  value: {{ include "tenantmesh.natsURL" . | quote }}
- name: TM_NATS_CREDS
  value: /etc/tenantmesh/nats/nats.creds
- name: TM_REPLICAS
  value: {{ .Values.streamReplicas | quote }}
- name: TM_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
{{- end -}}

{{/* The admin token, from its Secret. */}}
{{- define "tenantmesh.adminTokenEnv" -}}
- name: TM_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.secrets.names.adminToken }}
      key: token
{{- end -}}

{{/* Extra TM_* settings from a map (name: value), sorted. */}}
{{- define "tenantmesh.extraEnv" -}}
{{- range $k, $v := . }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end -}}
{{- end -}}

{{/* The container security context of every tenantmesh container. */}}
{{- define "tenantmesh.containerSecurity" -}}
securityContext:
  runAsNonRoot: true
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
{{- end -}}

{{/* Probes on the http port: readiness /readyz, liveness /healthz; timings from ctx.probes. */}}
{{- define "tenantmesh.probes" -}}
readinessProbe:
  httpGet:
    path: /readyz
    port: http
  {{- toYaml .readiness | nindent 2 }}
livenessProbe:
  httpGet:
    path: /healthz
    port: http
  {{- toYaml .liveness | nindent 2 }}
{{- end -}}

{{/* Volume mounts and volumes: /tmp, the role's NATS credentials and, for the gateway and
the shards, a gateway-proof key ("gate": its key in the gate Secret: gate.key for the gateway,
<kind>.key for a shard, which never sees the gateways' key). Both take a dict: root, creds,
gate. */}}
{{- define "tenantmesh.mounts" -}}
volumeMounts:
  - name: tmp
    mountPath: /tmp
  - name: nats-creds
    mountPath: /etc/tenantmesh/nats
    readOnly: true
{{- if .gate }}
  - name: gate-key
    mountPath: /etc/tenantmesh/gate
    readOnly: true
{{- end }}
{{- end -}}
{{- define "tenantmesh.volumes" -}}
volumes:
  - name: tmp
    emptyDir: {}
  - name: nats-creds
    secret:
      secretName: {{ .creds }}
      defaultMode: 0400
{{- if .gate }}
  - name: gate-key
    secret:
      secretName: {{ .root.Values.secrets.names.gateKeys }}
      defaultMode: 0400
      items:
        - key: {{ .gate }}
          path: gate.key
{{- end }}
{{- end -}}

{{/* Pod-level settings every tenantmesh pod shares. */}}
{{- define "tenantmesh.podCommon" -}}
automountServiceAccountToken: false
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Prometheus annotations of a pod listening on port. */}}
{{- define "tenantmesh.scrapeAnnotations" -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ . | quote }}
prometheus.io/path: /metrics
{{- end -}}
