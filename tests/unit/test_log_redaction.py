"""Every log line the bridge, the 1.0 dispatcher and the workers write goes through ``bridge.core.infra.logs``'s
formatters, which mask secrets (``bridge.core.infra.redact.redact_text``) in the message and in a traceback: an
exception whose text carries a URL's password or a bearer token is logged without them, plain or as JSON."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from bridge.core.infra import configure_logging

SECRETS = ("hunter2", "sk-live-abcdef", "tok-123456")


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _log_a_failure() -> None:
    log = logging.getLogger("bridge.test")
    try:
        raise ConnectionError("redis://:hunter2@redis-host:6379/0 refused; Authorization: Bearer sk-live-abcdef")
    except ConnectionError:
        log.exception("unexpected error talking to %s", "https://gateway/api?token=tok-123456")


@pytest.mark.parametrize("json_lines", [False, True])
def test_secrets_in_a_message_and_a_traceback_never_reach_the_log(
    restore_logging: None, capsys: pytest.CaptureFixture[str], json_lines: bool
) -> None:
    configure_logging("INFO", json_lines)
    _log_a_failure()
    written = capsys.readouterr().err
    assert written, "nothing was logged"
    assert not [secret for secret in SECRETS if secret in written], written
    assert "redis://:***@redis-host" in written and "Traceback" in written  # what happened stays readable
    if json_lines:
        line = json.loads(written.strip().splitlines()[-1])
        assert line["message"].startswith("unexpected error talking to https://gateway/api?token=***")
        assert "ConnectionError" in line["exc"]
