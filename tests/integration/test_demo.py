"""`python -m bridge demo` end to end: JSON summary, --keep, and Ctrl-C stopping only what the demo started.

The demo is pointed at the session's broker, Store, WebShop server and LLM stand-in (it uses configured
services that answer), so it starts only its own workers and bridge here; the fresh-machine path that
starts everything is what the README's first command exercises. ``--agl v1`` runs the WebShop agent as an
Agent Lightning 1.0 program through 1.0's own gateway (its virtualenv built by ``bridge_lab.agl_v1_env``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bridge.core.store import API
from bridge_lab.agl_v1_env import v1_virtualenv
from bridge_lab.procs import StackError, http_ok
from bridge_lab.stack import LocalStack
from tests.helpers import cancel_unfinished
from tests.prerequisites import missing

pytestmark = [pytest.mark.integration, pytest.mark.cost(40)]

ROLLOUTS = 5
SUMMARY_KEYS = {
    "rollouts",
    "succeeded",
    "failed",
    "success_rate",
    "mean_reward",
    "rollouts_per_s",
    "p95_rollout_s",
    "failures_by_class",
}


@pytest.fixture
def demo_env(clean_store: LocalStack) -> Iterator[dict[str, str]]:
    services = clean_store
    yield {
        **os.environ,
        "AGENT_LIGHTNING_STORE_URL": services.store_url,
        "CELERY_BROKER_URL": services.broker_url,
        "WEBSHOP_URL": services.webshop_url,
        "OPENAI_API_BASE": services.llm_base_url,
    }
    cancel_unfinished(services.store_url)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _read(path: Path) -> str:
    return path.read_text(errors="replace")


def _read_until_json(proc: subprocess.Popen[str], timeout_s: float) -> tuple[list[str], dict[str, object]]:
    """Lines of stdout up to the JSON summary line (the demo keeps running under --keep)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if line.startswith("{"):
            return lines, json.loads(line)
    raise AssertionError(f"no JSON summary within {timeout_s}s; stdout so far: {lines}")


def test_demo_runs_rollouts_prints_a_summary_and_ctrl_c_stops_only_its_processes(
    demo_env: dict[str, str], services: LocalStack, tmp_path: Path
) -> None:
    argv = [sys.executable, "-m", "bridge", "demo", "--rollouts", str(ROLLOUTS), "--workers", "1"]
    argv += ["--concurrency", "3", "--no-flower", "--json", "--keep", "--log-dir", str(tmp_path)]
    stderr = (tmp_path / "demo.err").open("w")
    # Started with SIGINT ignored, as a CI runner's background job (`cmd &` in a non-interactive shell) starts it:
    # Python then never raises KeyboardInterrupt unless the tool installs its handler itself.
    proc = subprocess.Popen(
        argv, env=demo_env, stdout=subprocess.PIPE, stderr=stderr, text=True, preexec_fn=_ignore_sigint
    )
    try:
        lines, summary = _read_until_json(proc, timeout_s=180)
        assert set(summary) >= SUMMARY_KEYS
        assert summary["rollouts"] == ROLLOUTS and summary["succeeded"] == ROLLOUTS and summary["failed"] == 0
        assert summary["success_rate"] == 1.0 and summary["failures_by_class"] == {}
        assert isinstance(summary["mean_reward"], float) and 0.0 <= summary["mean_reward"] <= 1.0
        assert isinstance(summary["p95_rollout_s"], float) and summary["p95_rollout_s"] > 0
        assert isinstance(summary["rollouts_per_s"], float) and summary["rollouts_per_s"] > 0
        table = "\n".join(lines)
        for label in ("succeeded", "mean reward", "rollout duration", "throughput", "failures by class"):
            assert label in table
        urls = summary["urls"]
        assert isinstance(urls, dict)
        assert urls["store"] == services.store_url  # configured and answering: used, not restarted
        worker_metrics = urls["worker_metrics"]
        bridge_metrics = urls["bridge_metrics"]
        assert isinstance(worker_metrics, list) and isinstance(bridge_metrics, str)
        assert httpx.get(bridge_metrics, timeout=5).status_code == 200  # --keep: still up

        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(timeout=60) == 130
        except subprocess.TimeoutExpired:
            err = _read(tmp_path / "demo.err")
            raise AssertionError(f"the demo did not stop within 60s of SIGINT:\n{err}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        stderr.close()
    err = _read(tmp_path / "demo.err")
    assert "stopped: worker1, bridge" in err, err
    for url in [*worker_metrics, bridge_metrics]:  # the demo's own processes are gone ...
        with pytest.raises(httpx.TransportError):
            httpx.get(url, timeout=2)
    # ... and the configured services it merely used still answer.
    assert http_ok(f"{services.store_url}{API}/health", {"status": "ok"})
    assert http_ok(f"{services.webshop_url}/health", {"status": "ok"})


def test_demo_agl_v1_runs_the_webshop_program_through_the_1_0_gateway_with_the_servers_rewards(
    services: LocalStack, tmp_path: Path
) -> None:
    try:
        v1_virtualenv()  # built once and cached; the demo finds it ready
    except StackError as exc:
        missing(str(exc))
    env = {k: v for k, v in os.environ.items() if k != "AGENT_LIGHTNING_STORE_URL"}  # 1.0 needs no Store
    env.update(CELERY_BROKER_URL=services.broker_url, WEBSHOP_URL=services.webshop_url)
    env["OPENAI_API_BASE"] = services.llm_base_url
    ledger = f"{services.webshop_url}/purchases"
    before = len(httpx.get(ledger, timeout=30).json()["items"])
    # prefork here; tests/integration/test_agl_v1.py runs 1.0 programs under -P threads
    argv = [sys.executable, "-m", "bridge", "demo", "--agl", "v1", "--rollouts", "6", "--workers", "1"]
    argv += ["--concurrency", "3", "--pool", "prefork", "--no-flower", "--json", "--log-dir", str(tmp_path)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["rollouts"] == 6 and summary["succeeded"] == 6 and summary["failures_by_class"] == {}, summary
    assert summary["p95_rollout_s"] > 0 and summary["rollouts_per_s"] > 0
    assert "store" not in summary["urls"] and summary["urls"]["agl_v1_gateway"].startswith("http://127.0.0.1:")
    computed = [item["reward"] for item in httpx.get(ledger, timeout=30).json()["items"][before:]]
    assert summary["mean_reward"] * 6 == pytest.approx(sum(computed), abs=1e-3)  # the rewards the server computed
    assert "stopped: worker1, agl-v1-gateway, v1-dispatcher" in done.stderr, done.stderr[-2000:]
