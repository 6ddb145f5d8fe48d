{{/*
Names and labels.
*/}}
{{- define "charge-worker.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "charge-worker.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* A resource name: fullname plus a suffix, within 52 characters (CronJob names are
     at most 52 so that the Jobs they create fit in 63). */}}
{{- define "charge-worker.suffixed" -}}
{{- $full := include "charge-worker.fullname" .ctx | trunc (int (sub 51 (len .suffix))) | trimSuffix "-" }}
{{- printf "%s-%s" $full .suffix }}
{{- end }}

{{- define "charge-worker.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "charge-worker.selectorLabels" -}}
app.kubernetes.io/name: {{ include "charge-worker.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Labels of every object; `component` is worker, webhooks, produce, reconcile, migrate,
     maintain or monitoring. The selector labels differ by component, so no Service, PDB or
     ServiceMonitor of one workload selects another's pods. */}}
{{- define "charge-worker.labels" -}}
helm.sh/chart: {{ include "charge-worker.chart" .ctx }}
{{ include "charge-worker.selectorLabels" . }}
app.kubernetes.io/version: {{ include "charge-worker.imageTag" .ctx | trunc 63 | quote }}
app.kubernetes.io/part-of: charge-worker
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end }}

{{- define "charge-worker.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "charge-worker.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The image: a digest, when given, pins it whatever the tag says.
*/}}
{{- define "charge-worker.imageTag" -}}
{{- default .Chart.AppVersion .Values.image.tag }}
{{- end }}

{{- define "charge-worker.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (include "charge-worker.imageTag" .) }}
{{- end }}
{{- end }}

{{/*
Settings. `config` holds charge-worker's environment variables by their own names; a
setting the chart itself needs (ports, the drain deadline, sizing) is read from there,
falling back to charge-worker's default when it is unset.
*/}}
{{- define "charge-worker.setting" -}}
{{- $value := index .ctx.Values.config .name }}
{{- if or (kindIs "invalid" $value) (eq (toString $value) "") }}{{ .default }}{{ else }}{{ $value }}{{ end }}
{{- end }}

{{- define "charge-worker.metricsPort" -}}
{{- include "charge-worker.setting" (dict "ctx" . "name" "CHARGE_WORKER_METRICS_PORT" "default" 9090) | int }}
{{- end }}

{{/* The receiver's one port: POST /webhooks/gateway, /healthz, /readyz and /metrics. */}}
{{- define "charge-worker.webhookPort" -}}
{{- include "charge-worker.setting" (dict "ctx" . "name" "CHARGE_WORKER_WEBHOOK_PORT" "default" 8081) | int }}
{{- end }}

{{/* One setting as an environment variable's text. Helm reads numbers in values as
     float64, and 2592000 would print as 2.592e+06: whole numbers are printed as integers. */}}
{{- define "charge-worker.envValue" -}}
{{- if and (kindIs "float64" .) (eq (float64 (int64 .)) .) }}{{ int64 . }}{{ else }}{{ toString . }}{{ end }}
{{- end }}

{{/* The settings as `env` entries: for the migration hook, which runs before the
     ConfigMap exists on a first install. Unset (null or empty) settings are left out, so
     charge-worker's own default applies. */}}
{{- define "charge-worker.configEnv" -}}
{{- range $name, $value := .Values.config }}
{{- if not (or (kindIs "invalid" $value) (eq (toString $value) "")) }}
- name: {{ $name }}
  value: {{ include "charge-worker.envValue" $value | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Secrets, by reference only. `keys` lists what a component gets: of the shared Secret's keys
"databaseUrl" (DATABASE_URL), "gatewayApiKey" (GATEWAY_API_KEY); "ownerDatabaseUrl"
(DATABASE_URL too, but the schema owner's: the migration hook's migrate.existingSecret /
migrate.databaseUrlKey); "webhooks" for the receiver's own Secret (webhooks.secrets: its
DATABASE_URL, GATEWAY_API_KEY and CHARGE_WORKER_WEBHOOK_SECRETS, never the worker's);
"natsCredentials" for the NATS credentials file of `component` (worker, produce or
reconcile: natsCredentials.keys), when set.
*/}}
{{- define "charge-worker.secretEnv" -}}
{{- $secret := required "secrets.existingSecret is required: the name of a Secret holding DATABASE_URL and GATEWAY_API_KEY (this chart never creates secrets)" .ctx.Values.secrets.existingSecret }}
{{- if has "databaseUrl" .keys }}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ .ctx.Values.secrets.databaseUrlKey }}
{{- end }}
{{- if has "ownerDatabaseUrl" .keys }}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ default $secret .ctx.Values.migrate.existingSecret }}
      key: {{ .ctx.Values.migrate.databaseUrlKey }}
{{- end }}
{{- if has "gatewayApiKey" .keys }}
- name: GATEWAY_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ .ctx.Values.secrets.gatewayApiKeyKey }}
{{- end }}
{{- if has "webhooks" .keys }}
{{- $own := .ctx.Values.webhooks.secrets }}
{{- $name := required "webhooks.secrets.existingSecret is required with webhooks.enabled: the name of the receiver's own Secret, holding its DATABASE_URL, GATEWAY_API_KEY and CHARGE_WORKER_WEBHOOK_SECRETS" $own.existingSecret }}
{{- if eq $name $secret }}
{{- fail (printf "webhooks.secrets.existingSecret must be another Secret than secrets.existingSecret (%s): the internet-facing receiver gets a database role and a gateway key of its own, never the worker's" $secret) }}
{{- end }}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ $name }}
      key: {{ $own.databaseUrlKey }}
