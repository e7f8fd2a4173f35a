{{/*
Generator pools: each entry of .Values.generatorPools over the shared
.Values.generator. A key a pool sets replaces the shared one (so `affinity: {}`
clears it); `config` and `autoscaling` merge key by key. gpus and
tensorParallelSize follow each other: the pod's one vLLM engine shards the
model over all of its GPUs. Returns a YAML list of resolved pools, each with
its name, gpus, tensorParallelSize, fanoutDegree (config.fanout.degree: a
pool above 0 pulls weights down a tree of its own pods, a StatefulSet) and
gaugeShare (its part of the broker's desired-generators gauge among the
autoscaled pools, by weight).
*/}}
{{- define "asymptote.generatorPools" -}}
{{- $shared := .Values.generator }}
{{- $pools := list }}
{{- $seen := dict }}
{{- range $pool := .Values.generatorPools }}
{{- if hasKey $seen $pool.name }}
{{- fail (printf "generatorPools: the name %q is used twice; each pool is a Deployment of its own" $pool.name) }}
{{- end }}
{{- $_ := set $seen $pool.name true }}
{{- $p := deepCopy (omit $shared "config" "autoscaling") }}
{{- range $key, $value := omit $pool "config" "autoscaling" }}
{{- $_ := set $p $key $value }}
{{- end }}
{{- $_ := set $p "config" (mustMergeOverwrite (deepCopy $shared.config) (deepCopy ($pool.config | default dict))) }}
{{- $_ := set $p "autoscaling" (mustMergeOverwrite (deepCopy $shared.autoscaling) (deepCopy ($pool.autoscaling | default dict))) }}
{{- $gpus := int ($pool.gpus | default $pool.tensorParallelSize | default $shared.gpus) }}
{{- $tp := int ($pool.tensorParallelSize | default (dig "engine" "tensor_parallel_size" $gpus $p.config)) }}
{{- if ne $tp $gpus }}
{{- fail (printf "generatorPools[%s]: tensorParallelSize (%d) must equal gpus (%d): the pod's one vLLM engine shards the model over all of its GPUs; set one of them" $pool.name $tp $gpus) }}
{{- end }}
{{- $_ := set $p "fanoutDegree" (int (dig "fanout" "degree" 0 $p.config)) }}
{{- $_ := set $p "gpus" $gpus }}
{{- $_ := set $p "tensorParallelSize" $tp }}
{{- $a := $p.autoscaling }}
{{- if and $a.keda.enabled $a.hpa.enabled }}
{{- fail (printf "generatorPools[%s].autoscaling: enable keda or hpa, not both (KEDA manages its own HPA)" $pool.name) }}
{{- end }}
{{- if and $a.keda.enabled (not $a.keda.query) (not $.Values.monitoring.serviceMonitors.enabled) }}
{{- fail (printf "generatorPools[%s].autoscaling.keda: KEDA would query %s for the broker's gauge, which nothing scrapes: set monitoring.serviceMonitors.enabled (Prometheus Operator), or keda.query to a series your Prometheus has" $pool.name ($a.keda.serverAddress | default "Prometheus")) }}
{{- end }}
{{- $pools = append $pools $p }}
{{- end }}
{{- $total := 0.0 }}
{{- range $pools }}
{{- if or .autoscaling.keda.enabled .autoscaling.hpa.enabled }}
{{- $total = addf $total (float64 .autoscaling.weight) }}
{{- end }}
{{- end }}
{{- range $pools }}
{{- $_ := set . "gaugeShare" 1.0 }}
{{- if gt $total 0.0 }}
{{- $_ := set . "gaugeShare" (divf (float64 .autoscaling.weight) $total) }}
{{- end }}
{{- end }}
{{- toYaml $pools }}
{{- end }}

{{/* "true" when some generator pool pulls weights down a fan-out tree (generators then dial generators). */}}
{{- define "asymptote.weightTree" -}}
{{- $tree := false }}
{{- range fromYamlArray (include "asymptote.generatorPools" .) }}
{{- if gt (int .fanoutDegree) 0 }}{{ $tree = true }}{{ end }}
{{- end }}
{{- if $tree }}true{{ end }}
{{- end }}

{{/* The headless Service of a tree pool's StatefulSet, under which each pod has a DNS name. */}}
{{- define "asymptote.peersService" -}}
{{- printf "%s-peers" (include "asymptote.componentName" .) }}
{{- end }}
