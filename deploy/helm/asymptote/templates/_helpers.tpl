{{/*
Names, labels and the pieces every service's pod shares. Each service's own
template (broker.yaml, generator.yaml, learner.yaml, fitter.yaml) says what
is particular to it; these helpers say what is common.
*/}}

{{- define "asymptote.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "asymptote.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "asymptote.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels of one component: (dict "ctx" $ "component" "broker"); with
"pool" "h100", of one generator pool (the component's labels select every pool).
*/}}
{{- define "asymptote.selectorLabels" -}}
app.kubernetes.io/name: {{ include "asymptote.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- with .pool }}
asymptote.dev/generator-pool: {{ . }}
{{- end }}
{{- end }}

{{/* Standard labels of one component: (dict "ctx" $ "component" "broker") */}}
{{- define "asymptote.labels" -}}
{{ include "asymptote.selectorLabels" . }}
app.kubernetes.io/part-of: asymptote
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ include "asymptote.chart" .ctx }}
{{- end }}

{{/* <fullname>-<component>, or <fullname>-generator-<pool> with "pool". */}}
{{- define "asymptote.componentName" -}}
{{- if .pool }}
{{- printf "%s-%s-%s" (include "asymptote.fullname" .ctx) .component .pool }}
{{- else }}
{{- printf "%s-%s" (include "asymptote.fullname" .ctx) .component }}
{{- end }}
{{- end }}

{{/* A workload's values: "values" when given (a generator pool's, resolved), else .Values.<component>. */}}
{{- define "asymptote.values" -}}
{{- toYaml (.values | default (index .ctx.Values .component)) }}
{{- end }}

{{- define "asymptote.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "asymptote.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* DNS name of a component's Service, which peers dial (the learner's is its advertise_host). */}}
{{- define "asymptote.serviceHost" -}}
{{- printf "%s.%s.svc" (include "asymptote.componentName" .) .ctx.Release.Namespace }}
{{- end }}

{{/* host:port of a component's gRPC service, fully qualified. */}}
{{- define "asymptote.grpcEndpoint" -}}
{{- $values := index .ctx.Values .component }}
{{- printf "%s:%v" (include "asymptote.serviceHost" .) $values.ports.grpc }}
{{- end }}

{{/*
gRPC TLS: every pod mounts grpcTls.secretName (cert-manager's layout: tls.crt,
tls.key, ca.crt) here; one certificate serves and dials for every service.
*/}}
{{- define "asymptote.grpcTlsDir" -}}
/etc/asymptote/grpc-tls
{{- end }}

{{/* The names the gRPC certificate must carry: what peers and the helm test dial. */}}
{{- define "asymptote.grpcTlsDnsNames" -}}
{{- $names := list }}
{{- with .Values.grpcTls.serverName }}
{{- $names = append $names . }}
{{- end }}
{{- range $component := list "broker" "generator" "learner" "fitter" }}
{{- $names = append $names (include "asymptote.serviceHost" (dict "ctx" $ "component" $component)) }}
{{- end }}
{{- if .Values.sandboxPool.enabled }}
{{- $names = append $names (include "asymptote.serviceHost" (dict "ctx" $ "component" "sandbox-pool")) }}
{{- end }}
{{- range $g := fromYamlArray (include "asymptote.generatorPools" $) }}
{{- if gt (int $g.fanoutDegree) 0 }}
{{- /* Generators on a fan-out tree dial each other's pods by name. */}}
{{- $names = append $names (printf "*.%s.%s.svc" (include "asymptote.peersService" (dict "ctx" $ "component" "generator" "pool" $g.name)) $.Release.Namespace) }}
{{- end }}
{{- end }}
{{- toYaml (uniq (concat $names .Values.grpcTls.certManager.extraDnsNames)) }}
{{- end }}

{{- define "asymptote.grpcTlsVolume" -}}
- name: grpc-tls
  secret:
    secretName: {{ .Values.grpcTls.secretName }}
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      - {key: ca.crt, path: ca.crt}
{{- end }}

{{- define "asymptote.grpcTlsVolumeMount" -}}
- name: grpc-tls
  mountPath: {{ include "asymptote.grpcTlsDir" . }}
  readOnly: true
{{- end }}