- name: GATEWAY_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $name }}
      key: {{ $own.gatewayApiKeyKey }}
- name: CHARGE_WORKER_WEBHOOK_SECRETS
  valueFrom:
    secretKeyRef:
      name: {{ $name }}
      key: {{ $own.webhookSecretsKey }}
{{- end }}
{{- if and (has "natsCredentials" .keys) .ctx.Values.natsCredentials.existingSecret }}
- name: CHARGE_WORKER_NATS_CREDS_FILE
  value: {{ printf "%s/%s" (trimSuffix "/" .ctx.Values.natsCredentials.mountPath) (include "charge-worker.natsCredentialsKey" .) | quote }}
{{- end }}
{{- if and (has "natsCredentials" .keys) .ctx.Values.natsTls.existingSecret }}
{{- $tls := .ctx.Values.natsTls }}
{{- $dir := trimSuffix "/" $tls.mountPath }}
- name: NATS_TLS_CERT
  value: {{ printf "%s/%s" $dir $tls.certKey | quote }}
- name: NATS_TLS_KEY
  value: {{ printf "%s/%s" $dir $tls.keyKey | quote }}
- name: NATS_TLS_CA
  value: {{ printf "%s/%s" $dir $tls.caKey | quote }}
{{- end }}
{{- include "charge-worker.postgresTlsEnv" .ctx }}
{{- with .ctx.Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* TLS to PostgreSQL for every pod that connects to it (postgresTls): PGSSLMODE, and
     PGSSLROOTCERT at the mounted CA. A verifying mode without a CA fails the render. */}}
{{- define "charge-worker.postgresTlsEnv" -}}
{{- $tls := .Values.postgresTls }}
{{- if $tls.sslMode }}
- name: PGSSLMODE
  value: {{ $tls.sslMode | quote }}
{{- end }}
{{- if $tls.existingSecret }}
- name: PGSSLROOTCERT
  value: {{ printf "%s/%s" (trimSuffix "/" $tls.mountPath) $tls.caKey | quote }}
{{- else if has $tls.sslMode (list "verify-ca" "verify-full") }}
{{- fail (printf "postgresTls.existingSecret is required with postgresTls.sslMode %s: the Secret holding the CA that signed PostgreSQL's certificate (or set postgresTls.sslMode to require, which encrypts without checking the server)" $tls.sslMode) }}
{{- end }}
{{- end }}

{{- define "charge-worker.postgresTlsVolume" -}}
{{- if .Values.postgresTls.existingSecret }}
- name: postgres-tls
  secret:
    secretName: {{ .Values.postgresTls.existingSecret }}
    defaultMode: 0444
    items:
      - key: {{ .Values.postgresTls.caKey }}
        path: {{ .Values.postgresTls.caKey }}
{{- end }}
{{- end }}

{{- define "charge-worker.postgresTlsVolumeMount" -}}
{{- if .Values.postgresTls.existingSecret }}
- name: postgres-tls
  mountPath: {{ .Values.postgresTls.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* The Secret key of `component`'s NATS credentials file (natsCredentials.keys): each
     component talking to NATS is a user of its own (docs/nats-permissions.md). */}}
{{- define "charge-worker.natsCredentialsKey" -}}
{{- if eq .component "toolbox" }}
{{- /* the toolbox: an operator user's file when toolbox.natsCredentialsKey names one, else the worker's */}}
{{- default (include "charge-worker.natsCredentialsKey" (dict "ctx" .ctx "component" "worker")) .ctx.Values.toolbox.natsCredentialsKey }}
{{- else }}
{{- required (printf "natsCredentials.keys.%s is required: the credentials file of its NATS user" .component) (index .ctx.Values.natsCredentials.keys .component) }}
{{- end }}
{{- end }}

