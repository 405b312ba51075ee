# One image per kind of role; docker-compose.yml and deploy/kubernetes pick each service's target:
#   runtime  the workers, the bridge, the 1.0 dispatcher: the product and its runtime dependencies only
#            (the default target: docker build -t agl-celery-bridge .)
#   flower   runtime plus Flower: python -m bridge.ops.flower
#            (docker build --target flower -t agl-celery-bridge-flower .)
#   lab      the compose stack's stand-ins: the Store (agl store), the WebShop server, the LLM stand-in
#            (docker build --target lab -t agl-celery-bridge-lab .)
#   worker-agl-v1  workers whose Agent Lightning 1.0 programs need Python >= 3.12 and agentlightning 1.0
#            (docker build --target worker-agl-v1 -t agl-celery-bridge-worker-agl-v1 .)
# Their sizes as built: docs/performance.md, "Installed size".
# The base images are build arguments whose defaults are the official images; a machine without a registry passes
# images of its own (bridge_lab/docker_here.py makes them from Debian's packages).
ARG PYTHON_BASE_IMAGE=python:3.11-slim
ARG PYTHON312_BASE_IMAGE=python:3.12-slim
FROM ${PYTHON_BASE_IMAGE} AS base

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LITELLM_LOCAL_MODEL_COST_MAP=True

# An init as PID 1: it reaps the orphans of agent programs and forwards SIGTERM to the command (docs/operations.md,
# "Graceful shutdown"); -s keeps it reaping under another init (compose's `init: true`).
RUN apt-get update && apt-get install -y --no-install-recommends tini && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 agl
WORKDIR /app
# Dependencies before the source: each target installs what pyproject.toml names for it (deploy/requirements.py),
# then copies the source and installs the project alone, so a change to the source rebuilds only that last layer.
COPY pyproject.toml deploy/requirements.py ./
ENTRYPOINT ["tini", "-s", "--"]

# The product: `bridge` and `workers` (the lab's packages are not even copied).
FROM base AS product
RUN python requirements.py > /tmp/requirements.txt && pip install -r /tmp/requirements.txt
COPY README.md ./
COPY bridge ./bridge
COPY workers ./workers
RUN pip install --no-deps .

FROM product AS flower
RUN pip install ".[flower]"
USER agl
EXPOSE 5555
CMD ["python", "-m", "bridge.ops.flower", "--address=0.0.0.0", "--port=5555"]

FROM base AS lab
RUN python requirements.py store,lab > /tmp/requirements.txt && pip install -r /tmp/requirements.txt
COPY README.md ./
COPY bridge ./bridge
COPY workers ./workers
COPY bridge_lab ./bridge_lab
COPY webshop_env ./webshop_env
RUN pip install --no-deps ".[store,lab]"
USER agl
EXPOSE 4747 3000 8000
CMD ["python", "-m", "webshop_env", "serve", "--host", "0.0.0.0", "--port", "3000"]

# Workers whose Agent Lightning 1.0 programs need Python >= 3.12 and agentlightning 1.0 (docs/agl-v1.md,
# "Deploying it"). The worker and `python -m bridge v1` run this project on the image's Python 3.12 (pyproject allows
# < 3.13); the agent programs run under /opt/agent/bin/python (AGL_V1_AGENT_PYTHON), a virtualenv of their own with
# agentlightning 1.0 and this project (the built-in WebShop program), so programs' packages never pin the worker's.
# Add your agent package there: FROM this image, `RUN /opt/agent/bin/pip install my-agents` as root.
# It also holds 1.0's gateway, /opt/agent/bin/agl-server (docker-compose.yml, profile agl-v1-gateway).
# Its setup repeats base's line for line (a stage cannot build FROM one on another Python); tests/unit/test_deployment.py
# keeps the two in step. agentlightning 1.0 comes from the index, or from a wheel placed in deploy/wheels/ (pip's
# --find-links; docs/agl-v1.md, "Deploying it").
FROM ${PYTHON312_BASE_IMAGE} AS worker-agl-v1
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LITELLM_LOCAL_MODEL_COST_MAP=True \
    AGL_V1_AGENT_PYTHON=/opt/agent/bin/python
RUN apt-get update && apt-get install -y --no-install-recommends tini && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 agl
WORKDIR /app
COPY pyproject.toml deploy/requirements.py ./
COPY deploy/wheels /tmp/wheels
RUN python requirements.py > /tmp/requirements.txt && pip install -r /tmp/requirements.txt && python -m venv /opt/agent \
    && /opt/agent/bin/pip install --find-links /tmp/wheels "agentlightning==1.0.0" -r /tmp/requirements.txt \
    && rm -rf /tmp/wheels
COPY README.md ./
COPY bridge ./bridge
COPY workers ./workers
RUN pip install --no-deps . && /opt/agent/bin/pip install --no-deps .
USER agl
EXPOSE 9101 9102 8080
ENTRYPOINT ["tini", "-s", "--"]
CMD ["celery", "-A", "workers", "worker", "-n", "worker@%h", "-l", "INFO", "-P", "threads", "-c", "16"]

# Last, so that a plain `docker build .` builds it.
FROM product AS runtime
USER agl
EXPOSE 9100 9101
CMD ["python", "-m", "bridge", "run"]