{{/*
image reference of a role: repository, then @digest or :tag. The images have
no default repository: a release that forgot one is refused here, naming every
image it deploys and lacks, not at pull time.
*/}}
{{- define "asymptote.image" -}}
{{- include "asymptote.imagesSet" .ctx }}
{{- $image := index .ctx.Values.images .component }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default .ctx.Chart.AppVersion $image.tag) }}
{{- end }}
{{- end }}

{{/* Fails, naming each images.<role>.repository the release deploys and leaves empty. */}}
{{- define "asymptote.imagesSet" -}}
{{- $roles := list "generator" "learner" "broker" "fitter" }}
{{- if .Values.sandboxPool.enabled }}
{{- $roles = append $roles "sandboxPool" }}
{{- end }}
{{- $missing := list }}
{{- range $role := $roles }}
{{- if not (trim (index $.Values.images $role).repository) }}
{{- $missing = append $missing (printf "images.%s.repository" $role) }}
{{- end }}
{{- end }}
{{- if $missing }}
{{- fail (printf "%s %s not set: the chart has no default image; build and push them (docker buildx bake, docs/deploying.md \"The images\") and say where, e.g. %s=registry.example.com/you/asymptote-%s" (join ", " $missing) (ternary "is" "are" (eq (len $missing) 1)) (first $missing) (first $missing | trimPrefix "images." | trimSuffix ".repository" | kebabcase)) }}
{{- end }}
{{- end }}

{{- define "asymptote.natsSecretName" -}}
{{- if .Values.nats.auth.existingSecret }}
{{- .Values.nats.auth.existingSecret }}
{{- else }}
{{- printf "%s-nats" (include "asymptote.fullname" .) }}
{{- end }}
{{- end }}

{{- define "asymptote.natsPasswordAuth" -}}
{{- if or .Values.nats.auth.existingSecret .Values.nats.auth.user }}true{{ end }}
{{- end }}

{{/*
The run's prefix of its JetStream streams, subjects and buckets: run.prefix, or
the release name made one (lower case, "-" and "." as "_", a leading "r" when
it starts with a digit), so two releases on one NATS never share a stream.
*/}}
{{- define "asymptote.runPrefix" -}}
{{- $prefix := .Values.run.prefix | default (.Release.Name | lower | replace "-" "_" | replace "." "_") }}
{{- if not (regexMatch "^[a-z]" $prefix) }}
{{- $prefix = printf "r%s" $prefix }}
{{- end }}
{{- if not (regexMatch "^[a-z][a-z0-9_]*$" $prefix) }}
{{- fail (printf "run.prefix %q: a run prefix is a lower-case letter, then letters, digits and _ (it names NATS streams and subjects)" $prefix) }}
{{- end }}
{{- $prefix }}
{{- end }}

{{/*
The run's task, one for the broker and every generator pool: .Values.task as
YAML, or nothing (the services' built-in arithmetic toy) when unset. A release
that sets a model (a claim, a download or init containers) must name its task:
the toy's prompts and verifier on a real model train nothing.
*/}}
{{- define "asymptote.task" -}}
{{- $model := .Values.model }}
{{- $realModel := or $model.cache.existingClaim $model.download.enabled $model.cache.initContainers }}
{{- if and $realModel (empty .Values.task) }}
{{- fail "task is not set, and a model is (model.cache.existingClaim, model.download or model.cache.initContainers): set the top-level task, e.g. the GSM8K task of examples/helm/qwen3-gsm8k-values.yaml, or task.name: arithmetic for the built-in toy" }}
{{- end }}
{{- with .Values.task }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{/*
The settings the chart owns in every service's config: NATS, the run prefix,
listeners on the pod's interfaces, gRPC TLS, JSON logs. (dict "ctx" $ "component" "broker")
*/}}
{{- define "asymptote.ownedConfig" -}}
{{- $ctx := .ctx -}}
{{- $values := index $ctx.Values .component }}
{{- $nats := dict "url" (tpl $ctx.Values.nats.url $ctx) "stream_replicas" (int $ctx.Values.nats.streamReplicas) }}
{{- if $ctx.Values.nats.auth.credsSecret }}
{{- $_ := set $nats "creds_file" "/etc/asymptote/nats/creds/nats.creds" }}
{{- end }}
{{- if $ctx.Values.nats.tls.caSecret }}
{{- $_ := set $nats "tls_ca_file" "/etc/asymptote/nats/tls/ca.crt" }}
{{- end }}
{{- $owned := dict
  "nats" $nats
  "prefix" (include "asymptote.runPrefix" $ctx)
  "grpc" (dict "host" "0.0.0.0" "port" $values.ports.grpc)
  "http" (dict "host" "0.0.0.0" "port" $values.ports.http)
  "log_format" "json" }}
{{- with $ctx.Values.grpcTls }}
{{- if .enabled }}
{{- $dir := include "asymptote.grpcTlsDir" $ctx }}
{{- $tls := dict
  "cert_file" (printf "%s/tls.crt" $dir)
  "key_file" (printf "%s/tls.key" $dir)
  "ca_file" (printf "%s/ca.crt" $dir)
  "require_client_cert" .requireClientCert }}
{{- with .serverName }}
{{- $_ := set $tls "server_name" . }}
{{- end }}
{{- $_ := set $owned "grpc_tls" $tls }}
{{- end }}
{{- end }}
{{- toYaml $owned }}
{{- end }}

