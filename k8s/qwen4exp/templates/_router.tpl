{{/* Scale-out helpers: the router's names and labels, the replicas' spreading. */}}

{{- define "qwen4exp.router.fullname" -}}
{{- printf "%s-router" (include "qwen4exp.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The router's pods must not carry the replicas' selector labels (name + instance): the replicas'
Service, PDB, NetworkPolicy and the router's own discovery select on those.
*/}}
{{- define "qwen4exp.router.selectorLabels" -}}
app.kubernetes.io/name: {{ include "qwen4exp.name" . }}-router
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end -}}

{{- define "qwen4exp.router.labels" -}}
{{ include "qwen4exp.router.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/version: {{ .Values.router.version | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The router image: router.image.*, or the service image (which carries the wheel). */}}
{{- define "qwen4exp.router.image" -}}
{{- $img := .Values.router.image -}}
{{- if $img.repository -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository (required "router.image.tag is required with router.image.repository" $img.tag) -}}
{{- end -}}
{{- else -}}
{{- include "qwen4exp.image" . -}}
{{- end -}}
{{- end -}}

{{/*
The replicas' affinity: .Values.affinity plus the podAntiAffinity rule that spreads replicas over
nodes (podAntiAffinity.mode). Both may not set podAntiAffinity.
*/}}
{{- define "qwen4exp.affinity" -}}
{{- $affinity := deepCopy (.Values.affinity | default dict) -}}
{{- $mode := .Values.podAntiAffinity.mode -}}
{{- if ne $mode "none" -}}
{{- if hasKey $affinity "podAntiAffinity" -}}
{{- fail "affinity.podAntiAffinity and podAntiAffinity.mode both spread the replicas: set podAntiAffinity.mode=none to use your own rule" -}}
{{- end -}}
{{- $term := dict "topologyKey" .Values.podAntiAffinity.topologyKey "labelSelector" (dict "matchLabels" (include "qwen4exp.selectorLabels" . | fromYaml)) -}}
{{- if eq $mode "required" -}}
{{- $_ := set $affinity "podAntiAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (list $term)) -}}
{{- else -}}
{{- $_ := set $affinity "podAntiAffinity" (dict "preferredDuringSchedulingIgnoredDuringExecution" (list (dict "weight" 100 "podAffinityTerm" $term))) -}}
{{- end -}}
{{- end -}}
{{- if $affinity -}}
{{- toYaml $affinity -}}
{{- end -}}
{{- end -}}
