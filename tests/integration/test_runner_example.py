"""examples/calc_agent.py, the README's agent, on real workers as the README deploys it, driven by CeleryRunner.step;
and examples/train_calc.py run line by line as its docstring tells a user to."""

from __future__ import annotations

import asyncio
import functools
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import agentlightning as agl
import httpx
import pytest

from bridge.core.coordination import coordination_client, keys
from bridge.core.settings import Settings, env_name
from bridge.core.store import API
from bridge.runner import CeleryRunner
from bridge_lab.stack import LocalStack
from tests.helpers import attempts, cancel_unfinished, stack_for, wait_for
from tests.integration.test_runner import ROOT, llm, store_spans

pytestmark = [pytest.mark.integration, pytest.mark.cost(13)]


def test_the_readme_example_agent_runs_on_the_workers(services: LocalStack, tmp_path: Path) -> None:
    """examples/calc_agent.py as the README deploys it: the LLM stand-in is no calculator, so the reward is
    0.0 or 1.0, but the rollout must succeed with exactly the reward the agent returned, and its LLM call
    traced with token ids for the trainer's adapter."""
    from examples.calc_agent import CalcAgent

    cancel_unfinished(services.store_url)
    env = {"AGENT": "examples.calc_agent:CalcAgent", "PYTHONPATH": ROOT, "LLM_RETURN_TOKEN_IDS": "true"}
    stack = stack_for(services, tmp_path, workers=1, concurrency=1, bridge=False, extra_env=env)
    stack.start()
    try:
        runner = CeleryRunner(broker_url=services.broker_url)
        with runner.run_context(agent=CalcAgent(), store=agl.LightningStoreClient(services.store_url)):
            task = {"question": "What is 12 + 30?", "answer": 42}
            rollout = asyncio.run(runner.step(task, resources={"main_llm": llm(services)}))
    finally:
        stack.stop()
    assert rollout.status == "succeeded"
    spans = asyncio.run(store_spans(services.store_url, rollout.rollout_id))
    assert agl.find_final_reward(spans) in (0.0, 1.0)
    triplets = agl.TracerTraceToTriplet().adapt(spans)
    assert len(triplets) == 1 and triplets[0].reward == agl.find_final_reward(spans)
    assert triplets[0].prompt.get("token_ids") and triplets[0].response.get("token_ids")


# --- examples/train_calc.py exactly as its docstring tells a user to run it -------------------------------

TRAIN_CALC = Path(ROOT) / "examples" / "train_calc.py"


@dataclass
class ShellLine:
    """One line of a documented shell recipe: ``export``s, inline ``VAR=value`` assignments, the command."""

    assignments: dict[str, str]
    argv: list[str]
    export: bool
    background: bool


def recipe(path: Path) -> list[ShellLine]:
    """The indented shell lines of ``path``'s docstring, as a shell would read them."""
    docstring = path.read_text(encoding="utf-8").split('"""')[1]
    lines = []
    for raw in docstring.splitlines():
        if not raw.startswith("    "):
            continue
        text = raw.strip()
        background = text.endswith("&")
        words = shlex.split(text.rstrip("&"))
        export = words[0] == "export"
        words = words[1:] if export else words
        assignments = {}
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            name, _, value = words.pop(0).partition("=")
            assignments[name] = value
        lines.append(ShellLine(assignments, words, export, background))
    return lines


def test_the_recipe_is_read_as_a_shell_reads_it() -> None:
    lines = recipe(TRAIN_CALC)
    assert [line.argv[:1] for line in lines] == [[], ["agl"], ["celery"], ["python"]]
    assert lines[0].export and lines[1].background and lines[2].background and not lines[3].background


def _user_environment(where: Path) -> dict[str, str]:
    """This process's environment without any setting of the project (a user's shell has none set) and with
    this virtualenv's programs first on PATH, as after ``pip install``; ``.env`` is not read: ``where`` has none."""
    settings = {env_name(field) for field in Settings.model_fields} | {"AGENT", "REDIS_KEY_SCOPE"}
    env = {name: value for name, value in os.environ.items() if name not in settings}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    assert not (where / ".env").exists(), "a .env in the repository root would change what the recipe does"
    return env


@pytest.mark.nightly(
    "a whole training recipe: the README's example agent on the workers (the test above) and the Runner's contract "
    "(test_runner.py), every time"
)
def test_train_calc_runs_as_its_docstring_says(services: LocalStack, tmp_path: Path) -> None:
    """Every line of the recipe, with only the addresses replaced by this session's (the Store, the broker, the
    LLM stand-in): the documented worker command must start and serve (it exited 2 without a Store URL), and
    the documented trainer command must train over every task, each rollout succeeding once on the workers."""
    from examples.train_calc import TASKS

    cancel_unfinished(services.store_url)
    ours = {
        "AGENT_LIGHTNING_STORE_URL": services.store_url,
        "CELERY_BROKER_URL": services.broker_url,
        "OPENAI_API_BASE": services.llm_base_url,
        "WEBSHOP_MODEL": "stand-in",
    }
    env = _user_environment(Path(ROOT))
    lines = recipe(TRAIN_CALC)
    workers: subprocess.Popen[bytes] | None = None
    started = time.time()
    try:
        for line in lines:
            assigned = {name: ours.get(name, value) for name, value in line.assignments.items()}
            if line.export:
                env.update(assigned)
                continue
            if line.argv[0] == "agl":  # the session's Store stands in for this `agl store`
                continue
            command_env = {**env, **assigned}
            if line.background:
                log = (tmp_path / "workers.log").open("wb")
                workers = process = subprocess.Popen(
                    line.argv, cwd=ROOT, env=command_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
                wait_for(
                    functools.partial(_exited_or_advertised, services, process),
                    90,
                    "the documented worker command advertises its slots",
                )
                assert process.poll() is None, f"the worker exited {process.returncode}: {_tail(tmp_path)}"
                continue
            trainer = subprocess.run(line.argv, cwd=ROOT, env=command_env, capture_output=True, timeout=240)
            assert trainer.returncode == 0, trainer.stderr.decode(errors="replace")[-3000:]
    finally:
        if workers is not None and workers.poll() is None:
            os.killpg(workers.pid, signal.SIGTERM)
            try:
                workers.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(workers.pid, signal.SIGKILL)
                workers.wait()
    ran = _rollouts_since(services.store_url, started)
    questions = sorted(str(task["question"]) for task in TASKS)
    assert sorted(item["input"]["question"] for item in ran) == questions
    for item in ran:
        assert item["status"] == "succeeded", item
        assert len(attempts(services.store_url, item["rollout_id"])) == 1, item


def _exited_or_advertised(services: LocalStack, process: subprocess.Popen[bytes]) -> bool:
    """The documented command names no node, so Celery's default ``celery@<host>`` is the node to look for."""
    if process.poll() is not None:
        return True
    pattern = keys.worker_capacity_pattern(services.scope, f"celery@{socket.gethostname()}")
    return any(True for _ in coordination_client(services.broker_url).scan_iter(match=pattern))


def _tail(where: Path) -> str:
    return (where / "workers.log").read_text(errors="replace")[-3000:]


def _rollouts_since(store_url: str, started: float) -> list[dict[str, Any]]:
    response = httpx.get(f"{store_url}{API}/rollouts", params={"limit": -1}, timeout=30)
    response.raise_for_status()
    return [item for item in response.json()["items"] if (item.get("start_time") or 0) >= started - 1]
