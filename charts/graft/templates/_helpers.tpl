{{/* Names, labels and the few values every template derives the same way. */}}

{{- define "graft.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "graft.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "graft.operatorName" -}}
{{- printf "%s-operator" (include "graft.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "graft.engineName" -}}
{{- printf "%s-engine" (include "graft.fullname" .) | trunc 55 | trimSuffix "-" -}}
{{- end -}}

{{- define "graft.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "graft.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: graft
{{- end -}}

{{- define "graft.operatorSelectorLabels" -}}
app.kubernetes.io/name: {{ include "graft.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "graft.engineSelectorLabels" -}}
app.kubernetes.io/name: {{ include "graft.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: engine
{{- end -}}

{{- define "graft.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "graft.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The admin-token Secret, in the release's namespace: the engines mount it, the operator reads it. */}}
{{- define "graft.adminTokenSecretName" -}}
{{- default (printf "%s-admin-token" (include "graft.fullname" .)) .Values.adminToken.existingSecret -}}
{{- end -}}

{{/* The Secret with the engines' admin TLS certificate (tls.crt, tls.key, ca.crt); empty when off. */}}
{{- define "graft.adminTLSSecretName" -}}
{{- $tls := .Values.adminTLS -}}
{{- if $tls.plainHTTP -}}
{{- else if $tls.existingSecret -}}
{{- $tls.existingSecret -}}
{{- else if or $tls.certManager.enabled $tls.generate -}}
{{- printf "%s-admin-tls" (include "graft.engineName" .) -}}
{{- end -}}
{{- end -}}

{{/* The DNS names of the engines' certificate: the engine Service's, and serverName. */}}
{{- define "graft.adminTLSDNSNames" -}}
{{- $engine := include "graft.engineName" . -}}
{{- $ns := .Release.Namespace -}}
{{- list $engine (printf "%s.%s" $engine $ns) (printf "%s.%s.svc" $engine $ns) (printf "%s.%s.svc.cluster.local" $engine $ns) (include "graft.adminTLSServerName" .) | uniq | toJson -}}
{{- end -}}

{{/* The name the operator expects in the engines' certificate: the engine Service's DNS name. */}}
{{- define "graft.adminTLSServerName" -}}
{{- default (printf "%s.%s.svc" (include "graft.engineName" .) .Release.Namespace) .Values.adminTLS.serverName -}}
{{- end -}}

{{- define "graft.peeringName" -}}
{{- default (include "graft.fullname" .) .Values.operator.peeringName -}}
{{- end -}}

{{/* The namespaces a namespaced operator serves, one per line. */}}
{{- define "graft.watchNamespaces" -}}
{{- $namespaces := .Values.watch.namespaces | default (list .Release.Namespace) -}}
{{- range $namespaces }}
{{ . }}
{{- end -}}
{{- end -}}

{{- define "graft.image" -}}
{{- printf "%s:%s" .image.repository (default .chart.AppVersion .image.tag) -}}
{{- end -}}

{{/* Rules no schema can express, checked once for every template. */}}
{{- define "graft.validate" -}}
{{- if and (eq .Values.rbac.scope "cluster") .Values.watch.namespaces -}}
{{- fail "watch.namespaces applies only with rbac.scope=namespace; with rbac.scope=cluster the operator serves every namespace" -}}
{{- end -}}
{{- if and .Values.gatewayAPI.enabled (not .Values.engine.enabled) -}}
{{- fail "gatewayAPI.enabled routes traffic to the chart's engines: set engine.enabled too" -}}
{{- end -}}
{{- if and .Values.gatewayAPI.enabled (not .Values.gatewayAPI.parentRefs) -}}
{{- fail "gatewayAPI.enabled needs gatewayAPI.parentRefs: the Gateway the HTTPRoute attaches to" -}}
{{- end -}}
{{- if and .Values.adminToken.generate .Values.adminToken.existingSecret -}}
{{- fail "adminToken.generate makes the Secret itself and adminToken.existingSecret names one you manage: set only one" -}}
{{- end -}}
{{- if and .Values.adminTLS.certManager.enabled .Values.adminTLS.existingSecret -}}
{{- fail "adminTLS.certManager.enabled issues the certificate and adminTLS.existingSecret holds one you manage: set only one" -}}
{{- end -}}
{{- if and .Values.adminTLS.plainHTTP (or .Values.adminTLS.certManager.enabled .Values.adminTLS.existingSecret) -}}
{{- fail "adminTLS.plainHTTP turns TLS off and adminTLS.certManager.enabled or adminTLS.existingSecret gives a certificate: set only one" -}}
{{- end -}}
{{- if not (or .Values.adminTLS.plainHTTP .Values.adminTLS.generate .Values.adminTLS.certManager.enabled .Values.adminTLS.existingSecret) -}}
{{- fail "the admin API carries the token that runs code on every engine: give it TLS (adminTLS.generate, adminTLS.certManager.enabled or adminTLS.existingSecret), or set adminTLS.plainHTTP to opt out" -}}
{{- end -}}
{{- if and .Values.adminTLS.certManager.enabled (not .Values.engine.enabled) -}}
{{- fail "adminTLS.certManager.enabled issues a certificate for the chart's engines: set engine.enabled too (or bring adminTLS.existingSecret and adminTLS.serverName)" -}}
{{- end -}}
{{- if and .Values.adminTLS.existingSecret (not .Values.engine.enabled) (not .Values.adminTLS.serverName) -}}
{{- fail "adminTLS.existingSecret without engine.enabled needs adminTLS.serverName: the name in your engines' certificate" -}}
{{- end -}}
{{- $keys := .Values.engine.bundles.trustedKeys -}}
{{- if ne (empty $keys.configMap) (empty $keys.keys) -}}
{{- fail "engine.bundles.trustedKeys needs both configMap and keys: the ConfigMap holding the public keys, and which of its keys to trust" -}}
{{- end -}}
{{- if and .Values.monitoring.prometheusOperator.enabled (not .Values.engine.enabled) (not .Values.monitoring.prometheusOperator.podSelector) -}}
{{- fail "monitoring.prometheusOperator.enabled without engine.enabled needs monitoring.prometheusOperator.podSelector: which engine pods to scrape" -}}
{{- end -}}
{{- end -}}

{{/* GRAFT_NOTIFICATIONS: the receivers as the operator reads them, each URL named by its variable. */}}
{{- define "graft.notificationReceivers" -}}
{{- $out := list -}}
{{- range $i, $r := .Values.notifications.receivers -}}
{{- $item := dict "name" $r.name "type" $r.type "urlEnv" (printf "GRAFT_NOTIFY_URL_%d" $i) -}}
{{- if hasKey $r "moments" }}{{- $_ := set $item "moments" $r.moments -}}{{- end -}}
{{- $out = append $out $item -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}
