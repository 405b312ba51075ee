"""Celery workers that execute Agent Lightning rollouts: ``celery -A workers worker -c 8``."""

from __future__ import annotations

import sys

from bridge.settings import ConfigError

try:
    from workers.app import app
except ConfigError as _error:  # a readable line and exit code 2, not an import traceback
    print(f"error: {_error.message}", file=sys.stderr)
    raise SystemExit(2) from None

celery = app

__all__ = ["app", "celery"]
