# One image per kind of role; docker-compose.yml and deploy/kubernetes pick each service's target:
#   runtime  the workers, the bridge, the 1.0 dispatcher: the product and its runtime dependencies only
#            (the default target: docker build -t agl-celery-bridge .)
#   flower   runtime plus Flower: python -m bridge.ops.flower
#            (docker build --target flower -t agl-celery-bridge-flower .)
#   lab      the compose stack's stand-ins: the Store (agl store), the WebShop server, the LLM stand-in
#            (docker build --target lab -t agl-celery-bridge-lab .)
# Their installed sizes: docs/performance.md, "Installed size".
FROM python:3.11-slim AS base

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LITELLM_LOCAL_MODEL_COST_MAP=True

# An init as PID 1: it reaps the orphans of agent programs and forwards SIGTERM to the command (docs/operations.md,
# "Graceful shutdown"); -s keeps it reaping under another init (compose's `init: true`).
RUN apt-get update && apt-get install -y --no-install-recommends tini && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 agl
WORKDIR /app
COPY pyproject.toml README.md ./
COPY bridge ./bridge
COPY workers ./workers
ENTRYPOINT ["tini", "-s", "--"]

# The product: `bridge` and `workers` (the lab's packages are not even copied).
FROM base AS product
RUN pip install .

FROM product AS flower
RUN pip install ".[flower]"
USER agl
EXPOSE 5555
CMD ["python", "-m", "bridge.ops.flower", "--address=0.0.0.0", "--port=5555"]

FROM base AS lab
COPY bridge_lab ./bridge_lab
COPY webshop_env ./webshop_env
RUN pip install ".[store,lab]"
USER agl
EXPOSE 4747 3000 8000
CMD ["python", "-m", "webshop_env", "serve", "--host", "0.0.0.0", "--port", "3000"]

# Last, so that a plain `docker build .` builds it.
FROM product AS runtime
USER agl
EXPOSE 9100 9101
CMD ["python", "-m", "bridge", "run"]
