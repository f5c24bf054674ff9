{{/*
Names. The release's full name is at most 63 characters; a component's object name is at most 52,
so that what Kubernetes derives from it stays a valid label value (a StatefulSet's or DaemonSet's
controller-revision-hash label is the name, a dash and a 10-character hash).
*/}}
{{- define "racer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "racer.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* (dict "root" $ "component" "gateway") -> "<fullname>-gateway", at most 52 characters */}}
{{- define "racer.componentName" -}}
{{- $prefix := include "racer.fullname" .root | trunc (int (sub 51 (len .component))) | trimSuffix "-" -}}
{{- printf "%s-%s" $prefix .component -}}
{{- end -}}

{{- define "racer.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* the image's tag as a label value (at most 63 characters, starting and ending alphanumeric) */}}
{{- define "racer.version" -}}
{{- $v := .Values.image.tag | default .Chart.AppVersion -}}
{{- regexReplaceAll "[^A-Za-z0-9_.-]" $v "_" | trunc 63 | trimAll "-_." -}}
{{- end -}}

{{/* (dict "root" $ "component" C): the standard labels */}}
{{- define "racer.labels" -}}
helm.sh/chart: {{ include "racer.chart" .root }}
{{ include "racer.selectorLabels" . }}
app.kubernetes.io/version: {{ include "racer.version" .root | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: racer
{{- end -}}

{{- define "racer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "racer.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "racer.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/* URLs inside the namespace */}}
{{- define "racer.controlPlaneURL" -}}
{{- printf "http://%s:%d" (include "racer.componentName" (dict "root" . "component" "control-plane")) (int .Values.controlPlane.port) -}}
{{- end -}}

{{/* (dict "root" $ "port" P "annotations" MAP): pod annotations, Prometheus's among them when asked */}}
{{- define "racer.podAnnotations" -}}
{{- $out := dict -}}
{{- if and .root.Values.metrics.podAnnotations .port -}}
{{- $_ := set $out "prometheus.io/scrape" "true" -}}
{{- $_ := set $out "prometheus.io/port" (printf "%d" (int .port)) -}}
{{- $_ := set $out "prometheus.io/path" "/metrics" -}}
{{- end -}}
{{- $out = merge (deepCopy (.annotations | default dict)) $out -}}
{{- if $out -}}
annotations:
  {{- toYaml $out | nindent 2 }}
{{- end -}}
{{- end -}}

{{/* what every pod spec starts with: no service-account token, the pod security context, pull secrets */}}
{{- define "racer.podSecurity" -}}
automountServiceAccountToken: false
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* env from a Secret: (dict "name" ENV "ref" .Values.secrets.X) */}}
{{- define "racer.secretEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ .ref.name }}
      key: {{ .ref.key }}
{{- end -}}

{{/* --trace and --path, the same on the gateways and the agents */}}
{{- define "racer.traceArgs" -}}
- --trace
- {{ .Values.trace.kind | quote }}
{{- if .Values.trace.path }}
- --path
- {{ .Values.trace.path | quote }}
{{- end -}}
{{- end -}}

{{- define "racer.traceEnv" -}}
{{- if .Values.trace.dataVolume -}}
- name: RACER_DATA_DIR
  value: {{ .Values.trace.dataDir | quote }}
{{- end -}}
{{- end -}}

{{- define "racer.traceMount" -}}
{{- if .Values.trace.dataVolume -}}
- name: trace-data
  mountPath: {{ .Values.trace.dataDir }}
  readOnly: true
{{- end -}}
{{- end -}}

{{- define "racer.traceVolume" -}}
{{- if .Values.trace.dataVolume -}}
- name: trace-data
  {{- toYaml .Values.trace.dataVolume | nindent 2 }}
{{- end -}}
{{- end -}}

{{/* a value as an environment variable's text: integers without an exponent (Helm reads numbers
as float64, which print 1e+06 otherwise) */}}
{{- define "racer.envValue" -}}
{{- if kindIs "bool" . -}}
{{- ternary "true" "false" . -}}
{{- else if or (kindIs "float64" .) (kindIs "int" .) (kindIs "int64" .) -}}
{{- if eq (float64 .) (floor .) -}}{{ int64 . }}{{- else -}}{{ . }}{{- end -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/*
Cross-field rules that values.schema.json cannot say; `fail` stops the render with the reason.
*/}}
{{- define "racer.validate" -}}
{{- $cp := .Values.controlPlane -}}
{{- if and (eq $cp.database.type "sqlite") (gt (int $cp.replicas) 1) -}}
{{- fail (printf "controlPlane.replicas is %d with controlPlane.database.type sqlite: SQLite is one file on one volume, so it takes one replica; use PostgreSQL (controlPlane.database.type: postgresql) for more" (int $cp.replicas)) -}}
{{- end -}}
{{- if and (eq $cp.database.type "sqlite") $cp.jobsProcess.enabled -}}
{{- fail "controlPlane.jobsProcess.enabled with controlPlane.database.type sqlite: the jobs' pod would need the API pod's SQLite file; use PostgreSQL (controlPlane.database.type: postgresql)" -}}
{{- end -}}
{{- $as := .Values.gateway.autoscaling -}}
{{- if and $as.enabled (lt (int $as.maxReplicas) (int $as.minReplicas)) -}}
{{- fail (printf "gateway.autoscaling.maxReplicas (%d) is below gateway.autoscaling.minReplicas (%d)" (int $as.maxReplicas) (int $as.minReplicas)) -}}
{{- end -}}
{{- if and $as.enabled (not (dig "requests" "cpu" "" (.Values.gateway.resources | default dict))) -}}
{{- fail "gateway.autoscaling.enabled needs gateway.resources.requests.cpu: the HorizontalPodAutoscaler scales on CPU use as a share of it" -}}
{{- end -}}
{{- if .Values.metrics.prometheusRule.enabled -}}
{{- $obj := dig "slo_objective" 0.99 ($cp.settings | default dict) -}}
{{- if ne (float64 $obj) 0.99 -}}
{{- fail (printf "controlPlane.settings.slo_objective is %v but the shipped alert rules (metrics.prometheusRule) assume 0.99: change both together" $obj) -}}
{{- end -}}
{{- end -}}
{{- end -}}
