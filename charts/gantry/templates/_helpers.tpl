{{/* Name of the release's objects: the release name, or release-chart when it lacks the chart name. */}}
{{- define "gantry.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gantry.labels" -}}
app.kubernetes.io/name: gantry
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: (dict "ctx" $ "component" "controller") */}}
{{- define "gantry.selector" -}}
app.kubernetes.io/name: gantry
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* repository[:tag][@digest]; a digest alone pins the image. (dict "image" .Values.image.operator "default" .Chart.AppVersion) */}}
{{- define "gantry.image" -}}
{{- $tag := .image.tag | default .default -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* Whether controller and gateway run in separate Deployments. */}}
{{- define "gantry.split" -}}
{{- if and .Values.controller.enabled .Values.gateway.enabled (gt (int .Values.gateway.replicas) 1) -}}true{{- end -}}
{{- end -}}

{{/* ServiceAccount of a component: one shared account unless the components are split. */}}
{{- define "gantry.serviceAccount" -}}
{{- if include "gantry.split" .ctx -}}
{{- printf "%s-%s" (include "gantry.fullname" .ctx) .component -}}
{{- else -}}
{{- printf "%s-operator" (include "gantry.fullname" .ctx) -}}
{{- end -}}
{{- end -}}

{{/* Restricted Pod Security Standard, container level. */}}
{{- define "gantry.containerSecurity" -}}
runAsNonRoot: true
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "gantry.podSecurity" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* The API-key Secret the gateway reads: the given one, else the generated one; empty with gateway.auth.mode=none. */}}
{{- define "gantry.apiKeysSecret" -}}
{{- if eq .Values.gateway.auth.mode "apiKeys" -}}
{{- .Values.gateway.apiKeysSecret | default (printf "%s-api-keys" (include "gantry.fullname" .)) -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the install token (key `token`) that node tokens are derived from. */}}
{{- define "gantry.nodeTokenSecret" -}}
{{- .Values.nodeToken.existingSecret | default (printf "%s-node-token" (include "gantry.fullname" .)) -}}
{{- end -}}
