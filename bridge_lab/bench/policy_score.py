"""Score the heuristic LLM stand-in on WebShop test tasks, end to end over HTTP.

Starts the environment server (`python -m webshop_env serve`) and the stand-in
(`python -m webshop_env.policy`) as subprocesses, unless URLs of running ones are given, then
plays each task: reset with its task_id, up to --max-steps turns of "send the conversation in the
agent loop's format to /v1/chat/completions, take the `Action:` line, step the env". Prints the
average score (x100) and the success rate (reward == 1.0), the two numbers WebShop papers report.

Why over HTTP rather than calling the heuristic directly: the number then also checks the
observation strings, the message contract and both servers, the way the Celery agent loop uses them.

    .venv/bin/python -m bridge_lab.bench.policy_score --limit 500 --concurrency 32
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx

from bridge_lab.procs import PYTHON, free_port, serving

SYSTEM_PROMPT = (
    "You are a web shopping agent. Each turn you see a WebShop observation. Reply with one line "
    "'Action: search[<query>]' or 'Action: click[<button>]'."
)
ACTION_LINE_RE = re.compile(r"^\s*Action:\s*(.+?)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class EpisodeResult:
    """Outcome of one task."""

    task_id: str
    reward: float
    steps: int
    invalid: int
    finished: bool
    error: str | None = None


def load_task_ids(split: str, limit: int) -> list[str]:
    """Task ids from `python -m webshop_env tasks` (JSON list, JSON lines, or bare ids)."""
    out = subprocess.run(
        [sys.executable, "-m", "webshop_env", "tasks", "--split", split, "--limit", str(limit)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    try:
        records: list[Any] = json.loads(out)
    except ValueError:
        records = []
        for line in out.splitlines():
            line = line.strip()
            if line:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    records.append(line)
    if isinstance(records, dict):
        records = list(records.get("tasks", []))
    ids = [str(r["task_id"]) if isinstance(r, dict) else str(r) for r in records]
    return ids[:limit]


def user_turn(step: int, max_steps: int, state: dict[str, Any]) -> dict[str, str]:
    """One user message in the agent loop's format (workers/agents/prompts.py: step_prompt)."""
    lines = [f"Step {step} of {max_steps}.", f"Observation: {state['observation']}"]
    clickables = ((state.get("info") or {}).get("available_actions") or {}).get("clickables")
    if clickables:
        lines.append("Clickable: " + ", ".join(clickables[:60]))
    return {"role": "user", "content": "\n".join(lines)}


def ask_policy(client: httpx.Client, policy_url: str, messages: list[dict[str, str]]) -> str:
    """One chat completion; returns the assistant content."""
    resp = client.post(
        f"{policy_url}/v1/chat/completions",
        json={"model": "webshop-heuristic-standin", "messages": messages, "temperature": 0.0},
    )
    resp.raise_for_status()
    return str(resp.json()["choices"][0]["message"]["content"])


def play(client: httpx.Client, env_url: str, policy_url: str, task_id: str, max_steps: int) -> EpisodeResult:
    """Play one task to the purchase or the step cap."""
    reset = client.post(f"{env_url}/reset", json={"task_id": task_id})
    reset.raise_for_status()
    state = reset.json()
    session = state["session_id"]
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        user_turn(1, max_steps, state),
    ]
    invalid = 0
    for step in range(1, max_steps + 1):
        content = ask_policy(client, policy_url, messages)
        found = ACTION_LINE_RE.findall(content)
        action = found[-1] if found else content.strip()
        messages.append({"role": "assistant", "content": content})
        resp = client.post(f"{env_url}/step", json={"session_id": session, "action": action})
        resp.raise_for_status()
        state = resp.json()
        was_invalid = (state.get("info") or {}).get("valid") is False
        invalid += int(was_invalid)
        if state.get("done"):
            return EpisodeResult(task_id, float(state.get("reward") or 0.0), step, invalid, True)
        if was_invalid:
            messages.append({"role": "user", "content": f"Invalid action: {action} changed nothing."})
        messages.append(user_turn(step + 1, max_steps, state))
    return EpisodeResult(task_id, 0.0, max_steps, invalid, False)


def request_url(exc: httpx.HTTPError) -> str:
    """Which server a failed call went to, so an error line says whom to blame."""
    try:
        return str(exc.request.url)
    except RuntimeError:  # httpx raises when the error carries no request
        return "?"


def play_safely(client: httpx.Client, env_url: str, policy_url: str, task_id: str, max_steps: int) -> EpisodeResult:
    """`play`, with an HTTP failure recorded as a zero-reward episode instead of ending the run."""
    try:
        return play(client, env_url, policy_url, task_id, max_steps)
    except httpx.HTTPError as exc:
        return EpisodeResult(task_id, 0.0, 0, 0, False, error=f"{type(exc).__name__} at {request_url(exc)}: {exc}")
    except (KeyError, ValueError) as exc:
        return EpisodeResult(task_id, 0.0, 0, 0, False, error=f"{type(exc).__name__}: {exc}")


def report(results: list[EpisodeResult], elapsed_s: float) -> dict[str, Any]:
    """Summary numbers, in the units WebShop papers use."""
    n = max(len(results), 1)
    summary: dict[str, Any] = {
        "episodes": len(results),
        "score": round(100.0 * sum(r.reward for r in results) / n, 2),
        "success_rate": round(100.0 * sum(r.reward >= 1.0 for r in results) / n, 2),
        "finished": sum(r.finished for r in results),
        "mean_steps": round(sum(r.steps for r in results) / n, 2),
        "invalid_actions": sum(r.invalid for r in results),
        "errors": sum(r.error is not None for r in results),
        "elapsed_s": round(elapsed_s, 1),
    }
    first_error = next((r.error for r in results if r.error), None)
    if first_error:
        summary["first_error"] = first_error
    return summary


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--split", default="test")
    parser.add_argument("--limit", type=int, default=500, help="number of tasks (default 500)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-steps", type=int, default=15)
    parser.add_argument("--env-url", help="use a running environment server instead of starting one")
    parser.add_argument("--policy-url", help="use a running policy server instead of starting one")
    parser.add_argument("--env-args", default="", help="extra arguments for `webshop_env serve`")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--json", dest="json_path", help="also write per-episode results here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    with ExitStack() as stack:
        env_url = args.env_url
        if not env_url:
            port = free_port()
            env_url = f"http://127.0.0.1:{port}"
            cmd = [PYTHON, "-m", "webshop_env", "serve", "--port", str(port), *args.env_args.split()]
            stack.enter_context(serving("webshop", cmd, f"{env_url}/health", timeout_s=args.startup_timeout))
        policy_url = args.policy_url
        if not policy_url:
            port = free_port()
            policy_url = f"http://127.0.0.1:{port}"
            cmd = [PYTHON, "-m", "webshop_env.policy", "--port", str(port)]
            stack.enter_context(serving("policy", cmd, f"{policy_url}/health", timeout_s=30.0))
        task_ids = load_task_ids(args.split, args.limit)
        limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency * 2)
        client = stack.enter_context(httpx.Client(timeout=60.0, limits=limits))
        started = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda t: play_safely(client, env_url, policy_url, t, args.max_steps), task_ids))
        summary = report(results, time.monotonic() - started)
    print(json.dumps(summary, indent=2))
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as fh:
            json.dump({"summary": summary, "episodes": [r.__dict__ for r in results]}, fh, indent=1)


if __name__ == "__main__":
    main()
