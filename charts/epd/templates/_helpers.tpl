{{/* Names ------------------------------------------------------------------------------- */}}

{{- define "epd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "epd.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "epd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "epd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "epd.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Labels: call with (dict "root" $ "component" "router") ---------------------------------- */}}

{{- define "epd.releaseSelector" -}}
app.kubernetes.io/name: {{ include "epd.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end }}

{{- define "epd.selectorLabels" -}}
{{ include "epd.releaseSelector" . }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "epd.labels" -}}
helm.sh/chart: {{ include "epd.chart" .root }}
{{ include "epd.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: epd
{{- end }}

{{/* Addresses ----------------------------------------------------------------------------- */}}

{{- define "epd.redisUrl" -}}
{{- if regexMatch "^rediss?://[^/@]*:[^/@]*@" .Values.redis.external.url }}
{{- fail "redis.external.url must not hold a password: put it in a Secret (redis.auth.existingSecret, or the whole URL in redis.external.existingSecret)" }}
{{- end }}
{{- $url := "" }}
{{- if .Values.redis.external.url }}
{{- $url = .Values.redis.external.url }}
{{- else if .Values.redis.external.existingSecret }}
{{- $url = "" }}
{{- else if .Values.redis.enabled }}
{{- $url = printf "redis://%s-redis:6379/0" (include "epd.fullname" .) }}
{{- else }}
{{- fail "redis: set redis.enabled=true (bundled), redis.external.url or redis.external.existingSecret" }}
{{- end }}
{{- if and $url .Values.redis.auth.existingSecret }}
{{- /* The password stays in its Secret: Kubernetes expands $(REDIS_PASSWORD) in the pod. */}}
{{- $scheme := ternary "rediss://" "redis://" (hasPrefix "rediss://" $url) }}
{{- $url = printf "%s:$(REDIS_PASSWORD)@%s" $scheme (trimPrefix $scheme $url) }}
{{- end }}
{{- $url }}
{{- end }}

{{- define "epd.bundledRedis" -}}
{{- if and .Values.redis.enabled (not .Values.redis.external.url) (not .Values.redis.external.existingSecret) }}true{{ end }}
{{- end }}

{{- define "epd.workerHost" -}}
{{- printf "%s-worker.%s.svc.%s" (include "epd.fullname" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{- define "epd.prefillHost" -}}
{{- printf "%s-prefill.%s.svc.%s" (include "epd.fullname" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{/* The addresses workers register under in Redis (for NOTES.txt; the router reads the registry). */}}
{{- define "epd.workerAddrs" -}}
{{- $root := . }}
{{- $addrs := list }}
{{- if .Values.worker.enabled }}
{{- range $i := until (int .Values.worker.replicas) }}
{{- $addrs = append $addrs (printf "%s-worker-%d.%s:%d" (include "epd.fullname" $root) $i (include "epd.workerHost" $root) (int $root.Values.ports.worker)) }}
{{- end }}
{{- end }}
{{- join "," $addrs }}
{{- end }}

{{- define "epd.encoderAddrs" -}}
{{- printf "%s-encoder.%s.svc.%s:%d" (include "epd.fullname" .) .Release.Namespace .Values.clusterDomain (int .Values.ports.encoder) }}
{{- end }}

{{/* Model --------------------------------------------------------------------------------- */}}

{{- define "epd.modelPath" -}}
{{- if and .Values.model.tiny.enabled .Values.model.pvc.claimName }}
{{- fail "model: set model.pvc.claimName or model.tiny.enabled, not both" }}
{{- else if .Values.model.tiny.enabled }}
{{- printf "%s/tiny" .Values.model.mountPath }}
{{- else if .Values.model.pvc.claimName }}
{{- .Values.model.mountPath }}
{{- else }}
{{- fail "model: set model.pvc.claimName (a PVC holding the model folder) or model.tiny.enabled=true" }}
{{- end }}
{{- end }}

{{/* Image: call with (dict "root" $ "comp" .Values.encoder) ------------------------------- */}}

{{- define "epd.image" -}}
{{- $repo := default .root.Values.image.repository .comp.image.repository }}
{{- $variant := ternary "cuda" "cpu" (gt (int (default 0 .comp.gpus)) 0) }}
{{- $tag := default (default (printf "%s-%s" .root.Chart.AppVersion $variant) .root.Values.image.tag) .comp.image.tag -}}
image: {{ printf "%s:%s" $repo $tag | quote }}
imagePullPolicy: {{ default .root.Values.image.pullPolicy .comp.image.pullPolicy }}
{{- end }}

{{/* NetworkPolicy: ingress from this release's pods plus metrics scrapes: (dict "root" $ "ports" list) */}}
{{- define "epd.releaseIngress" -}}
- from:
    - podSelector:
        matchLabels:
          {{- include "epd.releaseSelector" . | nindent 10 }}
  {{- with .ports }}
  ports:
    {{- range . }}
    - port: {{ . }}
      protocol: TCP
    {{- end }}
  {{- end }}
{{- if .root.Values.metrics.enabled }}
- from:
    {{- toYaml .root.Values.networkPolicy.metricsFrom | nindent 4 }}
  ports:
    - port: {{ .root.Values.metrics.port }}
      protocol: TCP
{{- end }}
{{- end }}
