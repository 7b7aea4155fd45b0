{{- define "harnessrl.fullname" -}}
{{- printf "%s-harnessrl" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- define "harnessrl.labels" -}}
app.kubernetes.io/name: harnessrl
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "harnessrl.selector" -}}
app.kubernetes.io/name: harnessrl
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Labels of one component's objects: the common labels and its selector. */}}
{{- define "harnessrl.componentLabels" -}}
{{ include "harnessrl.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* A service's image: its own `image` repository and tag where set (one image per service), else the shared one's. */}}
{{- define "harnessrl.serviceImage" -}}
{{- $own := default dict .values.image -}}
{{ printf "%s:%s" (default .root.Values.image.repository $own.repository) (default .root.Values.image.tag $own.tag) }}
{{- end -}}

{{/* The pull policy of a component's image (`values` its values): its own `image.pullPolicy`, else the shared image's. */}}
{{- define "harnessrl.pullPolicy" -}}
{{- $own := default dict .values.image -}}
{{ default .root.Values.image.pullPolicy $own.pullPolicy }}
{{- end -}}

{{- define "harnessrl.episodeNamespace" -}}
{{- default (printf "%s-episodes" .Release.Namespace) .Values.episodes.namespace.name -}}
{{- end -}}

{{- define "harnessrl.natsName" -}}
{{ printf "%s-nats" (include "harnessrl.fullname" .) }}
{{- end -}}

{{/* Every NATS server URL, without credentials: the bundled Service, or nats.external.urls. */}}
{{- define "harnessrl.natsServers" -}}
{{- if .Values.nats.deploy -}}
{{- $scheme := ternary "tls" "nats" .Values.nats.tls.enabled -}}
{{ printf "%s://%s.%s.svc:4222" $scheme (include "harnessrl.natsName" .) .Release.Namespace }}
{{- else -}}
{{- if not .Values.nats.external.urls -}}
{{- fail "nats.external.urls is required when nats.deploy=false (every server of the existing NATS)" -}}
{{- end -}}
{{ join "," .Values.nats.external.urls }}
{{- end -}}
{{- end -}}

{{/* A service's NATS URL list; with auth each server carries `<service>:$(HRL_NATS_PASSWORD)@`
(Kubernetes expands the variable from the Secret-backed env defined before it). */}}
{{- define "harnessrl.natsUrl" -}}
{{- $servers := splitList "," (include "harnessrl.natsServers" .root) -}}
{{- if .root.Values.nats.auth.enabled -}}
{{- $userinfo := printf "://%s:$(HRL_NATS_PASSWORD)@" .component -}}
{{- $withAuth := list -}}
{{- range $servers }}{{ $withAuth = append $withAuth (replace "://" $userinfo .) }}{{ end -}}
{{ join "," $withAuth }}
{{- else -}}
{{ join "," $servers }}
{{- end -}}
{{- end -}}

{{/* Copies of every harnessrl stream and bucket: nats.streamReplicas, else the bundled cluster's size (at most 3). */}}
{{- define "harnessrl.natsStreamReplicas" -}}
{{- $bundled := ternary (min (int .Values.nats.replicas) 3) 1 .Values.nats.deploy -}}
{{- $replicas := int (default $bundled .Values.nats.streamReplicas) -}}
{{- if and .Values.nats.deploy (gt $replicas (int .Values.nats.replicas)) -}}
{{- fail (printf "nats.streamReplicas %d needs nats.replicas of %d or more" $replicas $replicas) -}}
{{- end -}}
{{- $replicas -}}
{{- end -}}

{{- define "harnessrl.natsAuthSecretName" -}}
{{- default (printf "%s-nats-auth" (include "harnessrl.fullname" .)) .Values.nats.auth.existingSecret -}}
{{- end -}}

{{- define "harnessrl.keySecretName" -}}
{{- default (printf "%s-episode-key" (include "harnessrl.fullname" .)) .Values.keySecret.existingSecret -}}
{{- end -}}

{{- define "harnessrl.gatewayUrl" -}}
{{ printf "http://%s-gateway.%s.svc:%v" (include "harnessrl.fullname" .) .Release.Namespace .Values.gateway.port }}
{{- end -}}

{{/* Base URL of every vLLM replica (the StatefulSet's pods behind its headless Service), as a list. */}}
{{- define "harnessrl.vllmReplicaUrls" -}}
{{- $name := printf "%s-vllm" (include "harnessrl.fullname" .) -}}
{{- $urls := list -}}
{{- if .Values.vllm.enabled -}}
{{- range $i := until (int .Values.vllm.replicas) -}}
{{- $urls = append $urls (printf "http://%s-%d.%s.%s.svc:%v" $name $i $name $.Release.Namespace $.Values.vllm.port) -}}
{{- end -}}
{{- end -}}
{{ toJson $urls }}
{{- end -}}

{{/* Restricted pod and container security contexts for every harnessrl workload. */}}
{{- define "harnessrl.podSecurity" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "harnessrl.containerSecurity" -}}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Pull secrets, node selector, tolerations and affinity of a pod (`values` its component's). */}}
{{- define "harnessrl.podPlacement" -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Prometheus scrape annotations of a pod serving /metrics on `port`. */}}
{{- define "harnessrl.scrapeAnnotations" -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end -}}

{{/* `settings` (field: value) as a service's HRL_<SERVICE>_<FIELD> env: strings as they are, the rest as JSON. */}}
{{- define "harnessrl.settingsEnv" -}}
{{- $env := list -}}
{{- range $field, $value := .settings -}}
{{- $text := ternary $value (toJson $value) (kindIs "string" $value) -}}
{{- $env = append $env (dict "name" (printf "HRL_%s_%s" (upper $.component) (upper $field)) "value" $text) -}}
{{- end -}}
{{ toJson $env }}
{{- end -}}

{{/* `env` (NAME: value) and `secretEnv` (NAME: {secret, key}) of a component as env entries. */}}
{{- define "harnessrl.extraEnv" -}}
{{- $env := list -}}
{{- range $name, $value := .env -}}
{{- $env = append $env (dict "name" $name "value" (toString $value)) -}}
{{- end -}}
{{- range $name, $ref := .secretEnv -}}
{{- $env = append $env (dict "name" $name "valueFrom" (dict "secretKeyRef" (dict "name" $ref.secret "key" $ref.key))) -}}
{{- end -}}
{{ toJson $env }}
{{- end -}}

{{/* What every service container is told about NATS: its password (auth), its URL list, the
stream replicas, and the CA that signed the server's certificate (TLS). */}}
{{- define "harnessrl.natsEnv" -}}
{{- $values := .root.Values -}}
{{- $env := list -}}
{{- if $values.nats.auth.enabled -}}
{{- $env = append $env (dict "name" "HRL_NATS_PASSWORD" "valueFrom" (dict "secretKeyRef" (dict "name" (include "harnessrl.natsAuthSecretName" .root) "key" .component))) -}}
{{- end -}}
{{- $env = append $env (dict "name" (printf "HRL_%s_NATS_URL" (upper .component)) "value" (include "harnessrl.natsUrl" .)) -}}
{{- $streamReplicas := include "harnessrl.natsStreamReplicas" .root | int -}}
{{- if gt $streamReplicas 1 -}}
{{- $env = append $env (dict "name" "HRL_NATS_REPLICAS" "value" (toString $streamReplicas)) -}}
{{- end -}}
{{- if $values.nats.tls.enabled -}}
{{- $env = append $env (dict "name" "SSL_CERT_FILE" "value" "/etc/harnessrl/nats-ca/ca.crt") -}}
{{- end -}}
{{ toJson $env }}
{{- end -}}

{{/* The NATS CA volume and mount (bundled NATS with TLS), as JSON lists. */}}
{{- define "harnessrl.natsCaVolumes" -}}
{{- if .Values.nats.tls.enabled -}}
{{ toJson (list (dict "name" "nats-ca" "secret" (dict "secretName" (required "nats.tls.secretName is required with nats.tls.enabled" .Values.nats.tls.secretName) "items" (list (dict "key" "ca.crt" "path" "ca.crt"))))) }}
{{- else -}}
[]
{{- end -}}
{{- end -}}

{{- define "harnessrl.natsCaMounts" -}}
{{- if .Values.nats.tls.enabled -}}
{{ toJson (list (dict "name" "nats-ca" "mountPath" "/etc/harnessrl/nats-ca" "readOnly" true)) }}
{{- else -}}
[]
{{- end -}}
{{- end -}}

{{/* A service container: `python -m harnessrl.<component>` with NATS, its settings and extra env.
`settings` are the chart's (the component's `.settings` values win over them), `extraEnv` entries
that are not settings (secret references), `mounts` beyond /tmp and the NATS CA. */}}
{{- define "harnessrl.serviceContainer" -}}
{{- $settings := merge (deepCopy (default dict .values.settings)) (default dict .settings) -}}
{{- $env := concat (include "harnessrl.natsEnv" . | fromJsonArray) (default (list) .extraEnv) (include "harnessrl.settingsEnv" (dict "component" .component "settings" $settings) | fromJsonArray) (include "harnessrl.extraEnv" .values | fromJsonArray) -}}
{{- $mounts := concat (list (dict "name" "tmp" "mountPath" "/tmp")) (include "harnessrl.natsCaMounts" .root | fromJsonArray) (default (list) .mounts) -}}
- name: {{ .component }}
  image: {{ include "harnessrl.serviceImage" . }}
  imagePullPolicy: {{ include "harnessrl.pullPolicy" . }}
  command: ["python", "-m", "harnessrl.{{ .component }}"]
  env:
    - {name: HOME, value: /tmp}
    {{- toYaml $env | nindent 4 }}
  resources:
    {{- toYaml .values.resources | nindent 4 }}
  securityContext:
    {{- include "harnessrl.containerSecurity" . | nindent 4 }}
  volumeMounts:
    {{- toYaml $mounts | nindent 4 }}
{{- end -}}

{{/* The `/metrics` port and liveness probe of a service that serves metrics on metrics.port. */}}
{{- define "harnessrl.metricsPortAndProbe" -}}
ports:
  - {name: metrics, containerPort: {{ .Values.metrics.port }}}
livenessProbe:
  httpGet: {path: /metrics, port: metrics}
  periodSeconds: 20
  timeoutSeconds: 5
  failureThreshold: 6
{{- end -}}

{{/* The settings every service with a metrics endpoint gets: served on all interfaces for the scraper. */}}
{{- define "harnessrl.metricsSettings" -}}
{{ toJson (dict "metrics_host" "0.0.0.0" "metrics_port" (int .Values.metrics.port)) }}
{{- end -}}

{{/* A checksum of what a component is configured with: a changed value restarts its pods. */}}
{{- define "harnessrl.configChecksum" -}}
{{ toJson (list .values .root.Values.nats .root.Values.image .root.Values.metrics .root.Values.model) | sha256sum }}
{{- end -}}

{{- define "harnessrl.modelClaim" -}}
{{- default (printf "%s-models" (include "harnessrl.fullname" .)) .Values.model.storage.existingClaim -}}
{{- end -}}

{{- define "harnessrl.checkpointClaim" -}}
{{- default (printf "%s-checkpoints" (include "harnessrl.fullname" .)) .Values.trainer.checkpoints.existingClaim -}}
{{- end -}}