{{/*
A service's ConfigMap: its typed values merged with what the chart owns.
(dict "ctx" $ "component" "broker" "owned" (dict ...))
*/}}
{{- define "asymptote.configMap" -}}
{{- $values := fromYaml (include "asymptote.values" .) -}}
{{- $config := mustMergeOverwrite (deepCopy $values.config) (fromYaml (include "asymptote.ownedConfig" .)) .owned -}}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "asymptote.componentName" . }}
  namespace: {{ .ctx.Release.Namespace }}
  labels:
    {{- include "asymptote.labels" . | nindent 4 }}
data:
  config.yaml: |
    {{- toYaml $config | nindent 4 }}
{{- end }}

{{/* The env every service gets: NATS credentials from the Secret, a writable HOME. */}}
{{- define "asymptote.env" -}}
{{- $ctx := .ctx -}}
{{- $prefix := printf "ASY_%s" (upper .component) -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
{{- if include "asymptote.natsPasswordAuth" $ctx }}
- name: {{ $prefix }}__NATS__USER
  valueFrom:
    secretKeyRef:
      name: {{ include "asymptote.natsSecretName" $ctx }}
      key: {{ $ctx.Values.nats.auth.userKey }}
- name: {{ $prefix }}__NATS__PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "asymptote.natsSecretName" $ctx }}
      key: {{ $ctx.Values.nats.auth.passwordKey }}
{{- end }}
{{- with (fromYaml (include "asymptote.values" .)).extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Volumes every service mounts: config, /tmp ("tmpGiB", default 1), NATS creds
and CA, the gRPC certificate, the user's extraVolumes.
*/}}
{{- define "asymptote.volumes" -}}
- name: config
  configMap:
    name: {{ include "asymptote.componentName" . }}
- name: tmp
  emptyDir:
    sizeLimit: {{ printf "%vGi" (.tmpGiB | default 1) }}
{{- if .ctx.Values.nats.auth.credsSecret }}
- name: nats-creds
  secret:
    secretName: {{ .ctx.Values.nats.auth.credsSecret }}
    items:
      - key: {{ .ctx.Values.nats.auth.credsKey }}
        path: nats.creds
{{- end }}
{{- if .ctx.Values.nats.tls.caSecret }}
- name: nats-ca
  secret:
    secretName: {{ .ctx.Values.nats.tls.caSecret }}
    items:
      - key: {{ .ctx.Values.nats.tls.caKey }}
        path: ca.crt
{{- end }}
{{- if .ctx.Values.grpcTls.enabled }}
{{ include "asymptote.grpcTlsVolume" .ctx }}
{{- end }}
{{- with (fromYaml (include "asymptote.values" .)).extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "asymptote.volumeMounts" -}}
- name: config
  mountPath: /etc/asymptote/config
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if .ctx.Values.nats.auth.credsSecret }}
- name: nats-creds
  mountPath: /etc/asymptote/nats/creds
  readOnly: true
{{- end }}
{{- if .ctx.Values.nats.tls.caSecret }}
- name: nats-ca
  mountPath: /etc/asymptote/nats/tls
  readOnly: true
{{- end }}
{{- if .ctx.Values.grpcTls.enabled }}
{{ include "asymptote.grpcTlsVolumeMount" .ctx }}
{{- end }}
{{- with (fromYaml (include "asymptote.values" .)).extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The model cache volume generators and the learner read the initial weights from. */}}
{{- define "asymptote.modelVolume" -}}
- name: model-cache
{{- if .Values.model.cache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.cache.existingClaim }}
    readOnly: true
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.cache.sizeLimit }}
{{- end }}
{{- end }}

