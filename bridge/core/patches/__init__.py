"""Every place this project corrects or reaches into a third-party library's internals, in one package.

Each module here is one correction, named ``<library>_<what>``, and ``PATCHES`` says which library versions
it was verified against and when to drop it. ``tests/unit/test_patches.py`` fails, naming the module, when
an installed version leaves that range: then re-check the upstream fix and drop the module, or verify it
against the new version and widen the range.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Patch:
    module: str  # under bridge.core.patches
    distribution: str  # the PyPI distribution whose internals it relies on
    verified_from: str  # lowest version it was verified against
    below: str  # the first version it must not be used with unverified
    drop_when: str  # what makes it unnecessary


PATCHES = (
    Patch(
        "celery_task_events",
        "celery",
        "5.5",
        "5.7",
        "Celery 5.7 publishes a detached copy of the event buffer and schedules flushes with hub.call_soon; "
        "drop it once the celery pin (pyproject.toml: <5.7) allows 5.7",
    ),
    Patch(
        "celery_loop_wake",
        "celery",
        "5.5",
        "5.7",
        "a Celery whose thread pool wakes the consumer loop when a task finishes; re-measure the hand-over "
        "wait (python -m bridge bench) on a newer Celery before widening",
    ),
    Patch(
        "kombu_redis_client",
        "kombu",
        "5.6",
        "5.7",
        "a kombu whose Redis channel reuses its client in conn_or_acquire; until then re-check that every "
        "conn_or_acquire caller only runs commands, pipelines and transactions on the client before widening",
    ),
    Patch(
        "httpcore_pool_expiry",
        "httpcore",
        "1.0",
        "2.0",
        "an httpcore whose pool closes expired connections under the connection's lock",
    ),
    Patch(
        "otlp_token_ids",
        "opentelemetry-exporter-otlp-proto-common",
        "1.35",
        "2.0",
        "nothing upstream: it relies on encode_spans and the OTLP message layout; re-run "
        "tests/unit/test_telemetry_encoding.py against a newer exporter before widening",
    ),
)
