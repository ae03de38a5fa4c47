{{/* Pod building blocks shared by router, encoder and worker. ------------------------------ */}}

{{/* Environment: (dict "root" $ "comp" .Values.worker "port" 50071 "advertise" "..." "extra" dict) */}}
{{- define "epd.env" -}}
{{- $root := .root }}
{{- $gpu := gt (int (default 0 .comp.gpus)) 0 }}
{{- $vars := dict
  "EPD_MODEL" (include "epd.modelPath" $root)
  "EPD_REDIS_URL" (include "epd.redisUrl" $root)
  "EPD_HOST" "0.0.0.0"
  "EPD_PORT" (toString .port)
  "EPD_METRICS_PORT" (ternary (toString $root.Values.metrics.port) "0" $root.Values.metrics.enabled)
  "EPD_ADVERTISE_ADDR" .advertise
  "EPD_DEVICE" (ternary "cuda" "cpu" $gpu)
  "EPD_DTYPE" (default (ternary "bfloat16" "float32" $gpu) $root.Values.dtype)
  "EPD_LOG_LEVEL" $root.Values.logLevel
  "EPD_DRAIN_TIMEOUT_S" (toString .comp.drainTimeoutSeconds)
  "HOME" "/tmp"
  "HF_HUB_OFFLINE" "1"
}}
{{- /* A pod without GPUs sees none, whatever the image says (the CUDA image's default is void too);
       GPU pods get NVIDIA_VISIBLE_DEVICES from the device plugin, so the chart never sets it there. */}}
{{- if not $gpu }}
{{- $_ := set $vars "NVIDIA_VISIBLE_DEVICES" "void" }}
{{- end }}
{{- range $src := list (default (dict) $root.Values.env) (default (dict) .comp.env) }}
{{- if hasKey $src "EPD_REDIS_URL" }}
{{- fail "env: EPD_REDIS_URL must be the same for every epd pod (the router finds workers and encoders in the Redis registry); set redis.external.url instead" }}
{{- end }}
{{- end }}
{{- $security := include "epd.securityVars" (dict "root" $root "name" .name) | fromYaml }}
{{- $vars = mergeOverwrite $vars $security (default (dict) .extra) (default (dict) $root.Values.env) (default (dict) .comp.env) -}}
{{- if $root.Values.redis.external.existingSecret }}
{{- $_ := unset $vars "EPD_REDIS_URL" }}
{{- end }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- with include "epd.secretEnv" $root }}
{{ . }}
{{- end }}
{{- range $name := keys $vars | sortAlpha }}
- name: {{ $name }}
  value: {{ get $vars $name | toString | quote }}
{{- end }}
{{- end }}

{{/* Resources with the GPU request: (dict "comp" .Values.encoder) */}}
{{- define "epd.resources" -}}
{{- $res := deepCopy (default (dict) .comp.resources) }}
{{- $gpus := int (default 0 .comp.gpus) }}
{{- if gt $gpus 0 }}
{{- $limits := default (dict) $res.limits }}
{{- $_ := set $limits "nvidia.com/gpu" $gpus }}
{{- $_ = set $res "limits" $limits }}
{{- $requests := default (dict) $res.requests }}
{{- $_ = set $requests "nvidia.com/gpu" $gpus }}
{{- $_ = set $res "requests" $requests }}
{{- end -}}
resources:
  {{- toYaml $res | nindent 2 }}
{{- end }}

{{/* Probes: (dict "root" $ "name" "worker" "port" 50071 "startup" .Values.worker.startupProbe). Every probe asks
     the service's gRPC health: the kubelet's gRPC probe on the service port; with TLS on (that probe has no TLS,
     and a router's public pair or client CA may not be the cluster's) services/launch/health.py (no torch
     import: quick) against the service's plaintext health listener on 127.0.0.1 (EPD_HEALTH_PORT), which the
     same health servicer answers. */}}
{{- define "epd.probeAction" -}}
{{- if not .root.Values.tls.enabled -}}
grpc:
  port: {{ .port }}
{{- else -}}
exec:
  command: ["python", "-m", "services.launch.health", "--plaintext", "127.0.0.1:{{ .root.Values.ports.health }}"]
{{- end }}
{{- end }}

{{- define "epd.probes" -}}
startupProbe:
  {{- include "epd.probeAction" . | nindent 2 }}
  periodSeconds: {{ .startup.periodSeconds }}
  failureThreshold: {{ .startup.failureThreshold }}
