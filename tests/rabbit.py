"""RabbitMQ for the tests: the shared server on 127.0.0.1:5672, isolated in a vhost of each module's own.

Nothing here deletes or restarts anything it did not create: a test's vhost (and the user it may add) is
removed with everything in it when the test module ends. No tests live here.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bridge.core.infra import redact_url
from bridge_lab.rabbitmq import Vhost, amqp_answers, with_vhost
from bridge_lab.stack import LocalStack, StackConfig
from tests.prerequisites import missing

RABBITMQ_URL = os.environ.get("TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")


@contextmanager
def private_vhost(prefix: str) -> Iterator[tuple[str, Vhost]]:
    """``(broker URL on a fresh vhost, the vhost)``; a missing prerequisite when RabbitMQ cannot be used."""
    if not amqp_answers(RABBITMQ_URL):
        missing(f"no RabbitMQ answers at {redact_url(RABBITMQ_URL)} (.ci/run installs and starts one)")
    vhost = Vhost(f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    why = vhost.available()
    if why is not None:
        missing(f"cannot isolate the tests in a vhost of their own: {why}")
    with vhost:
        yield with_vhost(RABBITMQ_URL, vhost.name), vhost


def add_user(vhost: Vhost, user: str, password: str) -> None:
    """A RabbitMQ user with full rights on ``vhost`` only; removed by ``delete_user``."""
    ctl = str(vhost.ctl)
    subprocess.run([ctl, "-q", "add_user", user, password], check=True, timeout=60, capture_output=True)
    subprocess.run(
        [ctl, "-q", "set_permissions", "-p", vhost.name, user, ".*", ".*", ".*"],
        check=True,
        timeout=60,
        capture_output=True,
    )


def delete_user(vhost: Vhost, user: str) -> None:
    subprocess.run([str(vhost.ctl), "-q", "delete_user", user], check=False, timeout=60, capture_output=True)


def amqp_services(services: LocalStack, broker_url: str, log_dir: Path) -> LocalStack:
    """The session's Store, WebShop server and LLM stand-in, RabbitMQ as broker and the session's Redis
    (the tests' own database) for coordination; ``start_services`` only checks that both answer."""
    stack = LocalStack(
        StackConfig(
            store_url=services.store_url,
            broker_url=broker_url,
            redis_url=services.redis_url or services.broker_url,
            webshop_url=services.webshop_url,
            llm_base_url=services.llm_base_url,
            workers=0,
            bridge=False,
            log_dir=log_dir,
        )
    )
    stack.start_services(lambda message: None)
    return stack


def over(base: LocalStack, log_dir: Path, **config: object) -> LocalStack:
    """Workers and a bridge on ``base``'s RabbitMQ and Redis (``stack_for`` for an AMQP base)."""
    return LocalStack(
        StackConfig(
            store_url=base.store_url,
            broker_url=base.broker_url,
            redis_url=base.redis_url,
            webshop_url=base.webshop_url,
            llm_base_url=config.pop("llm_base_url", base.llm_base_url),  # type: ignore[arg-type]
            log_dir=log_dir,
            **config,  # type: ignore[arg-type]
        )
    )
