"""Offline WebShop-compatible text environment server (spec: docs/webshop-env.md).

Run it with ``python -m webshop_env serve``; list tasks with ``python -m webshop_env tasks``
or :func:`load_tasks`.
"""

from webshop_env.goals import load_tasks

__all__ = ["load_tasks"]