{{/* Volumes of the worker pods: a writable /tmp (the root filesystem is read-only), the
     worker's NATS credentials file when configured, and extraVolumes. */}}
{{- define "charge-worker.volumes" -}}
{{- include "charge-worker.podVolumes" (dict "ctx" . "nats" true "component" "worker") }}
{{- end }}

{{- define "charge-worker.volumeMounts" -}}
{{- include "charge-worker.podVolumeMounts" (dict "ctx" . "nats" true "component" "worker") }}
{{- end }}

{{/* The same for any pod: the NATS credentials file of `component` only when `nats` (a
     pod that never talks to NATS does not get one mounted; no pod gets another's). */}}
{{- define "charge-worker.podVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .ctx.Values.tmpVolume.sizeLimit }}
{{- if and .nats .ctx.Values.natsCredentials.existingSecret }}
- name: nats-credentials
  secret:
    secretName: {{ .ctx.Values.natsCredentials.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ include "charge-worker.natsCredentialsKey" . }}
        path: {{ include "charge-worker.natsCredentialsKey" . }}
{{- end }}
{{- if and .nats .ctx.Values.natsTls.existingSecret }}
- name: nats-tls
  secret:
    secretName: {{ .ctx.Values.natsTls.existingSecret }}
    defaultMode: 0440
    items:
      {{- range (list .ctx.Values.natsTls.certKey .ctx.Values.natsTls.keyKey .ctx.Values.natsTls.caKey) }}
      - key: {{ . }}
        path: {{ . }}
      {{- end }}
{{- end }}
{{- include "charge-worker.postgresTlsVolume" .ctx }}
{{- with .ctx.Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "charge-worker.podVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if and .nats .ctx.Values.natsCredentials.existingSecret }}
- name: nats-credentials
  mountPath: {{ .ctx.Values.natsCredentials.mountPath }}
  readOnly: true
{{- end }}
{{- if and .nats .ctx.Values.natsTls.existingSecret }}
- name: nats-tls
  mountPath: {{ .ctx.Values.natsTls.mountPath }}
  readOnly: true
{{- end }}
{{- include "charge-worker.postgresTlsVolumeMount" .ctx }}
{{- with .ctx.Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Spreading a Deployment's pods: `spread` is its topologySpread values. */}}
{{- define "charge-worker.topologySpread" -}}
{{- range .spread.topologyKeys }}
- topologyKey: {{ . }}
  maxSkew: {{ $.spread.maxSkew }}
  whenUnsatisfiable: {{ $.spread.whenUnsatisfiable }}
  labelSelector:
    matchLabels:
      {{- include "charge-worker.selectorLabels" (dict "ctx" $.ctx "component" $.component) | trim | nindent 6 }}
  matchLabelKeys:
    - pod-template-hash
{{- end }}
{{- end }}

{{/* Pod-level fields shared by every pod. */}}
{{- define "charge-worker.podCommon" -}}
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod metadata: the component's labels plus podLabels; podAnnotations plus the
     caller's `annotations` (a dict, may be absent). */}}
{{- define "charge-worker.podMetadata" -}}
{{- $annotations := merge (deepCopy (default (dict) .annotations)) (default (dict) .ctx.Values.podAnnotations) }}
labels:
  {{- include "charge-worker.labels" (dict "ctx" .ctx "component" .component) | trim | nindent 2 }}
  {{- with .ctx.Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Rules the values must keep, checked at render time so that `helm install` refuses a
configuration that would break the promise or page for nothing.
*/}}
{{- define "charge-worker.validate" -}}
{{- $servers := dict "NATS_URL" "the NATS server(s), e.g. nats://nats.nats.svc:4222" "GATEWAY_URL" "the payment gateway's base URL" "SCORING_URL" "the scoring service's base URL" }}
{{- range $name, $what := $servers }}
{{- $_ := required (printf "config.%s is required: %s" $name $what) (index $.Values.config $name) }}
{{- end }}
{{- $drain := include "charge-worker.setting" (dict "ctx" . "name" "CHARGE_WORKER_DRAIN_S" "default" 20) | float64 }}
{{- $grace := .Values.worker.terminationGracePeriodSeconds | float64 }}
{{- if not (gt $grace $drain) }}
{{- fail (printf "worker.terminationGracePeriodSeconds (%v) must be longer than CHARGE_WORKER_DRAIN_S (%v): Kubernetes would SIGKILL the worker in the middle of its graceful drain" $grace $drain) }}
{{- end }}
{{- $concurrency := include "charge-worker.setting" (dict "ctx" . "name" "CHARGE_WORKER_CONCURRENCY" "default" 16) | int }}
{{- $maxAckPending := include "charge-worker.setting" (dict "ctx" . "name" "CHARGE_WORKER_MAX_ACK_PENDING" "default" 1000) | int }}
{{- $pods := .Values.worker.replicas | int }}
{{- $podsFrom := "worker.replicas" }}
{{- if .Values.keda.enabled }}
{{- $pods = .Values.keda.maxReplicaCount | int }}
{{- $podsFrom = "keda.maxReplicaCount" }}
{{- end }}
{{- if gt (mul $pods $concurrency) $maxAckPending }}
{{- fail (printf "CHARGE_WORKER_MAX_ACK_PENDING (%d) must be at least %s x CHARGE_WORKER_CONCURRENCY (%d x %d = %d): above it JetStream stops delivering and pods sit idle" $maxAckPending $podsFrom $pods $concurrency (mul $pods $concurrency)) }}
{{- end }}
{{- if and .Values.keda.enabled (lt (int .Values.keda.maxReplicaCount) (int .Values.keda.minReplicaCount)) }}
{{- fail "keda.maxReplicaCount must be at least keda.minReplicaCount" }}
{{- end }}
{{- with .Values.webhooks }}
{{- if and .ingress.enabled (not .enabled) }}
{{- fail "webhooks.ingress.enabled needs webhooks.enabled: the Ingress would route to a receiver that is not deployed" }}
{{- end }}
{{- if and .ingress.tlsSecretName (not .ingress.host) }}
{{- fail "webhooks.ingress.tlsSecretName needs webhooks.ingress.host: the certificate is for a host name" }}
{{- end }}
{{- if and .enabled (le (int .terminationGracePeriodSeconds) (int .preStopSleepSeconds)) }}
{{- fail (printf "webhooks.terminationGracePeriodSeconds (%d) must be longer than webhooks.preStopSleepSeconds (%d): the grace period includes the preStop sleep, and the receiver needs time after it to finish its requests" (int .terminationGracePeriodSeconds) (int .preStopSleepSeconds)) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The pod template of a CronJob's Jobs. `job` is the CronJob's values (produce, reconcile or
maintain), `args` the command line, `keys` the Secret keys it gets (see secretEnv; the NATS
credentials file is mounted only with "natsCredentials"), `volumes`/`mounts` extra ones.
*/}}
{{- define "charge-worker.cronJobTemplate" -}}
{{- $ctx := .ctx }}
{{- $job := .job }}
{{- $nats := has "natsCredentials" .keys }}
metadata:
  labels:
    {{- include "charge-worker.labels" (dict "ctx" $ctx "component" .component) | trim | nindent 4 }}
spec:
  backoffLimit: {{ $job.backoffLimit }}
  activeDeadlineSeconds: {{ $job.activeDeadlineSeconds }}
  template:
    metadata:
      {{- include "charge-worker.podMetadata" (dict "ctx" $ctx "component" .component) | trim | nindent 6 }}
    spec:
      serviceAccountName: {{ include "charge-worker.serviceAccountName" $ctx }}
      restartPolicy: Never
      {{- include "charge-worker.podCommon" $ctx | trim | nindent 6 }}
      {{- with $ctx.Values.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "charge-worker.image" $ctx }}
          imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
          args:
            {{- toYaml .args | nindent 12 }}
          envFrom:
            - configMapRef:
                name: {{ include "charge-worker.fullname" $ctx }}
          env:
            {{- include "charge-worker.secretEnv" (dict "ctx" $ctx "keys" .keys "component" .component) | trim | nindent 12 }}
          resources:
            {{- toYaml $job.resources | nindent 12 }}
          securityContext:
            {{- toYaml $ctx.Values.securityContext | nindent 12 }}
          volumeMounts:
            {{- include "charge-worker.podVolumeMounts" (dict "ctx" $ctx "nats" $nats "component" .component) | trim | nindent 12 }}
            {{- with .mounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        {{- include "charge-worker.podVolumes" (dict "ctx" $ctx "nats" $nats "component" .component) | trim | nindent 8 }}
        {{- with .volumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end }}

{{/* A NetworkPolicy peer: the pods of one namespace (by the kubernetes.io/metadata.name
     label Kubernetes gives every namespace), only those with `podLabels` when given. */}}
{{- define "charge-worker.namespacePeer" -}}
- namespaceSelector:
    matchLabels:
      kubernetes.io/metadata.name: {{ .namespace | quote }}
{{- with .podLabels }}
  podSelector:
    matchLabels:
      {{- toYaml . | nindent 6 }}
{{- end }}
{{- end }}

{{/* Refuse to render NetworkPolicies that would cut a pod off from a server its settings
     name: each port of `url` (a comma-separated list; the scheme's default port when none
     is given) must be among the `target`'s egress ports. */}}
{{- define "charge-worker.egressCoversUrl" -}}
{{- $allowed := list }}
{{- range (index .ctx.Values.networkPolicy.egress .target).ports }}
{{- $allowed = append $allowed (int .) }}
{{- end }}
{{- $defaults := dict "nats" 4222 "tls" 4222 "http" 80 "https" 443 }}
{{- range $url := splitList "," (toString (index .ctx.Values.config .setting)) }}
{{- $parsed := urlParse (trim $url) }}
{{- if $parsed.host }}
{{- $port := regexFind "[0-9]+$" (regexFind ":[0-9]+$" $parsed.host) }}
{{- $port = int (default (index $defaults $parsed.scheme | default 0) $port) }}
{{- if not (has $port $allowed) }}
{{- fail (printf "networkPolicy.egress.%s.ports %v lack port %d of %s: its pods could not reach %s" $.target $allowed $port $.setting (trim $url)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* An image from an {repository, tag, digest} value (the toolbox's nats and psql
     containers): a digest, when given, pins it whatever the tag says. */}}
{{- define "charge-worker.otherImage" -}}
{{- if .digest }}
{{- printf "%s@%s" .repository .digest }}
{{- else }}
{{- printf "%s:%s" .repository .tag }}
{{- end }}
{{- end }}

{{/* A rule's expr reading only one namespace: namespace="<namespace>" first in the label
     matchers of every selector of our series (charge_worker_*, process_*, python_*, up),
     wherever it sits (sum, absent(), a subquery); comments, strings and label names are
     left alone. deploy/sources.py `scoped_expr` does the same with the same expressions,
     and make check-deploy compares the rendered rules with it. */}}
{{- define "charge-worker.scopedExpr" -}}
{{- $metric := "(?:charge_worker|process|python)[_:][A-Za-z0-9_:]*|up" }}
{{- /* PromQL as tokens, tried in order: a comment, a string, a grouping's label list, a
       name with its label matchers, matchers alone, a name alone, anything else. */}}
{{- $string := "\"(?:[^\"\\\\]|\\\\.)*\"|'(?:[^'\\\\]|\\\\.)*'|`[^`]*`" }}
{{- $matchers := printf "\\{(?:[^}\"'`]|%s)*\\}" $string }}
{{- $name := "[A-Za-z_:][A-Za-z0-9_:]*" }}
{{- $token := list "#[^\n]*" $string "(?:by|without|on|ignoring|group_left|group_right)\\s*\\([^)]*\\)" (printf "%s\\s*%s" $name $matchers) $matchers $name "[^#\"'`{A-Za-z_:]+" | join "|" }}
{{- $tokens := regexFindAll $token .expr -1 }}
{{- if ne (join "" $tokens) .expr }}
{{- fail (printf "config/alerts.yml: an expr the namespace scoping cannot read (an open quote or brace?): %s" .expr) }}
{{- end }}
{{- $matcher := printf "namespace=\"%s\"" .namespace }}
{{- $out := "" }}
{{- range $tokens }}
{{- if regexMatch (printf "^(?:%s)$" $metric) . }}
{{- $out = printf "%s%s{%s}" $out . $matcher }}
{{- else if regexMatch (printf "^(?:%s)\\s*\\{\\s*\\}$" $metric) . }}
{{- $out = printf "%s%s{%s}" $out (regexReplaceAll "\\s*\\{\\s*\\}$" . "") $matcher }}
{{- else if regexMatch (printf "^(?:%s)\\s*\\{" $metric) . }}
{{- $out = printf "%s%s" $out (regexReplaceAll "^([A-Za-z0-9_:]+)\\s*\\{" . (printf "${1}{%s," $matcher)) }}
{{- else }}
{{- $out = printf "%s%s" $out . }}
{{- end }}
{{- end }}
{{- $out }}
{{- end }}
