# ===== target worker-agl-v1 ==========================================================================================
# Workers whose Agent Lightning 1.0 programs need Python >= 3.12 and agentlightning 1.0 (docs/agl-v1.md,
# "Deploying it"): `docker build --target worker-agl-v1 -t agl-celery-bridge-worker-agl-v1 .`
# The worker and `python -m bridge v1` run this project on the image's Python 3.12 (pyproject allows < 3.13); the
# agent programs run under /opt/agent/bin/python (AGL_V1_AGENT_PYTHON), a virtualenv of their own with
# agentlightning 1.0 and this project (the built-in WebShop program), so programs' packages never pin the worker's.
# Add your agent package there: FROM this image, `RUN /opt/agent/bin/pip install my-agents` as root.
# It also holds 1.0's gateway, /opt/agent/bin/agl-server (docker-compose.yml, profile agl-v1-gateway).
# Kept before the default stage below: `docker build .` without --target builds the last stage.
FROM python:3.12-slim AS worker-agl-v1

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LITELLM_LOCAL_MODEL_COST_MAP=True \
    AGL_V1_AGENT_PYTHON=/opt/agent/bin/python

WORKDIR /app
COPY pyproject.toml README.md ./
COPY bridge ./bridge
COPY workers ./workers
COPY webshop_env ./webshop_env
RUN apt-get update && apt-get install -y --no-install-recommends tini && rm -rf /var/lib/apt/lists/* \
    && pip install . \
    && python -m venv /opt/agent && /opt/agent/bin/pip install "agentlightning==1.0.0" . \
    && useradd --create-home --uid 1000 agl

USER agl
EXPOSE 9101 9102 8080
ENTRYPOINT ["tini", "-s", "--"]
CMD ["celery", "-A", "workers", "worker", "-n", "worker@%h", "-l", "INFO", "-P", "threads", "-c", "16"]
# ===== end of target worker-agl-v1 ===================================================================================

# One image for every role of docker-compose.yml: store (`agl store`), webshop, policy, worker, bridge, flower.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LITELLM_LOCAL_MODEL_COST_MAP=True

WORKDIR /app
COPY pyproject.toml README.md ./
COPY bridge ./bridge
COPY workers ./workers
COPY webshop_env ./webshop_env
RUN pip install ".[store]" && useradd --create-home --uid 1000 agl
# An init as PID 1: it reaps the orphans of agent programs and forwards SIGTERM to the command (docs/operations.md,
# "Graceful shutdown"); -s keeps it reaping under another init (compose's `init: true`).
RUN apt-get update && apt-get install -y --no-install-recommends tini && rm -rf /var/lib/apt/lists/*

USER agl
EXPOSE 4747 3000 8000 9100 9101 5555
ENTRYPOINT ["tini", "-s", "--"]
CMD ["python", "-m", "bridge", "run"]
