# syntax=docker/dockerfile:1.7
# Orchestrator (python -m orchestrator) on a slim Python base. Build from the repository root:
#
#   python tools/build_images.py orchestrator       # tags classify-orchestrator:<git sha12>
#   docker build -f deploy/docker/orchestrator.Dockerfile -t classify-orchestrator:dev .
#
# It needs at run time: a routes file (--routes-file; mount its directory so edits apply
# live), an API keys file (--api-keys-file) and the internal token (--internal-token-file).

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# --- build: virtualenv from the lock, generated stubs --------------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY requirements/ requirements/
# Every package from the orchestrator's own lock (no torch, tokenizers or model weights:
# `make lint` fails if the lock names something its code does not import), each file
# checked against the lock's sha256 (--require-hashes) and nothing resolved here
# (--no-deps); pip itself first, from its own hashed lock.
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --quiet --require-hashes --no-deps -r requirements/pip.lock \
 && /opt/venv/bin/pip install --quiet --require-hashes --no-deps -r requirements/orchestrator.lock \
 && echo /app/classify_common/gen > /opt/venv/lib/python3.11/site-packages/classify-generated-stubs.pth \
 && /opt/venv/bin/pip uninstall --quiet -y pip
# Stubs need grpcio-tools and mypy-protobuf (requirements/stubs.lock): they go into a
# throwaway virtualenv of this stage and never reach the final image.
RUN python -m venv /opt/stubs \
 && /opt/stubs/bin/pip install --quiet --require-hashes --no-deps -r requirements/pip.lock \
 && /opt/stubs/bin/pip install --quiet --require-hashes --no-deps -r requirements/stubs.lock
COPY proto/ proto/
COPY tools/protoc.py tools/protoc.py
COPY classify_common/ /app/classify_common/
COPY orchestrator/ /app/orchestrator/
RUN /opt/stubs/bin/python tools/protoc.py stubs --out /app/classify_common/gen \
 && /opt/venv/bin/python -m compileall -q /app

# --- final: the interpreter, the virtualenv and our code; no pip -----------------------
FROM ${PYTHON_IMAGE} AS orchestrator
ARG PYTHON_IMAGE
ARG GIT_REVISION=""
LABEL org.opencontainers.image.title="classify orchestrator" \
      org.opencontainers.image.description="Public gRPC front door of the classify service" \
      org.opencontainers.image.revision="${GIT_REVISION}" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}"
RUN useradd --system --uid 10001 --user-group --home-dir /home/classify --create-home \
      --shell /usr/sbin/nologin classify
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
COPY tools/grpc_health_check.py /app/grpc_health_check.py
WORKDIR /app
ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    ORCHESTRATOR_HOST=0.0.0.0 \
    ORCHESTRATOR_PORT=50051 \
    ORCHESTRATOR_METRICS_PORT=9101
USER 10001:10001
EXPOSE 50051 9101
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "/app/grpc_health_check.py", "--port-env", "ORCHESTRATOR_PORT", "--port", "50051"]
# SIGTERM drains in-flight calls within --grace-seconds (default 10).
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m", "orchestrator"]
