# charge-worker image: one command, `charge-worker`; the arguments pick what it does
#   docker run IMAGE run | produce | reconcile | migrate | provision | ...
# Checked offline by `make check-deploy` (hadolint, from the `deploy` extra, plus the
# structural checks in deploy/dockerfile.py). The base is pinned by version and by the digest
# of its multi-architecture index, so a rebuild gets the same bytes; to move it, take the new
# digest from `docker buildx imagetools inspect python:3.11.N-slim-bookworm`.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d

# --- build: a virtualenv with the project and its runtime dependencies, nothing else ---
FROM ${PYTHON_IMAGE} AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src
# Every dependency comes from the lock, each file checked against its sha256
# (requirements/*.txt, exported from uv.lock by `make lock`): the image is built from the
# versions `make test` checked, and a replaced file on the index fails the build. The build
# backend gets a venv of its own, so it never reaches the image. So does the installer: the
# image's venv is made --without-pip (no pip, setuptools nor wheel in it: the running image
# cannot install anything, and ships no installer), and the build venv's pip fills it
# (`--python`).
COPY requirements/ requirements/
RUN python -m venv /opt/build \
    && /opt/build/bin/pip install --no-compile --require-hashes --no-deps \
       -r requirements/build.txt \
    && python -m venv --without-pip /opt/venv \
    && /opt/build/bin/pip --python /opt/venv/bin/python install --no-compile --require-hashes \
       --no-deps -r requirements/runtime.txt
ENV PATH=/opt/venv/bin:$PATH

# Only what the wheel is built from (.dockerignore keeps the rest out of the context);
# the wheel carries migrations/ as charge_worker/migrations (pyproject force-include).
COPY pyproject.toml README.md ./
COPY src/ src/
COPY migrations/ migrations/
# No extras: the dev extra (pytest, linters, embedded nats-server and PostgreSQL) and the
# deploy extra (Helm SDK, schemas) never reach the image. Every runtime dependency ships
# manylinux wheels, so no compiler is needed here either. The project itself goes in with
# --no-deps: its dependencies are the locked ones above, nothing is resolved here.
# Bytecode is compiled here, once: the root filesystem is read-only at run time.
RUN /opt/build/bin/pip wheel --no-deps --no-build-isolation --wheel-dir /tmp/dist . \
    && /opt/build/bin/pip --python /opt/venv/bin/python install --no-compile --no-deps \
       /tmp/dist/charge_worker-*.whl \
    && python -m compileall -q /opt/venv/lib

# --- runtime: the virtualenv, tini as PID 1, an unprivileged user ---
FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="charge-worker" \
      org.opencontainers.image.description="NATS JetStream billing consumer: charges each due subscription once in effect" \
      org.opencontainers.image.licenses="Apache-2.0"

# tini is PID 1: it forwards SIGTERM to charge-worker and reaps zombies. `run` handles
# SIGTERM itself (stop fetching, drain within CHARGE_WORKER_DRAIN_S, exit 0); without an
# init, a PID-1 `produce`/`reconcile`/`migrate` would ignore SIGTERM until SIGKILL.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini=0.19.0-1+b3 \
    && rm -rf /var/lib/apt/lists/*

# A numeric UID/GID, so Kubernetes can verify runAsNonRoot without a passwd lookup.
RUN groupadd --system --gid 10001 charge-worker \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin charge-worker

COPY --from=build /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONFAULTHANDLER=1

# An empty working directory: settings also read `.env` from here, and there is none.
WORKDIR /app
USER 10001:10001

# the worker's /metrics, /healthz, /readyz (CHARGE_WORKER_METRICS_PORT); the webhook
# receiver serves POST /webhooks/gateway and its own probes on CHARGE_WORKER_WEBHOOK_PORT
EXPOSE 9090 8081

ENTRYPOINT ["tini", "--", "charge-worker"]
CMD ["run"]
