{{/* The release's name for every object: <release>-spendgate, or the release's if it says spendgate. */}}
{{- define "spendgate.fullname" -}}
{{- if contains "spendgate" .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-spendgate" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "spendgate.labels" -}}
app.kubernetes.io/name: spendgate
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The selector of one role: spendgate.selector (dict "root" $ "role" "worker"). */}}
{{- define "spendgate.selector" -}}
app.kubernetes.io/name: spendgate
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{- define "spendgate.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "spendgate.secretName" -}}
{{- .Values.secret.existing | default (printf "%s-secret" (include "spendgate.fullname" .)) -}}
{{- end -}}

{{/* Where the Secret's files are mounted. */}}
{{- define "spendgate.secretDir" -}}/etc/spendgate/secret{{- end -}}

{{/* The Secret keys a role reads: spendgate.secretKeys (dict "root" $ "role" "admission"), one per line. */}}
{{- define "spendgate.secretKeys" -}}
{{- $v := .root.Values -}}
{{- $keys := list $v.kafka.sasl.passwordKey $v.kafka.caKey $v.redis.passwordKey $v.redis.caKey $v.redis.certKey $v.redis.keyKey -}}
{{- if has .role (list "worker" "admission" "policy") -}}
{{- $keys = append $keys $v.subjectSecretKey -}}
{{- end -}}
{{- if has .role (list "admission" "dashboard") -}}
{{- $keys = append $keys $v.auth.tokensKey -}}
{{- end -}}
{{- if eq .role "dashboard" -}}
{{- $keys = append $keys $v.dashboard.sessionSecretKey -}}
{{- end -}}
{{- range $keys | compact | uniq }}
{{ . }}
{{- end -}}
{{- end -}}

{{/* The Secret volume of a role (nothing when it reads no key). */}}
{{- define "spendgate.secretVolume" -}}
{{- $keys := include "spendgate.secretKeys" . | trim | splitList "\n" | compact -}}
{{- if $keys }}
- name: secret
  secret:
    secretName: {{ include "spendgate.secretName" .root }}
    defaultMode: {{ .root.Values.secret.defaultMode }}
    items:
    {{- range $keys }}
      - key: {{ . }}
        path: {{ . }}
    {{- end }}
{{- end -}}
{{- end -}}

{{- define "spendgate.secretMount" -}}
{{- if include "spendgate.secretKeys" . | trim }}
- name: secret
  mountPath: {{ include "spendgate.secretDir" . }}
  readOnly: true
{{- end -}}
{{- end -}}

{{/* The settings every role shares: Kafka, Redis, prefixes, the subject secret. */}}
{{- define "spendgate.env" -}}
{{- $v := .root.Values -}}
{{- $dir := include "spendgate.secretDir" . -}}
- name: SPENDGATE_KAFKA_BOOTSTRAP
  value: {{ $v.kafka.bootstrap | quote }}
- name: SPENDGATE_KAFKA_SECURITY_PROTOCOL
  value: {{ $v.kafka.securityProtocol | quote }}
{{- if hasPrefix "SASL_" $v.kafka.securityProtocol }}
- name: SPENDGATE_KAFKA_SASL_MECHANISM
  value: {{ required "kafka.sasl.mechanism is required with a SASL_* kafka.securityProtocol" $v.kafka.sasl.mechanism | quote }}
- name: SPENDGATE_KAFKA_SASL_USERNAME
  value: {{ required "kafka.sasl.username is required with a SASL_* kafka.securityProtocol" $v.kafka.sasl.username | quote }}
- name: SPENDGATE_KAFKA_SASL_PASSWORD_FILE
  value: {{ printf "%s/%s" $dir (required "kafka.sasl.passwordKey is required with a SASL_* kafka.securityProtocol" $v.kafka.sasl.passwordKey) | quote }}
{{- end }}
{{- if $v.kafka.caKey }}
- name: SPENDGATE_KAFKA_SSL_CAFILE
  value: {{ printf "%s/%s" $dir $v.kafka.caKey | quote }}
{{- end }}
- name: SPENDGATE_KAFKA_REPLICATION_FACTOR
  value: {{ $v.kafka.replicationFactor | quote }}
- name: SPENDGATE_KAFKA_MIN_INSYNC_REPLICAS
  value: {{ $v.kafka.minInsyncReplicas | quote }}
- name: SPENDGATE_REDIS_URL
  value: {{ $v.redis.url | quote }}
- name: SPENDGATE_REDIS_CLUSTER
  value: {{ $v.redis.cluster | quote }}
{{- if $v.redis.username }}
- name: SPENDGATE_REDIS_USERNAME
  value: {{ $v.redis.username | quote }}
{{- end }}
{{- if $v.redis.passwordKey }}
- name: SPENDGATE_REDIS_PASSWORD_FILE
  value: {{ printf "%s/%s" $dir $v.redis.passwordKey | quote }}
{{- end }}
{{- if $v.redis.caKey }}
- name: SPENDGATE_REDIS_SSL_CAFILE
  value: {{ printf "%s/%s" $dir $v.redis.caKey | quote }}
{{- end }}
{{- if $v.redis.certKey }}
- name: SPENDGATE_REDIS_SSL_CERTFILE
  value: {{ printf "%s/%s" $dir $v.redis.certKey | quote }}
- name: SPENDGATE_REDIS_SSL_KEYFILE
  value: {{ printf "%s/%s" $dir (required "redis.keyKey is required with redis.certKey" $v.redis.keyKey) | quote }}
{{- end }}
- name: SPENDGATE_REDIS_SSL_CHECK_HOSTNAME
  value: {{ $v.redis.checkHostname | quote }}
- name: SPENDGATE_TOPIC_PREFIX
  value: {{ $v.topicPrefix | quote }}
- name: SPENDGATE_REDIS_PREFIX
  value: {{ $v.redisPrefix | quote }}
{{- if and $v.subjectSecretKey (has .role (list "worker" "admission" "policy")) }}
- name: SPENDGATE_SUBJECT_SECRET_FILE
  value: {{ printf "%s/%s" $dir $v.subjectSecretKey | quote }}
{{- end }}
{{- end -}}

{{/* Pod and container security: the image's non-root user, nothing written but volumes. */}}
{{- define "spendgate.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.podSecurity.runAsUser }}
runAsGroup: {{ .Values.podSecurity.runAsGroup }}
fsGroup: {{ .Values.podSecurity.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "spendgate.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{- define "spendgate.scrapeAnnotations" -}}
{{- if .root.Values.metrics.annotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- with .root.Values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "spendgate.scheduling" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Refusals the schema cannot state: combinations of values. */}}
{{- define "spendgate.validate" -}}
{{- $v := .Values -}}
{{- if and (not $v.auth.tokensKey) (not $v.auth.allowUnauthenticated) -}}
{{- fail "auth.tokensKey is empty and auth.allowUnauthenticated is false: set a tokens file key, or allow unauthenticated access explicitly" -}}
{{- end -}}
{{- if and $v.auth.tokensKey $v.dashboard.enabled (not $v.dashboard.sessionSecretKey) -}}
{{- fail "dashboard.sessionSecretKey is required with auth.tokensKey: the dashboard's replicas sign sessions with it" -}}
{{- end -}}
{{- if ge (int $v.worker.stopGraceS) (int $v.worker.sessionTimeoutS) -}}
{{- fail (printf "worker.stopGraceS (%v) must stay below worker.sessionTimeoutS (%v)" $v.worker.stopGraceS $v.worker.sessionTimeoutS) -}}
{{- end -}}
{{- if ge (add $v.worker.stallS (mul $v.worker.livenessProbe.periodSeconds $v.worker.livenessProbe.failureThreshold)) (int $v.worker.exitS) -}}
{{- fail (printf "worker.stallS + livenessProbe.periodSeconds x failureThreshold must stay below worker.exitS (%v): the probe restarts a stalled worker before it ends itself" $v.worker.exitS) -}}
{{- end -}}
{{- if and (not $v.secret.existing) (not $v.secret.data) -}}
{{- range list $v.subjectSecretKey $v.auth.tokensKey $v.dashboard.sessionSecretKey $v.kafka.sasl.passwordKey $v.kafka.caKey $v.redis.passwordKey $v.redis.caKey $v.redis.certKey $v.redis.keyKey -}}
{{- if . -}}
{{- fail (printf "the key %q is named but there is no secret: set secret.existing, or secret.data" .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
