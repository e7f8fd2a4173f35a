# The five images, built with `docker buildx bake` from the repository root:
#   PYTHON_DIGEST=sha256:... VLLM_DIGEST=sha256:... PYTORCH_DIGEST=sha256:... \
#     docker buildx bake --push
# Each base image is pinned by digest; find one with
#   docker buildx imagetools inspect python:3.11-slim-bookworm
# (and vllm/vllm-openai:v0.32.0, pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime).
# Without them bake refuses to start. Tags: the chart's appVersion
# (deploy/helm/asymptote/Chart.yaml; tests/deploy/test_images.py checks they agree).

variable "REGISTRY" {
  default = "ghcr.io/asymptote"
}

variable "VERSION" {
  default = "0.1.0"
}

function "is_digest" {
  params = [digest]
  result = length(regexall("^sha256:[0-9a-f]{64}$", digest)) == 1
}

variable "PYTHON_DIGEST" {
  default = ""
  validation {
    condition     = is_digest(PYTHON_DIGEST)
    error_message = "Set PYTHON_DIGEST to the sha256 digest of python:3.11-slim-bookworm."
  }
}

variable "VLLM_DIGEST" {
  default = ""
  validation {
    condition     = is_digest(VLLM_DIGEST)
    error_message = "Set VLLM_DIGEST to the sha256 digest of vllm/vllm-openai:v0.32.0."
  }
}

variable "PYTORCH_DIGEST" {
  default = ""
  validation {
    condition     = is_digest(PYTORCH_DIGEST)
    error_message = "Set PYTORCH_DIGEST to the sha256 digest of pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime."
  }
}

group "default" {
  targets = ["generator", "learner", "broker", "fitter", "sandbox-pool"]
}

target "_common" {
  context   = "."
  platforms = ["linux/amd64"]
  labels = {
    "org.opencontainers.image.source"  = "https://github.com/asymptote/asymptote"
    "org.opencontainers.image.version" = VERSION
  }
}

target "generator" {
  inherits   = ["_common"]
  dockerfile = "deploy/docker/generator.Dockerfile"
  args       = { VLLM_VERSION = "0.32.0", VLLM_DIGEST = VLLM_DIGEST }
  tags       = ["${REGISTRY}/asymptote-generator:${VERSION}"]
}

target "learner" {
  inherits   = ["_common"]
  dockerfile = "deploy/docker/learner.Dockerfile"
  args       = { TORCH_VERSION = "2.13.0", PYTORCH_DIGEST = PYTORCH_DIGEST }
  tags       = ["${REGISTRY}/asymptote-learner:${VERSION}"]
}

target "broker" {
  inherits   = ["_common"]
  dockerfile = "deploy/docker/broker.Dockerfile"
  args       = { PYTHON_DIGEST = PYTHON_DIGEST }
  tags       = ["${REGISTRY}/asymptote-broker:${VERSION}"]
}

target "fitter" {
  inherits   = ["_common"]
  dockerfile = "deploy/docker/fitter.Dockerfile"
  args       = { PYTHON_DIGEST = PYTHON_DIGEST }
  tags       = ["${REGISTRY}/asymptote-fitter:${VERSION}"]
}

target "sandbox-pool" {
  inherits   = ["_common"]
  dockerfile = "deploy/docker/sandbox-pool.Dockerfile"
  args       = { PYTHON_DIGEST = PYTHON_DIGEST }
  tags       = ["${REGISTRY}/asymptote-sandbox-pool:${VERSION}"]
}
