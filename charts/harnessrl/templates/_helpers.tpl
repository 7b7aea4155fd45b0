{{- define "harnessrl.fullname" -}}
{{- printf "%s-harnessrl" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- define "harnessrl.labels" -}}
app.kubernetes.io/name: harnessrl
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "harnessrl.selector" -}}
app.kubernetes.io/name: harnessrl
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "harnessrl.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- end -}}

{{- define "harnessrl.natsUrl" -}}
{{- if .Values.nats.deploy -}}
{{ printf "nats://%s-nats:4222" (include "harnessrl.fullname" .) }}
{{- else -}}
{{ required "nats.url is required when nats.deploy=false" .Values.nats.url }}
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

{{- define "harnessrl.keySecretName" -}}
{{- default (printf "%s-episode-key" (include "harnessrl.fullname" .)) .Values.keySecret.existingSecret -}}
{{- end -}}

{{- define "harnessrl.gatewayUrl" -}}
{{ printf "http://%s-gateway.%s.svc:%v" (include "harnessrl.fullname" .) .Release.Namespace .Values.gateway.port }}
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

{{/* A service container: `python -m harnessrl.<component>` with NATS and settings env. */}}
{{- define "harnessrl.serviceContainer" -}}
- name: {{ .component }}
  image: {{ include "harnessrl.image" .root }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  command: ["python", "-m", "harnessrl.{{ .component }}"]
  env:
    - name: HRL_{{ upper .component }}_NATS_URL
      value: {{ include "harnessrl.natsUrl" .root | quote }}
    {{- $streamReplicas := include "harnessrl.natsStreamReplicas" .root | int }}
    {{- if gt $streamReplicas 1 }}
    - name: HRL_NATS_REPLICAS
      value: {{ $streamReplicas | quote }}
    {{- end }}
    {{- range $name, $value := .values.env }}
    - name: {{ $name }}
      value: {{ $value | quote }}
    {{- end }}
    {{- with .extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  resources:
    {{- toYaml .values.resources | nindent 4 }}
  securityContext:
    {{- include "harnessrl.containerSecurity" . | nindent 4 }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    {{- with .mounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}
