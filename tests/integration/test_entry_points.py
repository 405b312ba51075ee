"""Entry points as real processes: every --help answers, and missing configuration exits 2 with one readable
line.

No services needed: these run on any machine. The checks of the deployment files, docker-compose.yml's
validation included (no Docker needed), are in tests/unit/test_deployment.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.cli import build_parser
from bridge_lab.procs import find_executable

pytestmark = pytest.mark.cost(10)

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "AGENT_LIGHTNING_STORE_URL": "http://127.0.0.1:9"}  # importing `workers` reads settings
BRIDGE_COMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr,arg-type]
SETTING_PREFIXES = ("AGENT_LIGHTNING", "CELERY_", "BRIDGE_", "WEBSHOP_", "OPENAI_", "BROKER_", "ROLLOUT_")


def _help_commands() -> list[list[str]]:
    python, celery = sys.executable, find_executable("celery") or "celery"
    commands = [[python, "-m", "bridge", "--help"]]
    commands += [[python, "-m", "bridge", name, "--help"] for name in BRIDGE_COMMANDS]
    commands += [[python, "-m", "webshop_env", "--help"], [python, "-m", "webshop_env", "serve", "--help"]]
    commands += [[python, "-m", "webshop_env", "tasks", "--help"], [python, "-m", "webshop_env.policy", "--help"]]
    commands += [[celery, "-A", "workers", "worker", "--help"], [celery, "-A", "workers", "flower", "--help"]]
    return commands


@pytest.mark.parametrize("argv", _help_commands(), ids=lambda argv: " ".join([Path(argv[0]).name, *argv[1:]]))
def test_help_exits_zero(argv: list[str]) -> None:
    out = subprocess.run(argv, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage" in out.stdout.lower() or "Usage" in out.stdout


def test_missing_store_url_exits_2_with_one_readable_line(tmp_path: Path) -> None:
    """The bridge, and a worker with nothing naming its deployment (no Store, no 1.0 gateway, no REDIS_KEY_SCOPE),
    refuse to start; ``worker --help`` needs no configuration (``test_help_exits_zero``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(SETTING_PREFIXES)}
    for argv in (
        [sys.executable, "-m", "bridge"],
        [sys.executable, "-m", "celery", "-A", "workers", "worker", "-l", "INFO"],
    ):
        # cwd: a folder without a stray .env
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path, check=False)
        assert done.returncode == 2, (argv, done.stderr)
        assert "AGENT_LIGHTNING_STORE_URL" in done.stderr
        assert "Traceback" not in done.stderr
