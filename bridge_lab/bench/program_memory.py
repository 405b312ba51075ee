"""Memory of Agent Lightning 1.0 agent programs started cold, as a worker starts them: the figure that sizes a
1.0 worker pod (docs/performance.md, "Memory of a 1.0 agent program").

One local stack (Redis, the WebShop server, the LLM stand-in answering in --llm-latency-ms) and a real
`agl-server` gateway from the 1.0 virtualenv; --programs WebShop rollouts are created on it, marked running
under attempt 0 as the dispatcher marks them, and each program is started at once, concurrently, with the
worker's own command line (``workers.v1.programs.ColdProgram``) and environment (``program_environment``) under
--python (default: this interpreter; ``v1`` for the 1.0 virtualenv that also holds this project, what the
``worker-agl-v1`` image runs programs under). Every --sample-s each live program's
``/proc/<pid>/smaps_rollup`` is read: RSS, PSS (shared pages divided among the processes sharing them) and
USS (private pages). Printed per program: the peak and the steady state (the median of the samples after the
first LLM answer, i.e. once the program imported what it imports and plays), in MiB.

    python -m bridge_lab.bench.program_memory                  # 8 programs, this interpreter
    python -m bridge_lab.bench.program_memory --python v1      # under the 1.0 virtualenv's Python 3.12
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.core.gateway import GatewayClient, V1Rollout, V1State
from bridge.core.settings import Settings, load_settings
from bridge_lab.agl_v1_env import start_gateway, v1_project_virtualenv, v1_virtualenv
from bridge_lab.bench.run import load_inputs
from bridge_lab.render import rows_table, show
from bridge_lab.stack import LocalStack, StackConfig
from workers.agents import webshop_program
from workers.v1.environment import program_environment
from workers.v1.programs import ColdProgram
from workers.v1.relay import process_relay

KEY = "program-memory"
FIELDS = {"Rss": "rss", "Pss": "pss", "Private_Clean": "uss", "Private_Dirty": "uss"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    add = parser.add_argument
    add("--programs", type=int, default=8, help="programs started at once (default 8)")
    add("--python", default=sys.executable, help="the programs' interpreter, or `v1` (default: this one)")
    add("--llm-latency-ms", type=float, default=300.0, help="stand-in latency per LLM call (default 300)")
    add("--sample-s", type=float, default=0.1, help="seconds between /proc samples (default 0.1)")
    add("--timeout-s", type=float, default=300.0, help="give up after this long (default 300)")
    add("--json", action="store_true", help="print the figures as JSON")


def smaps_kb(pid: int) -> dict[str, int] | None:
    """RSS, PSS and USS (kB) of ``pid`` from /proc/<pid>/smaps_rollup; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    found = {"rss": 0, "pss": 0, "uss": 0}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in FIELDS:
            found[FIELDS[name]] += int(rest.split()[0])
    return found if found["rss"] else None


