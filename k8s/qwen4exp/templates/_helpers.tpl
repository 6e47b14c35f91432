{{- define "qwen4exp.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "qwen4exp.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "qwen4exp.selectorLabels" -}}
app.kubernetes.io/name: {{ include "qwen4exp.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "qwen4exp.labels" -}}
{{ include "qwen4exp.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "qwen4exp.apiKeysSecret" -}}
{{- .Values.apiKeys.existingSecret | default (printf "%s-api-keys" (include "qwen4exp.fullname" .)) -}}
{{- end -}}

{{- define "qwen4exp.sidecarConfigMap" -}}
{{- .Values.sidecar.existingConfigMap | default (printf "%s-sidecar" (include "qwen4exp.fullname" .)) -}}
{{- end -}}

{{/*
A Prometheus Operator object is rendered when its enabled value is true, or "auto" and the cluster
serves its API (helm install asks the cluster; helm template needs --api-versions, given either as
the kind, monitoring.coreos.com/v1/ServiceMonitor, or as the group-version alone,
monitoring.coreos.com/v1, the form most CI tools pass). Without the CRDs an unconditional
ServiceMonitor makes the whole install fail.
Arguments: (list enabled "monitoring.coreos.com/v1/Kind" .Capabilities). Returns "true" or "".
*/}}
{{- define "qwen4exp.wanted" -}}
{{- $enabled := toString (index . 0) -}}
{{- if eq $enabled "auto" -}}
{{- $kind := index . 1 -}}
{{- $groupVersion := regexReplaceAll "/[^/]+$" $kind "" -}}
{{- if or ((index . 2).APIVersions.Has $kind) ((index . 2).APIVersions.Has $groupVersion) -}}true{{- end -}}
{{- else if eq $enabled "true" -}}true
{{- end -}}
{{- end -}}

{{- define "qwen4exp.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end -}}
{{- end -}}

{{/* Values that must be set, checked once (Deployment template). */}}
{{- define "qwen4exp.validate" -}}
{{- if not .Values.model.hostPath -}}
{{- $_ := required "model.existingClaim is required: the PVC that holds the checkpoint (or set model.persistence.create=true, or model.hostPath)" (include "qwen4exp.modelClaim" .) -}}
{{- end -}}
{{- if not .Values.apiKeys.existingSecret -}}
{{- $_ := required "apiKeys.existingSecret or apiKeys.keys is required: the service refuses to run without API keys" (first .Values.apiKeys.keys) -}}
{{- end -}}
{{- if and .Values.sidecar.enabled (eq (toString .Values.sidecar.source) "configMap") (not .Values.sidecar.existingConfigMap) (not .Values.sidecar.kvScales) -}}
{{- fail "sidecar.kvScales (or sidecar.existingConfigMap) is required while sidecar.enabled: the FP8 QSA KV cache needs per-layer scales (python -m model.qsa_kv.merge), or sidecar.source=modelVolume to read the qsa-kv-scales.json prepare.calibrate writes next to the checkpoint; or set sidecar.enabled=false and engine.kvCacheDtype=auto" -}}
{{- end -}}
{{- if and (eq (toString .Values.engine.kvCacheDtype) "fp8") (not .Values.sidecar.enabled) -}}
{{- fail "engine.kvCacheDtype=fp8 needs the KV scales sidecar (sidecar.enabled=true)" -}}
{{- end -}}
{{- if ne (int .Values.resources.gpus) (int .Values.engine.tensorParallelSize) -}}
{{- fail (printf "resources.gpus (%v) must equal engine.tensorParallelSize (%v): one GPU per tensor-parallel rank" .Values.resources.gpus .Values.engine.tensorParallelSize) -}}
{{- end -}}
{{- $minGrace := add .Values.preStopSleepSeconds .Values.engine.drainSeconds -}}
{{- if le (int .Values.terminationGracePeriodSeconds) (int $minGrace) -}}
{{- fail (printf "terminationGracePeriodSeconds (%v) must exceed preStopSleepSeconds + engine.drainSeconds (%v)" .Values.terminationGracePeriodSeconds $minGrace) -}}
{{- end -}}
{{- include "qwen4exp.prepare.validate" . -}}
{{- end -}}
