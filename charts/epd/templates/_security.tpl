{{/* Security and tenancy (docs/security.md): TLS files, API keys, tenant limits, the cache HMAC key and the
     Redis password, every one from a Secret mounted as a file or referenced by secretKeyRef. No secret value
     is ever rendered into a manifest. ----------------------------------------------------------------- */}}

{{/* The Secret holding the cluster pair and CA (tls.crt, tls.key, ca.crt). */}}
{{- define "epd.tlsSecret" -}}
{{- $tls := .Values.tls }}
{{- if $tls.certManager.enabled }}
{{- printf "%s-tls" (include "epd.fullname" .) }}
{{- else if $tls.existingSecret }}
{{- $tls.existingSecret }}
{{- else }}
{{- fail "tls.enabled: set tls.existingSecret (tls.crt, tls.key, ca.crt) or tls.certManager.enabled=true" }}
{{- end }}
{{- end }}

{{/* EPD_* file settings: (dict "root" $ "name" "router") -> a YAML map merged into epd.env. */}}
{{- define "epd.securityVars" -}}
{{- $v := .root.Values }}
{{- $vars := dict }}
{{- if $v.tls.enabled }}
{{- $_ := set $vars "EPD_TLS_CERT_FILE" "/etc/epd/tls/tls.crt" }}
{{- $_ = set $vars "EPD_TLS_KEY_FILE" "/etc/epd/tls/tls.key" }}
{{- $_ = set $vars "EPD_TLS_CA_FILE" "/etc/epd/tls/ca.crt" }}
{{- $_ = set $vars "EPD_TLS_SERVER_NAME" $v.tls.serverName }}
{{- $_ = set $vars "EPD_HEALTH_PORT" (toString $v.ports.health) }}
{{- end }}
{{- if $v.cacheHmac.existingSecret }}
{{- $_ := set $vars "EPD_CACHE_HMAC_KEY_FILE" "/etc/epd/cache-hmac/key" }}
{{- end }}
{{- if eq .name "router" }}
{{- if $v.tls.public.existingSecret }}
{{- $_ := set $vars "EPD_PUBLIC_TLS_CERT_FILE" "/etc/epd/public-tls/tls.crt" }}
{{- $_ = set $vars "EPD_PUBLIC_TLS_KEY_FILE" "/etc/epd/public-tls/tls.key" }}
{{- end }}
{{- if $v.tls.public.clientCaSecret }}
{{- $_ := set $vars "EPD_PUBLIC_TLS_CLIENT_CA_FILE" "/etc/epd/public-client-ca/ca.crt" }}
{{- end }}
{{- if $v.auth.existingSecret }}
{{- $_ := set $vars "EPD_API_KEYS_FILE" "/etc/epd/api-keys/api-keys" }}
{{- end }}
{{- if $v.tenantLimits.existingSecret }}
{{- $_ := set $vars "EPD_TENANT_LIMITS_FILE" "/etc/epd/tenant-limits/tenant-limits" }}
{{- end }}
{{- $_ := set $vars "EPD_SHARE_EMBEDDINGS_ACROSS_TENANTS" (toString $v.shareEmbeddingsAcrossTenants) }}
{{- end }}
{{- toYaml $vars }}
{{- end }}

{{/* Variables from secretKeyRef, listed before the plain ones so EPD_REDIS_URL can use $(REDIS_PASSWORD). */}}
{{- define "epd.secretEnv" -}}
{{- $redis := .Values.redis }}
{{- if $redis.auth.existingSecret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $redis.auth.existingSecret }}
      key: {{ $redis.auth.passwordKey }}
{{- end }}
{{- if $redis.external.existingSecret }}
- name: EPD_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $redis.external.existingSecret }}
      key: {{ $redis.external.urlKey }}
{{- end }}
{{- end }}

{{/* (name, secret, key, file) of each Secret mounted on a pod: (dict "root" $ "name" "router") */}}
{{- define "epd.secretMounts" -}}
{{- $v := .root.Values }}
{{- $mounts := list }}
{{- if $v.tls.enabled }}
{{- $mounts = append $mounts (dict "name" "tls" "secret" (include "epd.tlsSecret" .root) "items" (list "tls.crt" "tls.key" "ca.crt")) }}
{{- end }}
{{- if $v.cacheHmac.existingSecret }}
{{- $mounts = append $mounts (dict "name" "cache-hmac" "secret" $v.cacheHmac.existingSecret "map" (dict $v.cacheHmac.key "key")) }}
{{- end }}
{{- if eq .name "router" }}
{{- if $v.tls.public.existingSecret }}
{{- $mounts = append $mounts (dict "name" "public-tls" "secret" $v.tls.public.existingSecret "items" (list "tls.crt" "tls.key")) }}
{{- end }}
{{- if $v.tls.public.clientCaSecret }}
{{- $mounts = append $mounts (dict "name" "public-client-ca" "secret" $v.tls.public.clientCaSecret "items" (list "ca.crt")) }}
{{- end }}
{{- if $v.auth.existingSecret }}
{{- $mounts = append $mounts (dict "name" "api-keys" "secret" $v.auth.existingSecret "map" (dict $v.auth.key "api-keys")) }}
{{- end }}
{{- if $v.tenantLimits.existingSecret }}
{{- $mounts = append $mounts (dict "name" "tenant-limits" "secret" $v.tenantLimits.existingSecret "map" (dict $v.tenantLimits.key "tenant-limits")) }}
{{- end }}
{{- end }}
{{- toYaml (dict "mounts" $mounts) }}
{{- end }}

{{/* Secret volumes: (dict "root" $ "name" "router") */}}
{{- define "epd.secretVolumes" -}}
{{- range (include "epd.secretMounts" . | fromYaml).mounts }}
- name: {{ .name }}
  secret:
    secretName: {{ .secret }}
    defaultMode: 0440
    items:
      {{- range $key := default (list) .items }}
      - key: {{ $key }}
        path: {{ $key }}
      {{- end }}
      {{- range $key, $path := default (dict) .map }}
      - key: {{ $key }}
        path: {{ $path }}
      {{- end }}
{{- end }}
{{- end }}

{{/* Their mounts: (dict "root" $ "name" "router") */}}
{{- define "epd.secretVolumeMounts" -}}
{{- range (include "epd.secretMounts" . | fromYaml).mounts }}
- name: {{ .name }}
  mountPath: /etc/epd/{{ .name }}
  readOnly: true
{{- end }}
{{- end }}
