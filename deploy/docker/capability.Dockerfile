# syntax=docker/dockerfile:1.7
# Capability server (python -m capability) on a CUDA base. Build from the repository root:
#
#   python tools/build_images.py capability    # two phases; topic-minilm:<weights>-<git>-cuda12.8
#   docker build -f deploy/docker/capability.Dockerfile .   # by hand: no weights label check
#
# Build arguments (defaults in brackets):
#   CUDA_VERSION [12.8.1]  the nvidia/cuda base; its driver requirement is enforced by the
#                          NVIDIA container toolkit at start (NVIDIA_REQUIRE_CUDA)
#   TORCH_INDEX_URL [.../whl/cu128]  where torch comes from; its CUDA line must match
#                          CUDA_VERSION's (cu128 for 12.8; .../whl/cpu for a CPU-only image)
#   BUNDLES [baked]        baked: build the model bundles into /models here; mounted: the
#                          image has an empty /models and the bundles are mounted at run time
#   MODEL [topic-minilm]   the image's model: named in its tag and labels
#   EXTRA_MODELS [topic-static]  also baked: the cheap fallback the routes send to
#   WEIGHTS_SHA            SHA-256 of MODEL's manifest.json (its bundle digest, which the
#                          server reports). When set, the build fails unless the baked bundle
#                          has exactly that digest, so label and tag cannot name other weights.
#   GIT_REVISION           commit the image was built from (label only)
#
# NOTE: the CUDA libraries (cuBLAS, cuDNN, NCCL...) come with the torch wheel as its
# nvidia-* dependencies, so the base is the small "base" flavour of nvidia/cuda (the CUDA
# runtime, cudart, plus the toolkit's environment), not "runtime", which would add a
# second, unused copy of those libraries (about 2 GB).

ARG CUDA_VERSION=12.8.1
ARG BUNDLES=baked