readinessProbe:
  {{- include "epd.probeAction" . | nindent 2 }}
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: 3
livenessProbe:
  {{- include "epd.probeAction" . | nindent 2 }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end }}

{{/* Graceful shutdown: (dict "comp" .Values.worker "name" "worker"). preStop sleeps while endpoints drop the
     pod; then SIGTERM starts the service's drain (EPD_DRAIN_TIMEOUT_S); the grace period must cover both. */}}
{{- define "epd.lifecycle" -}}
{{- $drain := int .comp.drainTimeoutSeconds }}
{{- $sleep := int .comp.preStopSleepSeconds }}
{{- $grace := int .comp.terminationGracePeriodSeconds }}
{{- if le $grace (add $drain $sleep) }}
{{- fail (printf "%s: terminationGracePeriodSeconds (%d) must exceed drainTimeoutSeconds + preStopSleepSeconds (%d + %d), or the drain is cut short" .name $grace $drain $sleep) }}
{{- end -}}
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ $sleep }}"]
{{- end }}

{{/* Pod-level settings: (dict "root" $ "comp" .Values.router) */}}
{{- define "epd.podSpecCommon" -}}
serviceAccountName: {{ include "epd.serviceAccountName" .root }}
automountServiceAccountToken: false
enableServiceLinks: false
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .comp.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .comp.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .comp.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Init container that builds the tiny model: (dict "root" $ "comp" .Values.worker) */}}
{{- define "epd.initContainers" -}}
{{- $root := .root }}
{{- if $root.Values.model.tiny.enabled -}}
initContainers:
  - name: model-init
    {{- include "epd.image" . | nindent 4 }}
    args:
      - make-tiny-model
      - {{ include "epd.modelPath" $root | quote }}
      - --family
      - {{ $root.Values.model.tiny.family | quote }}
    env:
      - name: HOME
        value: /tmp
      - name: HF_HUB_OFFLINE
        value: "1"
      - name: NVIDIA_VISIBLE_DEVICES
        value: void
    securityContext:
      {{- toYaml $root.Values.securityContext | nindent 6 }}
    resources:
      {{- toYaml $root.Values.model.tiny.resources | nindent 6 }}
    volumeMounts:
      - name: tmp
        mountPath: /tmp
      - name: model
        mountPath: {{ $root.Values.model.mountPath }}
{{- end }}
{{- end }}

{{/* Volumes: (dict "root" $ "comp" .Values.worker) */}}
{{- define "epd.volumes" -}}
{{- $model := .root.Values.model -}}
volumes:
  - name: tmp
    emptyDir:
      sizeLimit: {{ .root.Values.tmpSizeLimit }}
  - name: model
    {{- if $model.tiny.enabled }}
    emptyDir:
      sizeLimit: {{ $model.tiny.sizeLimit }}
    {{- else }}
    persistentVolumeClaim:
      claimName: {{ $model.pvc.claimName }}
      readOnly: true
    {{- end }}
  {{- if .comp.shmSizeLimit }}
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ .comp.shmSizeLimit }}
  {{- end }}
  {{- with include "epd.secretVolumes" (dict "root" .root "name" .name) }}
  {{- . | nindent 2 }}
  {{- end }}
{{- end }}

{{/* Mounts of the main container: (dict "root" $ "comp" .Values.worker) */}}
{{- define "epd.volumeMounts" -}}
{{- $model := .root.Values.model -}}
volumeMounts:
  - name: tmp
    mountPath: /tmp
  - name: model
    mountPath: {{ $model.mountPath }}
    readOnly: true
    {{- if and (not $model.tiny.enabled) $model.pvc.subPath }}
    subPath: {{ $model.pvc.subPath }}
    {{- end }}
  {{- if .comp.shmSizeLimit }}
  - name: dshm
    mountPath: /dev/shm
  {{- end }}
  {{- with include "epd.secretVolumeMounts" (dict "root" .root "name" .name) }}
  {{- . | nindent 2 }}
  {{- end }}
{{- end }}

{{/* The main container's ports: (dict "root" $ "name" "grpc" "port" 50071 "http" false) */}}
{{- define "epd.containerPorts" -}}
ports:
  - name: grpc
    containerPort: {{ .port }}
    protocol: TCP
  {{- if .http }}
  - name: http
    containerPort: {{ .root.Values.ports.http }}
    protocol: TCP
  {{- end }}
  {{- if .root.Values.metrics.enabled }}
  - name: metrics
    containerPort: {{ .root.Values.metrics.port }}
    protocol: TCP
  {{- end }}
{{- end }}
