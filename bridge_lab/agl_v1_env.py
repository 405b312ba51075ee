"""Agent Lightning 1.0's own processes beside a local stack, for tests, the demo and benchmarks: a Python 3.12
virtualenv holding ``agentlightning`` 1.0 (never this project's environment: 0.3 and 1.0 share a package
name), its gateway ``agl-server``, and ``python -m bridge v1`` dispatching to the stack's workers."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import redis

from bridge.core.coordination import coordination_client, keys
from bridge_lab.procs import ManagedProcess, StackError, free_port, http_ok
from bridge_lab.stack import LocalStack

AGL_V1_REQUIREMENT = "agentlightning==1.0.0"
PROJECT_ROOT = Path(__file__).resolve().parents[1]
TRAINER = Path(__file__).with_name("agl_v1_trainer.py")
GATEWAY_MODEL = "stand-in"  # the model name the gateway forces on every proxied request


def find_python312() -> str | None:
    """A Python >= 3.12 interpreter: ``$PYTHON312``, ``python3.12`` on PATH, or a pyenv install; None if none runs."""
    candidates = [os.environ.get("PYTHON312"), shutil.which("python3.12")]
    candidates += sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.1[2-9]*/bin/python3"))
    for candidate in filter(None, candidates):
        try:
            done = subprocess.run(
                [candidate, "-c", "import sys; assert sys.version_info >= (3, 12)"], capture_output=True, timeout=20
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            return candidate
    return None


def v1_virtualenv(cache: Path | None = None) -> Path:
    """The virtualenv with Agent Lightning 1.0 (``$AGL_V1_WHEEL`` if set, else ``AGL_V1_REQUIREMENT`` from the
    package index) and numpy, built once under ``cache`` and reused; concurrent callers wait for one build.
    StackError says why it cannot be built."""
    return _virtualenv("agl-v1-venv", [], cache)


def v1_project_virtualenv(cache: Path | None = None) -> Path:
    """``v1_virtualenv`` plus this project (editable): where 1.0's own ``agl-controller`` can start this project's
    agent programs (its ``local`` runner starts them with its own interpreter). Built once, like it."""
    return _virtualenv("agl-v1-project-venv", ["-e", str(PROJECT_ROOT)], cache)


def _virtualenv(name: str, extra: list[str], cache: Path | None) -> Path:
    python = find_python312()
    if python is None:
        raise StackError("no Python >= 3.12 found (set PYTHON312): Agent Lightning 1.0 needs it")
    root = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "agl-celery-bridge"
    root.mkdir(parents=True, exist_ok=True)
    venv = root / name
    with (root / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (venv / "ready").exists():
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        package = os.environ.get("AGL_V1_WHEEL") or AGL_V1_REQUIREMENT
        pip = [str(venv / "bin/pip"), "install", "-q", package, "numpy", *extra]
        for argv in ([python, "-m", "venv", str(venv)], pip):
            done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise StackError(
                    f"building the Agent Lightning 1.0 virtualenv failed: {' '.join(argv)}\n{done.stderr[-2000:]}"
                )
        (venv / "ready").touch()
    return venv


def start_gateway(stack: LocalStack, venv: Path, *, key: str, port: int | None = None) -> str:
    """``agl-server`` on loopback (``port``, else a free one) with ``key``, its model registered as the stack's
    LLM stand-in; returns its URL. Stopped with the stack."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [str(venv / "bin/agl-server"), "host=127.0.0.1", f"port={port}", f"key={key}"]
    argv += [f"default_proxy.model_name={GATEWAY_MODEL}", f"hydra.run.dir={stack.log_dir / 'agl-v1-gateway-hydra'}"]
    stack.spawn("agl-v1-gateway", argv, lambda: http_ok(f"{url}/healthz"), timeout=60)
    assert stack.llm_base_url, "the stack's LLM stand-in must be up"
    body = [{"model": GATEWAY_MODEL, "endpoint": stack.llm_base_url}]
    httpx.post(
        f"{url}/api/models", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=10
    ).raise_for_status()
    return url


def start_v1_dispatcher(
    stack: LocalStack, gateway_url: str, *, key: str, name: str = "v1-dispatcher", metrics_port: int | None = None
) -> ManagedProcess:
    """``python -m bridge v1`` with the stack's environment and ``key`` in a file of the stack's (``--key-file``),
    serving /metrics on ``metrics_port`` if given; up once it holds its leader lock."""
    lock_key = keys.bridge_leader(f"{stack.scope}:v1")
    client = coordination_client(stack.redis_url or stack.broker_url, socket_timeout=2)

    def leading() -> bool:
        with contextlib.suppress(redis.RedisError):
            return bool(client.exists(lock_key))
        return False

    key_file = stack.log_dir / f"{name}.key"  # never on the command line: ps shows it
    key_file.touch(mode=0o600)
    key_file.write_text(key + "\n")
    argv = [sys.executable, "-m", "bridge", "v1", "--server", gateway_url, "--key-file", str(key_file)]
    if metrics_port is not None:
        argv += ["--metrics-port", str(metrics_port)]
    return stack.spawn(name, argv, leading, timeout=60, waiting_for="the 1.0 dispatch lock")


def train(venv: Path, spec: dict[str, Any], timeout_s: float = 240.0) -> list[dict[str, Any]]:
    """Run 1.0's trainer client (``bridge_lab.agl_v1_trainer``) on ``spec``: one dict per finished rollout.
    StackError with its stderr if it fails."""
    from workers.v1.box import ISOLATION_EVENT

    spec = {"isolation_event": ISOLATION_EVENT, **spec}
    done = subprocess.run(
        [str(venv / "bin/python"), str(TRAINER), json.dumps(spec)], capture_output=True, text=True, timeout=timeout_s
    )
    if done.returncode != 0:
        raise StackError(f"1.0's trainer client failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def start_local_controller(
    stack: LocalStack,
    venv: Path,
    gateway_url: str,
    *,
    key: str,
    slots: int,
    poll_s: float,
    name: str = "agl-controller",
) -> ManagedProcess:
    """1.0's own ``agl-controller runner_type=local`` (``slots`` subprocesses, polling every ``poll_s``) with the
    stack's environment, so its agent programs reach the same WebShop server; up once its reconciler runs."""
    log_path = stack.log_dir / f"{name}.log"
    argv = [str(venv / "bin/agl-controller"), "runner_type=local", f"agl_server.url={gateway_url}"]
    argv += [f"agl_server.key={key}", f"local_runner.maximum_size={slots}", f"local_runner.poll_interval={poll_s}"]
    argv += [f"hydra.run.dir={stack.log_dir / f'{name}-hydra'}"]

    def running() -> bool:
        return log_path.exists() and "LocalReconciler starting" in log_path.read_text(errors="replace")

    return stack.spawn(name, argv, running, timeout=60, waiting_for="its reconciler")
