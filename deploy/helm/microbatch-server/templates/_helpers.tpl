{{/*
Helpers. Every block that more than one workload needs is defined here once: names, labels,
security contexts, volumes, probes, the environment of each component.
Arguments: most take the root context (.); those that need more take a dict with "root".
*/}}

{{/* The chart name (app.kubernetes.io/name). */}}
{{- define "microbatch-server.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The base of every resource name. At most 46 characters: "<fullname>-redis" names a
StatefulSet, whose controller-revision-hash label ("<name>-<10 chars>") must fit in 63.
*/}}
{{- define "microbatch-server.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 46 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 46 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 46 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "name-version" for the helm.sh/chart label. */}}
{{- define "microbatch-server.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
A component's resource name: "<fullname>" for the single server (and the Service in front of
whichever component serves HTTP), "<fullname>-<component>" otherwise.
(dict "root" $ "component" "server|frontend|worker|redis")
*/}}
{{- define "microbatch-server.componentName" -}}
{{- if eq .component "server" }}
{{- include "microbatch-server.fullname" .root }}
{{- else }}
{{- printf "%s-%s" (include "microbatch-server.fullname" .root) .component }}
{{- end }}
{{- end }}

{{/* The component behind the Service "<fullname>": the server, or the front ends. */}}
{{- define "microbatch-server.servingComponent" -}}
{{- ternary "server" "frontend" (eq .Values.mode "single") }}
{{- end }}

{{/* Selector labels. (dict "root" $ "component" "worker"); "component" may be "" (shared objects). */}}
{{- define "microbatch-server.selectorLabels" -}}
app.kubernetes.io/name: {{ include "microbatch-server.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end }}

{{/* All labels of an object. (dict "root" $ "component" "worker") */}}
{{- define "microbatch-server.labels" -}}
helm.sh/chart: {{ include "microbatch-server.chart" .root }}
{{ include "microbatch-server.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{/* The server image, shared by the server, front ends, workers and the init container. */}}
{{- define "microbatch-server.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* Where a model repository from a PVC or the init copy is mounted (MODEL_REPOSITORY). */}}
{{- define "microbatch-server.modelRepositoryPath" -}}
/srv/models
{{- end }}

{{/* Seconds gunicorn gives a front end's processes to finish admitted requests after
SIGTERM: the request timeout, plus 5 s for the answer to go out. */}}
{{- define "microbatch-server.gracefulTimeout" -}}
{{ add .Values.config.requestTimeoutSeconds 5 }}
{{- end }}

{{/* The workers' health and readiness port (MB_HEALTH_PORT). */}}
{{- define "microbatch-server.workerHealthPort" -}}
8081
{{- end }}

{{/*
The gRPC port (grpc.port, MB_GRPC_PORT) of the containers that serve, or "" when gRPC is off
(null or 0). Every template asks this, so "off" means the same everywhere.
*/}}
{{- define "microbatch-server.grpcPort" -}}
{{- with (.Values.grpc | default dict).port }}{{ int . }}{{ end }}
{{- end }}

{{/*
The ports of a container that serves the API (single server, front ends): http 8000, and
grpc when gRPC is on. The Service targets them by name.
*/}}
{{- define "microbatch-server.servingPorts" -}}
- name: http
  containerPort: 8000
  protocol: TCP
{{- with include "microbatch-server.grpcPort" . }}
- name: grpc
  containerPort: {{ . }}
  protocol: TCP
{{- end }}
{{- end }}

{{/*
The user a container runs as: the image's "app" (uid 10001) unless "uid"/"gid" say otherwise
(Redis: 999/1000). (dict) or (dict "uid" 999 "gid" 1000)
*/}}
{{- define "microbatch-server.identity" -}}
runAsNonRoot: true
runAsUser: {{ get . "uid" | default 10001 }}
runAsGroup: {{ get . "gid" | default 10001 }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Pod securityContext. (dict) or (dict "uid" 999 "gid" 1000) */}}
{{- define "microbatch-server.podSecurityContext" -}}
{{ include "microbatch-server.identity" . }}
fsGroup: {{ get . "gid" | default 10001 }}
{{- end }}

{{/*
Container securityContext, the same for every container and init container. With
"identity" true it also names the user, for pods whose securityContext the chart does not
write (the KServe ServingRuntime has no pod securityContext). (dict) or (dict "identity" true)
*/}}
{{- define "microbatch-server.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop:
    - ALL
{{- if get . "identity" }}
{{ include "microbatch-server.identity" (dict) }}
{{- end }}
{{- end }}

{{/*
Pod template metadata: selector labels and podAnnotations.
(dict "root" $ "component" "worker")
*/}}
{{- define "microbatch-server.podMetadata" -}}
labels:
  {{- include "microbatch-server.selectorLabels" . | nindent 2 }}
{{- with .root.Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
The pod-level fields every workload shares: pull secrets, no API token (nothing here talks to
the Kubernetes API), no service-link env vars (a Service named like a setting would leak into
the environment), securityContext, scheduling.
(dict "root" $ "settings" .Values.workers) plus "uid"/"gid" for a non-app image.
*/}}
{{- define "microbatch-server.podSpec" -}}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- include "microbatch-server.podSecurityContext" (dict "uid" (get . "uid") "gid" (get . "gid")) | nindent 2 }}
{{- with .settings.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .settings.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .settings.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
The pod-level fields of a pod running the server image (single server, front ends, workers):
podSpec, the grace period, the copy-models init container and the volumes; each Deployment
adds only its container. (dict "root" $ "settings" .Values.workers)
*/}}
{{- define "microbatch-server.appPodSpec" -}}
{{ include "microbatch-server.podSpec" . }}
terminationGracePeriodSeconds: {{ .settings.terminationGracePeriodSeconds }}
{{- with include "microbatch-server.initContainers" .root }}
{{ . }}
{{- end }}
volumes:
  {{- include "microbatch-server.volumes" .root | nindent 2 }}
{{- end }}

{{/* The fields every container running the server image shares. */}}
{{- define "microbatch-server.appContainer" -}}
image: {{ include "microbatch-server.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
securityContext:
  {{- include "microbatch-server.containerSecurityContext" (dict) | nindent 2 }}
{{- end }}

{{/*
Scratch volumes: /tmp (HOME, caches, gunicorn's heartbeat, the metrics directory: the root
filesystem is read-only) and an in-memory /dev/shm (images reach the model workers through it).
*/}}
{{- define "microbatch-server.scratchVolumes" -}}
- name: tmp
  emptyDir: {}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shm.sizeLimit }}
{{- end }}

{{- define "microbatch-server.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: dshm
  mountPath: /dev/shm
{{- end }}

{{/* Non-empty when the pods mount the external Redis's TLS files. */}}
{{- define "microbatch-server.redisTls" -}}
{{- if and (eq .Values.mode "broker") (not .Values.redis.enabled) .Values.redis.external.tlsSecret }}true{{ end }}
{{- end }}

{{/* The keys file (auth.keysSecret), a volume and its mount, in every pod that checks keys:
the server, the front ends and KServe's runtime (MB_KEYS_FILE names it). */}}
{{- define "microbatch-server.keysVolume" -}}
{{- if .Values.auth.keysSecret -}}
- name: keys
  secret:
    secretName: {{ .Values.auth.keysSecret }}
    defaultMode: 0440
    items:
      - key: keys.yaml
        path: keys.yaml
{{- end }}
{{- end }}

{{- define "microbatch-server.keysMount" -}}
{{- if .Values.auth.keysSecret -}}
- name: keys
  mountPath: /etc/microbatch/keys
  readOnly: true
{{- end }}
{{- end }}

{{/* Every volume of an app pod: scratch, plus the model repository (models.source), plus
the external Redis's TLS files (broker mode, redis.external.tlsSecret). */}}
{{- define "microbatch-server.volumes" -}}
{{ include "microbatch-server.scratchVolumes" . }}
{{- if include "microbatch-server.redisTls" . }}
- name: redis-tls
  secret:
    secretName: {{ .Values.redis.external.tlsSecret }}
    defaultMode: 0440
{{- end }}
{{- with include "microbatch-server.keysVolume" . }}
{{ . }}
{{- end }}
{{- if eq .Values.models.source "pvc" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.models.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.models.source "copy" }}
- name: models
  emptyDir: {}
- name: models-src
  {{- toYaml .Values.models.copy.volume | nindent 2 }}
{{- end }}
{{- end }}

{{/* The mounts of an app container: the model repository is read-only to the server. */}}
{{- define "microbatch-server.volumeMounts" -}}
{{ include "microbatch-server.scratchMounts" . }}
{{- if include "microbatch-server.redisTls" . }}
- name: redis-tls
  mountPath: /etc/microbatch/redis-tls
  readOnly: true
{{- end }}
{{- with include "microbatch-server.keysMount" . }}
{{ . }}
{{- end }}
{{- if ne .Values.models.source "image" }}
- name: models
  mountPath: {{ include "microbatch-server.modelRepositoryPath" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/*
initContainers of an app pod (models.source copy): copy the repository into the emptyDir.
`cp -R`, not `cp -a`: the emptyDir's root belongs to root, so a non-root cp cannot set its
times or mode, and `cp -a` exits 1 for that; nothing reads the copied files' times.
*/}}
{{- define "microbatch-server.initContainers" -}}
{{- if eq .Values.models.source "copy" -}}
initContainers:
  - name: copy-models
    {{- include "microbatch-server.appContainer" . | nindent 4 }}
    command: ["sh", "-c", "cp -R /src/models/. {{ include "microbatch-server.modelRepositoryPath" . }}/"]
    resources:
      {{- toYaml .Values.models.copy.resources | nindent 6 }}
    volumeMounts:
      - name: models-src
        mountPath: /src/models
        readOnly: true
      - name: models
        mountPath: {{ include "microbatch-server.modelRepositoryPath" . }}
{{- end }}
{{- end }}

{{/*
The three probes. The startup probe gives the models time to load (failureThreshold x 5 s);
after it, readiness takes the pod out of the Service and liveness restarts a hung one.
With "grpcPort", readiness is Kubernetes' gRPC probe (grpc.health.v1, service "": the
server's overall health) on that port instead of GET /readyz: the same readiness function
answers both, and a pod that does not serve gRPC leaves the Service. Startup and liveness
stay on HTTP. A gRPC probe takes a port number, never a name.
(dict "port" "http" "startupPath" "/readyz" "startupFailureThreshold" 60 ["grpcPort" 8001])
*/}}
{{- define "microbatch-server.probes" -}}
startupProbe:
  httpGet:
    path: {{ .startupPath }}
    port: {{ .port }}
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: {{ .startupFailureThreshold }}
readinessProbe:
  {{- with get . "grpcPort" }}
  grpc:
    port: {{ int . }}
  {{- else }}
  httpGet:
    path: /readyz
    port: {{ .port }}
  {{- end }}
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: 3
livenessProbe:
  httpGet:
    path: /healthz
    port: {{ .port }}
  periodSeconds: 10
  timeoutSeconds: 3
  failureThreshold: 3
{{- end }}

{{/* The Secret holding API_KEY / ADMIN_API_KEY. */}}
{{- define "microbatch-server.authSecretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" (include "microbatch-server.fullname" .)) }}
{{- end }}

{{/* The Secret holding the in-cluster Redis password, and its key. */}}
{{- define "microbatch-server.redisSecretName" -}}
{{- .Values.redis.auth.existingSecret | default (include "microbatch-server.componentName" (dict "root" . "component" "redis")) }}
{{- end }}

{{- define "microbatch-server.redisSecretKey" -}}
{{- ternary .Values.redis.auth.existingSecretKey "password" (ne .Values.redis.auth.existingSecret "") }}
{{- end }}

{{/*
The environment of one component, all of it here so each decision is made once.
(dict "root" $ "component" "server|frontend|worker|kserve")
Order matters once: REDIS_PASSWORD precedes MB_BROKER, which refers to it as $(REDIS_PASSWORD)
(Kubernetes expands only variables defined earlier in the list). extraEnv comes last.
*/}}
{{- define "microbatch-server.env" -}}
{{- $root := .root }}
{{- $v := .root.Values }}
{{- $c := .component -}}
- name: HOME
  value: /tmp
- name: LOG_FORMAT
  value: json
- name: LOG_LEVEL
  value: {{ $v.config.logLevel | quote }}
{{- if has $c (list "frontend" "worker") }}
{{- if $v.redis.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "microbatch-server.redisSecretName" $root }}
      key: {{ include "microbatch-server.redisSecretKey" $root }}
- name: MB_BROKER
  value: "redis://:$(REDIS_PASSWORD)@{{ include "microbatch-server.componentName" (dict "root" $root "component" "redis") }}:6379/0"
{{- else }}
{{- $x := $v.redis.external }}
- name: MB_BROKER
  valueFrom:
    secretKeyRef:
      name: {{ $x.existingSecret }}
      key: {{ ternary ($x.workerKey | default $x.key) $x.key (eq $c "worker") }}
{{- if and (eq $c "frontend") $x.adminKey }}
- name: MB_BROKER_ADMIN
  valueFrom:
    secretKeyRef:
      name: {{ $x.existingSecret }}
      key: {{ $x.adminKey }}
{{- end }}
{{- end }}
{{- end }}
{{- if eq $c "kserve" }}
{{- /* KServe's storage initializer fills /mnt/models. */}}
- name: {{ ternary "MODEL_REPOSITORY" "MODEL_STORE" (eq $v.kserve.modelLayout "repository") }}
  value: /mnt/models
- name: HOST
  value: 0.0.0.0
- name: PORT
  value: "8080"
{{- else if ne $v.models.source "image" }}
- name: MODEL_REPOSITORY
  value: {{ include "microbatch-server.modelRepositoryPath" $root }}
{{- end }}
{{- if has $c (list "server" "worker" "kserve") }}
{{- /* Processes that run models. */}}
- name: CUDA_DEVICES
  value: {{ $v.config.cudaDevices | quote }}
{{- with ternary $v.workers.workerNum $v.server.workerNum (eq $c "worker") }}
- name: MB_WORKER_NUM
  value: {{ int . | quote }}
{{- end }}
- name: MB_BATCH_SIZE
  value: {{ $v.config.batchSize | quote }}
{{- with $v.config.repositoryPollSeconds }}
- name: MB_REPOSITORY_POLL_S
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- if has $c (list "server" "frontend" "kserve") }}
{{- /* Processes that admit requests (HTTP, and gRPC when on). */}}
- name: MB_MAX_QUEUE
  value: {{ int $v.config.maxQueue | quote }}
- name: MB_REQUEST_TIMEOUT
  value: {{ int $v.config.requestTimeoutSeconds | quote }}
{{- with include "microbatch-server.grpcPort" $root }}
- name: MB_GRPC_PORT
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- if eq $c "frontend" }}
- name: FRONTEND_PROCESSES
  value: {{ int $v.frontend.processes | quote }}
- name: PROMETHEUS_MULTIPROC_DIR
  value: /tmp/metrics
{{- if include "microbatch-server.workersScaleToZero" $root }}
- name: MB_SCALE_FROM_ZERO
  value: "1"
{{- end }}
{{- end }}
{{- if eq $c "worker" }}
- name: MB_DECODE
  value: worker
- name: MB_HEALTH_PORT
  value: {{ include "microbatch-server.workerHealthPort" $root | quote }}
{{- /* Worker i of a pod is "<pod name>:<i>": one name per pod, as the broker requires (one
live process per name); said here rather than left to the host name. */}}
- name: MB_WORKER_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- end }}
{{- if and (ne $c "worker") $v.auth.keysSecret }}
- name: MB_KEYS_FILE
  value: /etc/microbatch/keys/keys.yaml
{{- end }}
{{- if ne $c "worker" }}
{{- /* API keys, from the Secret only. ADMIN_API_KEY only where models load: a front end
refuses loads (its workers load), so the admin routes would be there for nothing. */}}
{{- if or $v.auth.existingSecret $v.auth.apiKey }}
- name: API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "microbatch-server.authSecretName" $root }}
      key: api-key
      optional: true
{{- end }}
{{- if and (ne $c "frontend") (or $v.auth.existingSecret $v.auth.adminApiKey) }}
- name: ADMIN_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "microbatch-server.authSecretName" $root }}
      key: admin-api-key
      optional: true
{{- end }}
{{- end }}
{{- with $v.config.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* "true" when the workers may scale to zero (KEDA with minReplicaCount 0), else "". */}}
{{- define "microbatch-server.workersScaleToZero" -}}
{{- $a := .Values.workers.autoscaling }}
{{- if and $a.enabled (eq (int $a.minReplicaCount) 0) }}true{{ end }}
{{- end }}