{{- define "asymptote.modelVolumeMount" -}}
- name: model-cache
  mountPath: {{ .Values.model.cache.mountPath }}
  readOnly: {{ not (empty .Values.model.cache.existingClaim) }}
{{- end }}

{{/* The model cache's init containers, with the chart's security context. */}}
{{/* The hub token of model.download, as a file (never in the environment), for its init containers. */}}
{{- define "asymptote.downloadVolumes" -}}
{{- with .Values.model.download }}
{{- if and .enabled .tokenSecret.name }}
- name: hf-token
  secret:
    secretName: {{ .tokenSecret.name | quote }}
    defaultMode: 0440
    items:
      - {key: {{ .tokenSecret.key | quote }}, path: token}
{{- end }}
{{- end }}
{{- end }}

{{- define "asymptote.modelInitContainers" -}}
{{- with .Values.model.download }}
{{- if .enabled }}
{{- $fetches := list (dict "name" "fetch-model" "kind" "model" "repo" .repo "dest" $.Values.model.path "revision" .revision "allow" .allowPatterns) }}
{{- range $i, $d := .datasets }}
{{- $fetches = append $fetches (dict "name" (printf "fetch-dataset-%d" $i) "kind" "dataset" "repo" $d.repo "dest" (printf "%s/%s" $.Values.model.cache.mountPath $d.path) "revision" (default "main" $d.revision) "allow" (default (list "*") $d.files)) }}
{{- end }}
{{- range $fetches }}
- name: {{ .name }}
  image: {{ include "asymptote.image" (dict "ctx" $ "component" "learner") }}
  imagePullPolicy: {{ $.Values.images.pullPolicy }}
  command: ["python", "-m", "asymptote.download", {{ .kind | quote }}, {{ required "model.download: every fetch needs a repo (OWNER/NAME)" .repo | quote }}, {{ .dest | quote }}, "--revision", {{ .revision | quote }}{{ range .allow }}, "--allow", {{ . | quote }}{{ end }}]
  env:
    - {name: HF_HOME, value: {{ printf "%s/.hf-home" $.Values.model.cache.mountPath | quote }}}
    - {name: HF_HUB_DISABLE_TELEMETRY, value: "1"}
    {{- if $.Values.model.download.tokenSecret.name }}
    - {name: HF_TOKEN_PATH, value: /var/run/secrets/huggingface/token}
    {{- end }}
  securityContext:
    {{- toYaml $.Values.containerSecurityContext | nindent 4 }}
  resources:
    requests: {cpu: 500m, memory: 1Gi}
    limits: {cpu: "1", memory: 2Gi}
  volumeMounts:
    - name: model-cache
      mountPath: {{ $.Values.model.cache.mountPath }}
    {{- if $.Values.model.download.tokenSecret.name }}
    - {name: hf-token, mountPath: /var/run/secrets/huggingface, readOnly: true}
    {{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- range .Values.model.cache.initContainers }}
- {{- toYaml (mustMergeOverwrite (dict "securityContext" $.Values.containerSecurityContext "volumeMounts" (fromYamlArray (include "asymptote.modelVolumeMount" $))) .) | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Ports, probes and security of a service's main container. With "command"
(a list) the container runs it with "args" instead of the image's
`asymptote <component>`; "extraPorts" adds named ports. Every pod answers its
own probes on its http port (each learner pod's LOCAL_RANK 0 process serves
/healthz and /readyz, on pod 0 the learner service itself).
*/}}
{{- define "asymptote.containerCommon" -}}
{{- $values := fromYaml (include "asymptote.values" .) -}}
image: {{ include "asymptote.image" . }}
imagePullPolicy: {{ .ctx.Values.images.pullPolicy }}
{{- if .command }}
command: {{ toJson .command }}
args:
  {{- toYaml .args | nindent 2 }}
{{- else }}
args: [{{ .component | quote }}, "--config", "/etc/asymptote/config/config.yaml"]
{{- end }}
ports:
  - name: grpc
    containerPort: {{ $values.ports.grpc }}
    protocol: TCP
  - name: http
    containerPort: {{ $values.ports.http }}
    protocol: TCP
  {{- range .extraPorts }}
  - {{- toYaml . | nindent 4 }}
  {{- end }}
