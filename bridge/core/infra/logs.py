"""Logging setup shared by the bridge and the workers: plain or JSON lines, ids on every rollout event, and every
line masked by ``bridge.core.infra.redact.redact_text`` as it is written (a message, an exception's text, a traceback),
so a secret that reaches an error (a URL's password, a bearer token, ``api_key=...``) never reaches the log."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import MutableMapping
from typing import Any

from bridge.core.infra.redact import redact_text

_ID_KEYS = ("rollout_id", "attempt_id", "task_id")


class RolloutLogger(logging.LoggerAdapter[logging.Logger]):
    """Prefixes each line with the rollout, attempt and task ids, and keeps them as fields for JSON logs."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        extra = dict(self.extra or {})
        kwargs["extra"] = {**extra, **kwargs.get("extra", {})}
        ids = " ".join(f"{k.removesuffix('_id')}={extra[k]}" for k in _ID_KEYS if extra.get(k))
        return (f"[{ids}] {msg}" if ids else msg), kwargs


class RedactingFormatter(logging.Formatter):
    """A plain line, masked whole: the message and any traceback below it."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object a line; its message and traceback masked."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": round(record.created, 3),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname,
            "logger": record.name,
            "message": redact_text(record.getMessage()),
        }
        for key in _ID_KEYS:
            value = getattr(record, key, None)
            if value:
                data[key] = value
        if record.exc_info:
            data["exc"] = redact_text(self.formatException(record.exc_info))
        return json.dumps(data, ensure_ascii=False)


def configure_logging(level: str = "INFO", json_lines: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "openai", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