{{/*
Combinations the schema cannot express; each fails with what to change.
Included once, from validate.yaml.
*/}}
{{- define "microbatch-server.validate" -}}
{{- $v := .Values }}
{{- if and $v.kserve.enabled (ne $v.mode "single") }}
{{- fail "kserve.enabled needs mode: single (a ServingRuntime runs one self-contained server; broker front ends and workers cannot be one KServe container)" }}
{{- end }}
{{- if and (eq $v.models.source "pvc") (not $v.models.pvc.claimName) }}
{{- fail "models.source pvc needs models.pvc.claimName (the PersistentVolumeClaim holding the model repository)" }}
{{- end }}
{{- if and (eq $v.models.source "copy") (not $v.models.copy.volume) }}
{{- fail "models.source copy needs models.copy.volume (a volume source to copy from, e.g. {persistentVolumeClaim: {claimName: models}})" }}
{{- end }}
{{- with include "microbatch-server.grpcPort" . }}
{{- if eq (int .) 8000 }}
{{- fail "grpc.port 8000 is the HTTP port of the server and the front ends: pick another, e.g. 8001" }}
{{- end }}
{{- if and $v.kserve.enabled (eq (int .) 8080) }}
{{- fail "grpc.port 8080 is the KServe container's HTTP port: pick another, e.g. 8001" }}
{{- end }}
{{- end }}
{{- if and $v.auth.keysSecret (or $v.auth.existingSecret $v.auth.apiKey $v.auth.adminApiKey) }}
{{- fail "auth.keysSecret replaces auth.apiKey, auth.adminApiKey and auth.existingSecret: give those keys an entry in the keys file (python -m app.tenancy new), or leave keysSecret empty" }}
{{- end }}
{{- if and $v.auth.existingSecret (or $v.auth.apiKey $v.auth.adminApiKey) }}
{{- fail "auth.existingSecret and auth.apiKey/adminApiKey are exclusive: put the keys in the existing Secret (keys api-key, admin-api-key), or leave existingSecret empty" }}
{{- end }}
{{- if eq $v.mode "broker" }}
{{- if and (not $v.redis.enabled) (not $v.redis.external.existingSecret) }}
{{- fail "redis.enabled false needs redis.external.existingSecret: a Secret whose key redis.external.key (default \"url\") holds the MB_BROKER URL" }}
{{- end }}
{{- if and $v.redis.enabled $v.redis.auth.existingSecret $v.redis.auth.password }}
{{- fail "redis.auth.existingSecret and redis.auth.password are exclusive: set one" }}
{{- end }}
{{- $fe := $v.frontend }}
{{- $minGrace := add $fe.preStopSleepSeconds (include "microbatch-server.gracefulTimeout" .) }}
{{- if lt (int $fe.terminationGracePeriodSeconds) (int $minGrace) }}
{{- fail (printf "frontend.terminationGracePeriodSeconds (%d) must be at least frontend.preStopSleepSeconds + config.requestTimeoutSeconds + 5 (%d), or requests in flight are cut at shutdown" (int $fe.terminationGracePeriodSeconds) (int $minGrace)) }}
{{- end }}
{{- if and $fe.autoscaling.enabled (gt (int $fe.autoscaling.minReplicas) (int $fe.autoscaling.maxReplicas)) }}
{{- fail "frontend.autoscaling.minReplicas is above maxReplicas" }}
{{- end }}
{{- $wa := $v.workers.autoscaling }}
{{- if and $wa.enabled (gt (int $wa.minReplicaCount) (int $wa.maxReplicaCount)) }}
{{- fail "workers.autoscaling.minReplicaCount is above maxReplicaCount" }}
{{- end }}
{{- end }}
{{- end }}
