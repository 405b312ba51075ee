"""Celery workers that execute Agent Lightning rollouts: ``celery -A workers worker -c 8``.

The Celery app is created on first access of ``workers.app`` (which ``celery -A workers`` does), so that
importing a submodule for its pure functions needs no configuration. A bad configuration stops the
worker with one readable line and exit code 2, not an import traceback.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["app", "celery"]


def __getattr__(name: str) -> Any:
    if name not in ("app", "celery"):
        raise AttributeError(f"module 'workers' has no attribute {name!r}")
    from bridge.core.infra import EXIT_CONFIG_ERROR, ConfigError

    try:
        from workers.app import app
    except ConfigError as error:
        print(f"error: {error.message}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    globals().update(app=app, celery=app)
    return app
