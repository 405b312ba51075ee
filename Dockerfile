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
