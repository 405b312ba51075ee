"""`python -m bridge.ops.flower`, Flower as compose and Kubernetes start it: no Flower without a login of the
operator's own, since its API reaches every worker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.ops import flower

ROOT = Path(__file__).resolve().parents[2]
GOOD = "ops:a-long-password-of-ours"


@pytest.mark.parametrize(
    ("login", "why"),
    [
        (None, "not set"),
        ("", "not set"),
        ("admin:change-me", "example's password"),  # .env.example's and the Kubernetes overlays' placeholder
        ("admin:CHANGE-ME", "example's password"),
        (f"{GOOD},admin:change-me", "example's password"),  # every entry counts
        ("admin:short", "12+ characters"),
        ("admin", "user:password"),
        (":a-long-password-of-ours", "user:password"),
    ],
)
def test_a_missing_placeholder_or_weak_login_is_refused(login: str | None, why: str) -> None:
    env = {} if login is None else {"FLOWER_BASIC_AUTH": login}
    problem = flower.login_problem(env)
    assert problem is not None and why in problem
    assert "change-me" not in problem.lower() and "a-long-password" not in problem  # never echo a password


def test_an_own_login_passes_and_an_unauthenticated_api_does_not() -> None:
    assert flower.login_problem({"FLOWER_BASIC_AUTH": GOOD}) is None
    assert flower.login_problem({"FLOWER_BASIC_AUTH": f"{GOOD},second:another-long-one"}) is None
    problem = flower.login_problem({"FLOWER_BASIC_AUTH": GOOD, "FLOWER_UNAUTHENTICATED_API": "true"})
    assert problem is not None and "FLOWER_UNAUTHENTICATED_API" in problem


def test_the_placeholder_stops_the_process_with_exit_2_and_one_line() -> None:
    env = {**os.environ, "FLOWER_BASIC_AUTH": "admin:change-me"}
    done = subprocess.run(
        [sys.executable, "-m", "bridge.ops.flower", "--port=5555"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "refusing to start" in done.stderr, done.stderr


def test_an_accepted_login_execs_celery_flower_with_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, list[str]]] = []
    monkeypatch.setenv("FLOWER_BASIC_AUTH", GOOD)
    monkeypatch.delenv("FLOWER_UNAUTHENTICATED_API", raising=False)
    monkeypatch.setattr(flower.os, "execv", lambda path, argv: calls.append((path, list(argv))))
    flower.main(["--address=0.0.0.0", "--port=5555"])
    assert calls == [
        (
            sys.executable,
            [sys.executable, "-m", "celery", "-A", "workers", "flower", "--address=0.0.0.0", "--port=5555"],
        )
    ]


def test_read_only_is_refused_on_a_flower_that_would_ignore_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower skips FLOWER_* variables it has no option for, so an older Flower would run with its API writable."""
    from flower import options as flower_options

    assert flower.installed_flower_problem({"FLOWER_READ_ONLY": "true"}) is None  # the installed Flower has it
    assert flower.installed_flower_problem({"FLOWER_READ_ONLY": "false"}) is None

    class Older:
        pass

    monkeypatch.setattr(flower_options, "default_options", Older())
    problem = flower.installed_flower_problem({"FLOWER_READ_ONLY": "true"})
    assert problem is not None and "read_only" in problem
