{{/*
Producing the model in the cluster (prepare.*): the chart-managed claims, the prepare Job's steps
and the checks that keep the Job and the replicas from working on the same volume or GPUs.
*/}}

{{/* The model claim the replicas mount: model.existingClaim, or the chart's (model.persistence.create). */}}
{{- define "qwen4exp.modelClaim" -}}
{{- if .Values.model.existingClaim -}}
{{- .Values.model.existingClaim -}}
{{- else if .Values.model.persistence.create -}}
{{- printf "%s-model" (include "qwen4exp.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The source (bf16) claim download writes and convert reads. */}}
{{- define "qwen4exp.sourceClaim" -}}
{{- if .Values.prepare.source.existingClaim -}}
{{- .Values.prepare.source.existingClaim -}}
{{- else if .Values.prepare.source.persistence.create -}}
{{- printf "%s-source" (include "qwen4exp.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The model volume: (list . readOnly). The replicas mount it read-only, the prepare Job writes it. */}}
{{- define "qwen4exp.modelVolume" -}}
{{- $ctx := index . 0 -}}
{{- with include "qwen4exp.modelClaim" $ctx -}}
persistentVolumeClaim:
  claimName: {{ . }}
  {{- if index $ 1 }}
  readOnly: true
  {{- end }}
{{- else -}}
hostPath:
  path: {{ $ctx.Values.model.hostPath }}
  type: Directory
{{- end -}}
{{- end -}}

{{/* Where the replicas read the static FP8 K/V scales (VLLM_QSA_KV_SCALES). */}}
{{- define "qwen4exp.kvScalesPath" -}}
{{- if eq (toString .Values.sidecar.source) "modelVolume" -}}
/models/qwen4-exp/qsa-kv-scales.json
{{- else -}}
/sidecar/qsa-kv-scales.json
{{- end -}}
{{- end -}}

{{/* The enabled prepare steps, in the order they run, space-separated ("" = no Job). */}}
{{- define "qwen4exp.prepare.steps" -}}
{{- $steps := list -}}
{{- range $step := list "download" "convert" "calibrate" -}}
{{- if (index $.Values.prepare $step).enabled -}}
{{- $steps = append $steps $step -}}
{{- end -}}
{{- end -}}
{{- join " " $steps -}}
{{- end -}}

{{- define "qwen4exp.prepare.fullname" -}}
{{- printf "%s-prepare" (include "qwen4exp.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The prepare pod must not carry the replicas' selector labels (name + instance): their Service would
send it traffic, their PDB and NetworkPolicy (egress DNS only: no download) would select it.
*/}}
{{- define "qwen4exp.prepare.selectorLabels" -}}
app.kubernetes.io/name: {{ include "qwen4exp.name" . }}-prepare
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: prepare
{{- end -}}

{{- define "qwen4exp.prepare.labels" -}}
{{ include "qwen4exp.prepare.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The Deployment's container hardening, for every prepare container. */}}
{{- define "qwen4exp.prepare.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
{{- end -}}

{{/* Replicas on several nodes: more than one, the router in front, or the HPA deciding. */}}
{{- define "qwen4exp.multiReplica" -}}
{{- if or (gt (int .Values.replicaCount) 1) .Values.router.enabled .Values.autoscaling.enabled -}}true{{- end -}}
{{- end -}}

{{/* Checks of the prepare and persistence values (called from qwen4exp.validate). */}}
{{- define "qwen4exp.prepare.validate" -}}
{{- $p := .Values.prepare -}}
{{- $mp := .Values.model.persistence -}}
{{- if and .Values.model.existingClaim $mp.create -}}
{{- fail "model.existingClaim and model.persistence.create=true both name the model volume: set one" -}}
{{- end -}}
{{- if and $p.source.existingClaim $p.source.persistence.create -}}
{{- fail "prepare.source.existingClaim and prepare.source.persistence.create=true both name the source volume: set one" -}}
{{- end -}}
{{- if and $mp.create (include "qwen4exp.multiReplica" .) -}}
{{- if not (or (has "ReadWriteMany" $mp.accessModes) (has "ReadOnlyMany" $mp.accessModes)) -}}
{{- fail (printf "model.persistence.accessModes is %v, but replicaCount=%v / router.enabled=%v / autoscaling.enabled=%v run replicas on several nodes, and a ReadWriteOnce volume attaches to one node: set model.persistence.accessModes={ReadWriteMany} with a storage class that offers it (model.persistence.storageClassName: NFS, CephFS, ...), or model.existingClaim to a ReadOnlyMany/ReadWriteMany volume" $mp.accessModes .Values.replicaCount .Values.router.enabled .Values.autoscaling.enabled) -}}
{{- end -}}
{{- end -}}
{{- $writesModel := or $p.convert.enabled $p.calibrate.enabled -}}
{{- if and $writesModel $mp.create (not (or (has "ReadWriteOnce" $mp.accessModes) (has "ReadWriteMany" $mp.accessModes) (has "ReadWriteOncePod" $mp.accessModes))) -}}
{{- fail (printf "model.persistence.accessModes is %v: prepare.convert and prepare.calibrate write the model volume, which needs ReadWriteMany (several replicas) or ReadWriteOnce" $mp.accessModes) -}}
{{- end -}}
{{- if and $writesModel (or (gt (int .Values.replicaCount) 0) .Values.autoscaling.enabled) -}}
{{- fail (printf "prepare.convert / prepare.calibrate write the model volume the replicas read (and calibrate takes their GPUs): render them with replicaCount=0 and autoscaling.enabled=false (now %v / %v), wait for job/%s to complete, then helm upgrade with prepare.convert.enabled=false, prepare.calibrate.enabled=false and replicaCount=1 (docs/deployment.md \"Kubernetes: produce the model\")" .Values.replicaCount .Values.autoscaling.enabled (include "qwen4exp.prepare.fullname" .)) -}}
{{- end -}}
{{- if and $p.calibrate.enabled (ne (toString .Values.sidecar.source) "modelVolume") -}}
{{- fail "prepare.calibrate writes qsa-kv-scales.json into the checkpoint directory on the model volume: set sidecar.source=modelVolume (and sidecar.enabled=true) so the replicas read it there" -}}
{{- end -}}
{{- if and $p.calibrate.enabled (not .Values.sidecar.enabled) -}}
{{- fail "prepare.calibrate produces the FP8 KV scales the replicas read through the sidecar: set sidecar.enabled=true" -}}
{{- end -}}
{{- if or $p.download.enabled $p.convert.enabled -}}
{{- if not (include "qwen4exp.sourceClaim" .) -}}
{{- fail "prepare.download / prepare.convert need the source volume for the bf16 checkpoint (~225 GB): set prepare.source.existingClaim, or prepare.source.persistence.create=true" -}}
{{- end -}}
{{- end -}}
{{- end -}}
