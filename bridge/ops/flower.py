"""Flower as docker-compose.yml and deploy/kubernetes run it: ``python -m bridge.ops.flower [FLOWER OPTIONS]``.

Flower's login guards a UI and a REST API that can revoke tasks and, unless Flower runs read-only, send any
task by name to the workers, which hold the operators' keys. So this refuses to start (exit code 2, one line
on stderr) unless ``FLOWER_BASIC_AUTH`` holds a login of the operator's own: ``user:password`` entries
(comma-separated), none with an empty user or a placeholder password (the examples' ``change-me``) or one
shorter than ``MIN_PASSWORD_CHARS``; ``FLOWER_UNAUTHENTICATED_API`` switched on is refused as well, and so is
``FLOWER_READ_ONLY`` (which the deployment files set) on a Flower without that option, which would ignore it,
and so is a missing Flower (the ``flower`` extra). Then it replaces itself by ``celery -A workers flower`` with the
given options.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from bridge.ops.preflight import MIN_PASSWORD_CHARS, PLACEHOLDERS

TRUE = frozenset({"1", "true", "yes", "on", "t", "y"})
FLOWER_INSTALL = "pip install 'agl-celery-bridge[flower]' (from a clone: pip install -e '.[flower]')"


def login_problem(env: Mapping[str, str]) -> str | None:
    """Why Flower must not start with ``env``'s login, or None when it may."""
    if (env.get("FLOWER_UNAUTHENTICATED_API") or "").strip().lower() in TRUE:
        return "FLOWER_UNAUTHENTICATED_API opens Flower's API to anyone who reaches its port: unset it"
    logins = [entry for entry in (env.get("FLOWER_BASIC_AUTH") or "").split(",") if entry.strip()]
    if not logins:
        return "FLOWER_BASIC_AUTH is not set: set it to user:password (a password of your own)"
    for entry in logins:
        user, sep, password = entry.partition(":")
        if not sep or not user.strip():
            return "FLOWER_BASIC_AUTH must be user:password entries, comma-separated"
        if password.strip().lower() in PLACEHOLDERS:
            return f"FLOWER_BASIC_AUTH for user {user.strip()!r} still has the example's password: set one of your own"
        if len(password) < MIN_PASSWORD_CHARS:
            return f"FLOWER_BASIC_AUTH for user {user.strip()!r}: the password needs {MIN_PASSWORD_CHARS}+ characters"
    return None


def installed_flower_problem(env: Mapping[str, str]) -> str | None:
    """Why Flower cannot start as ``env`` asks: not installed, or ``FLOWER_READ_ONLY`` set where the installed
    Flower would ignore it; None when it can."""
    try:
        from flower.options import default_options  # Flower ignores FLOWER_* variables it has no option for
    except ImportError as exc:
        return f"Flower is not installed ({exc}): {FLOWER_INSTALL}"
    if (env.get("FLOWER_READ_ONLY") or "").strip().lower() not in TRUE:
        return None
    if not hasattr(default_options, "read_only"):
        return "FLOWER_READ_ONLY is set but this Flower has no read_only option: install flower>=2.2"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Check the login, that Flower is installed and its read-only mode, then exec Flower; returns 2 (and execs
    nothing) on a problem."""
    problem = login_problem(os.environ) or installed_flower_problem(os.environ)
    if problem is not None:
        print(f"flower: refusing to start: {problem}", file=sys.stderr)
        return 2
    args = list(sys.argv[1:] if argv is None else argv)
    os.execv(sys.executable, [sys.executable, "-m", "celery", "-A", "workers", "flower", *args])
    return 0  # not reached: execv replaces the process


if __name__ == "__main__":
    raise SystemExit(main())
