{{/* Arguments of `iwg-operator` (iwg_operator.main): the namespaces it handles, probes, logs, metrics. */}}
{{- define "iwg-operator.args" -}}
- --standalone
- --leader-elect
- --leader-elect-lease-name={{ include "iwg-operator.fullname" . }}
{{- if .Values.watchNamespaces }}
{{- range .Values.watchNamespaces }}
- --namespace={{ . }}
{{- end }}
{{- else }}
- --all-namespaces
{{- end }}
- --liveness=http://0.0.0.0:{{ .Values.healthPort }}/healthz
- --log-level={{ .Values.logLevel }}
{{- if .Values.metrics.enabled }}
- --metrics-port={{ .Values.metrics.port }}
{{- end }}
{{- end -}}
