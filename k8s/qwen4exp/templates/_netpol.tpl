{{/* Egress to the cluster DNS only (networkPolicy.dnsTo), UDP and TCP 53. */}}
{{- define "qwen4exp.netpol.dnsEgress" -}}
- to:
    {{- toYaml .Values.networkPolicy.dnsTo | nindent 4 }}
  ports:
    - port: 53
      protocol: UDP
    - port: 53
      protocol: TCP
{{- end -}}
