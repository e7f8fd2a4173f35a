# Learner: the policy in PyTorch, the CISPO loss, checkpoints, weight serving.
# Build all four from the repository root with `docker buildx bake` (docker-bake.hcl),
# which passes the base image's digest; alone:
#   docker build -f deploy/docker/learner.Dockerfile --build-arg PYTORCH_DIGEST=sha256:... -t asymptote-learner .
# torch is the version scripts/setup.sh installs (tests/deploy/test_images.py checks).
ARG TORCH_VERSION=2.13.0
ARG PYTORCH_VARIANT=cuda12.8-cudnn9-runtime
# The base image is pinned by digest: without one the reference is invalid and the build fails.
ARG PYTORCH_DIGEST
FROM pytorch/pytorch:${TORCH_VERSION}-${PYTORCH_VARIANT}@${PYTORCH_DIGEST}
ARG TORCH_VERSION

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/asymptote
COPY pyproject.toml README.md ./
COPY asymptote ./asymptote
COPY services ./services
# torch comes with the base image: the build fails unless it is TORCH_VERSION, then pip
# keeps it (pinned, so nothing the project asks for can replace it) and adds the rest.
# hadolint ignore=DL3013
RUN python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '${TORCH_VERSION}')" \
 && python -m pip install ".[learner]" "torch==${TORCH_VERSION}" \
 && groupadd --gid 10001 asymptote \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin asymptote

USER 10001:10001
ENV HOME=/tmp
EXPOSE 50071 9103
ENTRYPOINT ["asymptote"]
CMD ["learner"]