# --- Python 3.11 on the CUDA base ----------------------------------------------------
# Ubuntu 22.04 is the newest CUDA base that packages Python 3.11 (24.04 has 3.12 only).
FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu22.04 AS python
ENV DEBIAN_FRONTEND=noninteractive
# openssh-client: ssh-keygen checks bundle signatures (--trusted-signers); without it a
# server told to check them cannot start.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 openssh-client \
 && rm -rf /var/lib/apt/lists/*

# --- build: virtualenv from the lock, generated stubs --------------------------------
FROM python AS build
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11-venv \
 && rm -rf /var/lib/apt/lists/*
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY requirements/ requirements/
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Everything but torch from the capability's own lock, each file checked against the
# lock's sha256 (--require-hashes) and nothing resolved here (--no-deps); pip itself first,
# from its own hashed lock. That lock holds torch's own dependencies (sympy, networkx...).
# NOTE: torch is the one package installed without hashes, in a step of its own and last:
# the CUDA build of the lock's version from TORCH_INDEX_URL, with the nvidia-* libraries
# it links against. Their hashes cannot be locked on our CPU-only machines, which have
# no route to that index (docs/development.md#torch); what is already installed from the
# hashed lock satisfies torch's other requirements, so pip takes nothing else from there.
RUN python3.11 -m venv /opt/venv \
 && /opt/venv/bin/pip install --quiet --require-hashes --no-deps -r requirements/pip.lock \
 && /opt/venv/bin/pip install --quiet --require-hashes --no-deps -r requirements/capability.lock \
 && torch_pin="$(grep -o '^torch==[^ ]*' requirements/torch-cpu.lock)" \
 && /opt/venv/bin/pip install --quiet --index-url "${TORCH_INDEX_URL}" "${torch_pin}" \
 && echo /app/classify_common/gen > /opt/venv/lib/python3.11/site-packages/classify-generated-stubs.pth \
 && /opt/venv/bin/pip uninstall --quiet -y pip
# Stubs need grpcio-tools and mypy-protobuf (requirements/stubs.lock): they go into a
# throwaway virtualenv of this stage and never reach the final image.
RUN python3.11 -m venv /opt/stubs \
 && /opt/stubs/bin/pip install --quiet --require-hashes --no-deps -r requirements/pip.lock \
 && /opt/stubs/bin/pip install --quiet --require-hashes --no-deps -r requirements/stubs.lock
COPY proto/ proto/
COPY tools/protoc.py tools/protoc.py
COPY classify_common/ /app/classify_common/
COPY capability/ /app/capability/
RUN /opt/stubs/bin/python tools/protoc.py stubs --out /app/classify_common/gen \
 && /opt/venv/bin/python -m compileall -q /app

# --- model bundles: built here, or left to a mount ------------------------------------
FROM build AS bundles-baked
ARG MODEL=topic-minilm
ARG EXTRA_MODELS=topic-static
WORKDIR /app
RUN for model in ${MODEL} ${EXTRA_MODELS}; do \
      /opt/venv/bin/python -m capability.bundle build --quiet --model "${model}" \
        --out "/models/${model}/1"; \
    done
# Declared after the build step, so changing it does not rebuild the bundles: the second
# phase of tools/build_images.py reuses the cached bundles it has just read the digest of.
ARG WEIGHTS_SHA=""
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN digest="$(sha256sum "/models/${MODEL}/1/manifest.json" | cut -d' ' -f1)" \
 && echo "${MODEL} bundle digest ${digest}" \
 && if [ -n "${WEIGHTS_SHA}" ] && [ "${WEIGHTS_SHA}" != "${digest}" ]; then \
      echo "WEIGHTS_SHA=${WEIGHTS_SHA} but the bundle built here has ${digest}" >&2; exit 1; \
    fi

FROM build AS bundles-mounted
RUN mkdir /models

# One of the two stages above, by build argument; BuildKit skips the other.
# hadolint ignore=DL3006
FROM bundles-${BUNDLES} AS bundles

# Only the bundles, for `docker build --target bundle-export --output type=local,dest=DIR`.
FROM scratch AS bundle-export
COPY --from=bundles /models /

# --- final: the interpreter, the virtualenv, our code, the bundles; no compilers or pip ---
FROM python AS capability
ARG CUDA_VERSION
ARG MODEL=topic-minilm
ARG EXTRA_MODELS=topic-static
ARG WEIGHTS_SHA=""
ARG BUNDLES
ARG GIT_REVISION=""
LABEL org.opencontainers.image.title="classify capability server" \
      org.opencontainers.image.description="Text classification model server (gRPC)" \
      org.opencontainers.image.revision="${GIT_REVISION}" \
      org.opencontainers.image.base.name="nvidia/cuda:${CUDA_VERSION}-base-ubuntu22.04" \
      ai.classify.model="${MODEL}" \
      ai.classify.extra-models="${EXTRA_MODELS}" \
      ai.classify.bundles="${BUNDLES}" \
      ai.classify.weights.sha256="${WEIGHTS_SHA}" \
      ai.classify.cuda.version="${CUDA_VERSION}"
RUN useradd --system --uid 10001 --user-group --home-dir /home/classify --create-home \
      --shell /usr/sbin/nologin classify
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
COPY tools/grpc_health_check.py /app/grpc_health_check.py
# Owned by root and read-only to the server: it loads bundles, never writes them.
COPY --from=bundles /models /models
WORKDIR /app
ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    CAPABILITY_HOST=0.0.0.0 \
    CAPABILITY_PORT=50052 \
    CAPABILITY_METRICS_PORT=9102 \
    CAPABILITY_MODEL_ROOT=/models
USER 10001:10001
EXPOSE 50052 9102
# SERVING only after every model is loaded and warmed up; the start period covers that.
HEALTHCHECK --interval=10s --timeout=5s --start-period=180s --retries=3 \
  CMD ["python", "/app/grpc_health_check.py", "--port-env", "CAPABILITY_PORT", "--port", "50052"]
# SIGTERM: health turns NOT_SERVING, new calls are refused, admitted ones finish within
# --grace-seconds (default 10); give the container longer than that to stop.
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m", "capability"]