@dataclass
class Program:
    rollout_id: str
    process: subprocess.Popen[bytes]
    samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)  # (time, kB) while it lives
    first_answer_at: float | None = None  # when the gateway first recorded an LLM call of its attempt

    def figures(self) -> dict[str, Any]:
        steady = [s for t, s in self.samples if self.first_answer_at is not None and t >= self.first_answer_at]
        steady = steady or [s for _, s in self.samples[len(self.samples) // 2 :]]
        mib = 1024.0
        out: dict[str, Any] = {"exit_code": self.process.returncode, "samples": len(self.samples)}
        for key in ("rss", "pss", "uss"):
            out[f"peak_{key}_mib"] = round(max((s[key] for _, s in self.samples), default=0) / mib, 1)
            out[f"steady_{key}_mib"] = round(statistics.median(s[key] for s in steady) / mib, 1) if steady else 0.0
        return out


def _interpreter(choice: str) -> str:
    if choice == "v1":
        return str(v1_project_virtualenv() / "bin/python")
    return choice


def _start(
    gateway: GatewayClient, rollout: V1Rollout, python: str, settings: Settings, worker_env: dict[str, str]
) -> Program:
    """Mark ``rollout`` running under attempt 0 and start its program as the worker does."""
    gateway.patch_status(rollout.rollout_id, state=V1State.RUNNING.value, last_attempt_id="0")
    grant = process_relay(settings.agl_v1_url, settings.agl_v1_key).grant(rollout, "0")  # as the worker's attempt
    env = program_environment(rollout, settings, attempt=grant.env, worker_env=worker_env)
    return Program(rollout.rollout_id, ColdProgram(python, webshop_program.AGENT_CLASS, env).process)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    python = _interpreter(args.python)
    config = StackConfig(store=False, bridge=False, workers=0, policy_latency_ms=args.llm_latency_ms)
    with LocalStack(config) as stack:
        url = start_gateway(stack, v1_virtualenv(), key=KEY)
        gateway = GatewayClient(url, key=KEY, timeout_s=30.0)
        local = {"agent_class": webshop_program.AGENT_CLASS, "env_map": webshop_program.ENV_MAP}
        batch = [
            {"rollout_id": secrets.token_hex(16), "input": item, "config": {"timeout_seconds": 600, "local": local}}
            for item in load_inputs("train", args.programs)
        ]
        rollouts = gateway.create_rollouts(batch)
        settings = load_settings(agl_v1_url=url, agl_v1_key=KEY, agl_v1_pass_env=webshop_program.PASS_ENV)
        worker_env = {name: os.environ[name] for name in ("PATH", "HOME", "LANG") if name in os.environ}
        worker_env["WEBSHOP_URL"] = stack.webshop_url
        programs = [_start(gateway, rollout, python, settings, worker_env) for rollout in rollouts]
        deadline = time.monotonic() + args.timeout_s
        try:
            _sample(programs, gateway, args.sample_s, deadline)
        finally:
            for program in programs:
                if program.process.poll() is None:
                    program.process.kill()
                    program.process.wait()
        each = [program.figures() for program in programs]
    summary = {key: round(statistics.mean(f[key] for f in each), 1) for key in each[0] if key.endswith("_mib")}
    return {
        "python": python,
        "version": subprocess.run([python, "-V"], capture_output=True, text=True).stdout.strip(),
        "programs": len(programs),
        "succeeded": sum(1 for f in each if f["exit_code"] == 0),
        "mean": summary,
        "max_peak_rss_mib": max(f["peak_rss_mib"] for f in each),
        "each": each,
    }


def _sample(programs: list[Program], gateway: GatewayClient, every_s: float, deadline: float) -> None:
    next_check = 0.0
    while any(p.process.poll() is None for p in programs):
        if time.monotonic() > deadline:
            raise TimeoutError("the programs did not end within --timeout-s")
        now = time.monotonic()
        for program in programs:
            if program.process.poll() is None and (kb := smaps_kb(program.process.pid)) is not None:
                program.samples.append((now, kb))
        if now >= next_check:  # once a second: which programs got their first LLM answer
            next_check = now + 1.0
            for program in (p for p in programs if p.first_answer_at is None):
                if gateway.events(program.rollout_id, event_type="model_request"):
                    program.first_answer_at = now
        time.sleep(every_s)


def main(args: argparse.Namespace) -> int:
    result = measure(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    mean = result["mean"]
    print(f"{result['programs']} programs ({result['succeeded']} exited 0) under {result['version']}:")
    rows = [
        {"kind": kind.upper(), "steady": f"{mean[f'steady_{kind}_mib']:.1f}", "peak": f"{mean[f'peak_{kind}_mib']:.1f}"}
        for kind in ("rss", "pss", "uss")
    ]
    columns = {"kind": "per program (MiB)", "steady": "steady state, mean", "peak": "peak, mean"}
    show(rows_table(rows, columns), sys.stdout)
    print(f"largest peak RSS of one program: {result['max_peak_rss_mib']:.1f} MiB")
    return 0 if result["succeeded"] == result["programs"] else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bridge_lab.bench.program_memory")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
