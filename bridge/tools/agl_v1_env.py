"""Agent Lightning 1.0's own processes beside a local stack, for tests, the demo and benchmarks: a Python 3.12
virtualenv holding ``agentlightning`` 1.0 (never this project's environment: 0.3 and 1.0 share a package
name), its gateway ``agl-server``, and ``python -m bridge v1`` dispatching to the stack's workers."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import redis

from bridge.core import keys
from bridge.core.coordination import coordination_client
from bridge.tools.procs import ManagedProcess, StackError, free_port, http_ok
from bridge.tools.stack import LocalStack

AGL_V1_REQUIREMENT = "agentlightning==1.0.0"
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
    python = find_python312()
    if python is None:
        raise StackError("no Python >= 3.12 found (set PYTHON312): Agent Lightning 1.0 needs it")
    root = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "agl-celery-bridge"
    root.mkdir(parents=True, exist_ok=True)
    venv = root / "agl-v1-venv"
    with (root / "agl-v1-venv.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (venv / "ready").exists():
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        package = os.environ.get("AGL_V1_WHEEL") or AGL_V1_REQUIREMENT
        for argv in ([python, "-m", "venv", str(venv)], [str(venv / "bin/pip"), "install", "-q", package, "numpy"]):
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
    stack: LocalStack, gateway_url: str, *, key: str, name: str = "v1-dispatcher"
) -> ManagedProcess:
    """``python -m bridge v1`` with the stack's environment; up once it holds its leader lock."""
    lock_key = keys.bridge_leader(f"{stack.scope}:v1")
    client = coordination_client(stack.redis_url or stack.broker_url, socket_timeout=2)

    def leading() -> bool:
        with contextlib.suppress(redis.RedisError):
            return bool(client.exists(lock_key))
        return False

    argv = [sys.executable, "-m", "bridge", "v1", "--server", gateway_url, "--key", key]
    return stack.spawn(name, argv, leading, timeout=60, waiting_for="the 1.0 dispatch lock")
