"""Offline WebShop-compatible text environment server (spec: docs/webshop-env.md).

Run it with ``python -m webshop_env serve``; list tasks with ``python -m webshop_env tasks``
or :func:`load_tasks`.
"""

from webshop_env.goals import load_tasks

__all__ = ["LAB_INSTALL", "load_tasks", "needs_lab_extra"]

LAB_INSTALL = "pip install 'agl-celery-bridge[lab]' (from a clone: pip install -e '.[lab]')"


def needs_lab_extra(program: str, what: str, exc: ModuleNotFoundError) -> str:
    """The one line a server of this package prints, instead of a traceback, when the HTTP libraries of the
    project's ``lab`` extra are missing: which program, what it could not import, and the pip command."""
    return f"{program}: cannot serve ({exc}): {what} needs the lab extra: {LAB_INSTALL}"
