# Learner: the policy in PyTorch, the CISPO loss, checkpoints, weight serving.
# Build from the repository root:
#   docker build -f deploy/docker/learner.Dockerfile -t asymptote-learner .
ARG PYTORCH_IMAGE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime
FROM ${PYTORCH_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/asymptote
COPY pyproject.toml README.md ./
COPY asymptote ./asymptote
COPY services ./services
# torch comes with the base image; pip keeps it and adds the rest.
RUN python -m pip install ".[learner]" \
 && groupadd --gid 10001 asymptote \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin asymptote

USER 10001:10001
ENV HOME=/tmp
EXPOSE 50071 9103
ENTRYPOINT ["asymptote"]
CMD ["learner"]