livenessProbe:
  httpGet: {path: /healthz, port: http}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
readinessProbe:
  httpGet: {path: /readyz, port: http}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 3
{{- with $values.startupProbe }}
startupProbe:
  httpGet: {path: /readyz, port: http}
  periodSeconds: {{ .periodSeconds }}
  failureThreshold: {{ .failureThreshold }}
  timeoutSeconds: 5
{{- end }}
securityContext:
  {{- toYaml .ctx.Values.containerSecurityContext | nindent 2 }}
{{- end }}

{{/* Pod-level settings every service shares. */}}
{{- define "asymptote.podCommon" -}}
{{- $values := fromYaml (include "asymptote.values" .) -}}
serviceAccountName: {{ include "asymptote.serviceAccountName" .ctx }}
automountServiceAccountToken: false
enableServiceLinks: false
securityContext:
  {{- toYaml .ctx.Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ $values.terminationGracePeriodSeconds }}
{{- with .ctx.Values.images.pullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with $values.schedulerName }}
schedulerName: {{ . }}
{{- end }}
{{- end }}

{{/* Pod template metadata: labels and a checksum of the config, so a change rolls the pods. */}}
{{- define "asymptote.podMetadata" -}}
{{- $values := fromYaml (include "asymptote.values" .) -}}
labels:
  {{- include "asymptote.labels" . | nindent 2 }}
  {{- with $values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
annotations:
  checksum/config: {{ include "asymptote.configMap" . | sha256sum }}
  {{- with $values.podAnnotations }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}

{{/* A component's Service (headless with "headless" true): gRPC and HTTP (/metrics, /healthz, /readyz). */}}
{{- define "asymptote.service" -}}
{{- $values := fromYaml (include "asymptote.values" .) -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "asymptote.componentName" . }}
  namespace: {{ .ctx.Release.Namespace }}
  labels:
    {{- include "asymptote.labels" . | nindent 4 }}
spec:
  {{- if .headless }}
  clusterIP: None
  {{- else }}
  type: ClusterIP
  {{- end }}
  selector:
    {{- include "asymptote.selectorLabels" . | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $values.ports.grpc }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    - name: http
      port: {{ $values.ports.http }}
      targetPort: http
      protocol: TCP
      appProtocol: http
{{- end }}

{{/*
checkov.io/skipN annotations of a workload: each check the chart cannot pass
as configured, with its reason. (dict "ctx" $ "image" "broker" "env" true "extra" (list ...))
*/}}
{{- define "asymptote.checkovSkips" -}}
{{- $skips := .extra | default list -}}
{{- if not (index .ctx.Values.images .image).digest -}}
{{- $skips = append $skips (printf "CKV_K8S_43=Images are pinned by tag unless images.%s.digest is set" .image) -}}
{{- end -}}
{{- if and .env (include "asymptote.natsPasswordAuth" .ctx) -}}
{{- $skips = append $skips "CKV_K8S_35=The services take the NATS password only as an ASY_<SERVICE>__NATS__PASSWORD override; nats.auth.credsSecret mounts a credentials file instead" -}}
{{- end -}}
{{- if $skips }}
annotations:
  {{- range $i, $skip := $skips }}
  checkov.io/skip{{ add1 $i }}: {{ $skip | quote }}
  {{- end }}
{{- end }}
{{- end }}

{{/*
Host memory, /dev/shm and /tmp of the GPU pods, and the learner's volume, from
model.sizeGiB: the one place the chart sizes them. (dict "ctx" $ "component"
"generator"|"learner") A weight swap's measured peak extra memory is 1.10x the
model's bytes (396.5 MB model: tmpfs 396.6 MB + ~40 MB of pull buffers in the
generator; benchmarks.swap --no-prepack, as GPU engines load: they pack
nothing) and a swap stages one version at most, so:
  swapPeakGiB = ceil(1.10 x sizeGiB)
  shmGiB      = swapPeakGiB + 2     generator (weightsOn: memory): the staged
                                    version, and vLLM's worker IPC
              = swapPeakGiB + 8     learner: the weights it serves, NCCL's buffers
  memoryGiB   = base + shmGiB       shm's pages count against the memory limit;
                                    base = 16 (generator), 32 (learner): the
                                    process without the model's host copies
  tmpGiB      = 8 + swapPeakGiB     torch.compile's, Triton's and vLLM's caches,
                                    and a staged version under weightsOn: disk
The learner's memory adds what services/learner/memory.py counts on the host
(sizeGiB is 2 bytes a parameter, bf16), and its volume holds the checkpoints:
  loadGiB       = gpusPerNode x 2 x max(sizeGiB / 10, 1)
                                    each rank reads one stored tensor at a time
                                    in float32; the largest (the embeddings) is
                                    taken as a tenth of the model (6.5-7.6% at 7-8B)
  servedGiB     = (served_versions_kept + 1) x sizeGiB
                                    versions rank 0 serves, and the one it
                                    copies out (page-locked buffers on GPUs)
  stagingGiB    = ceil(6 x sizeGiB / nodes)           this pod's ranks staging
                                    their shards of an async checkpoint (float32
                                    weights and AdamW moments: 12 bytes a parameter)
  memoryGiB    += loadGiB + servedGiB + stagingGiB
  checkpointGiB = ceil(6 x sizeGiB)                   one checkpoint, all ranks
  persistenceGiB = checkpointGiB x (keep_checkpoints + best + 1) + 8
                                    the kept ones, the best held-out round's (best:
                                    1 unless keep_best_checkpoint is false), the one
                                    being written, metrics
Returns YAML with these keys.
*/}}
{{- define "asymptote.sizing" -}}
{{- $size := float64 .ctx.Values.model.sizeGiB }}
{{- $peak := int (ceil (mulf $size 1.10)) }}
{{- $learner := eq .component "learner" }}
{{- $shm := add $peak (ternary 8 2 $learner) }}
{{- $base := ternary 32 16 $learner }}
swapPeakGiB: {{ $peak }}
shmGiB: {{ $shm }}
tmpGiB: {{ add 8 $peak }}
{{- if $learner }}
{{- $l := .ctx.Values.learner }}
{{- $load := int (ceil (mulf (float64 $l.gpusPerNode) 2.0 (maxf (divf $size 10.0) 1.0))) }}
{{- $served := int (ceil (mulf (float64 (add1 (int (default 2 $l.config.served_versions_kept)))) $size)) }}
{{- $staging := int (ceil (divf (mulf 6.0 $size) (float64 $l.nodes))) }}
{{- $checkpoint := int (ceil (mulf 6.0 $size)) }}
loadGiB: {{ $load }}
servedGiB: {{ $served }}
stagingGiB: {{ $staging }}
checkpointGiB: {{ $checkpoint }}
{{- $best := ternary 0 1 (eq (toString $l.config.keep_best_checkpoint) "false") }}
persistenceGiB: {{ add (mul $checkpoint (add1 (add $best (int (default 2 $l.config.keep_checkpoints))))) 8 }}
memoryGiB: {{ add $base $shm $load $served $staging }}
{{- else }}
memoryGiB: {{ add $base $shm }}
{{- end }}
{{- end }}

{{/* requests and limits of a GPU container: cpu as given, memory as given or sized, the GPUs. (dict "values" ... "sizing" ... "gpus" N) */}}
{{- define "asymptote.gpuResources" -}}
{{- $memory := printf "%vGi" .sizing.memoryGiB }}
{{- range $kind := list "requests" "limits" }}
{{ $kind }}:
  {{- toYaml (mustMergeOverwrite (dict "memory" $memory) (index $.values.resources $kind)) | nindent 2 }}
  {{ $.values.gpuResourceName }}: {{ $.gpus }}
{{- end }}
{{- end }}
