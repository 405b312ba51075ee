"""Agent Lightning 1.0 rollouts on our workers, side by side with 1.0's own `runner_type=local`

One local stack (Redis, the WebShop server, the LLM stand-in with --llm-latency-ms per call) and one real
`agl-server` gateway from the 1.0 virtualenv. The same workload, --rollouts WebShop episodes as 1.0 agent
programs (workers.agents.webshop_program), is enqueued by 1.0's own trainer client and run by:

  celery  `python -m bridge v1` and one `celery -A workers worker -P threads -c SLOTS`, once for each start of
          --program-start: warm (forked from the node's program server), warm-agent (the same, the program's
          own module preloaded too: AGL_V1_PRELOAD_AGENTS), cold (`python -c`), each program in its box, and
          warm-unboxed (warm with AGL_V1_ISOLATION=none: what the boxes cost);
  local   1.0's `agl-controller runner_type=local`, SLOTS subprocesses, polling every --local-poll-s.

With --restart, each runs the workload again with its controller (our dispatcher; 1.0's controller) stopped with
--restart-signal once a third of the rollouts finished, and started again: what each does with the rollouts that
were running. With --pause-s, every run has the gateway's proxy paused that long once a third of the rollouts
finished, as 1.0's trainer pauses it around a weight update. Figures: seconds from the first enqueue to the last
finish (the gateway's times), throughput, peak RSS of the executor's process tree (agent programs included, a page
shared by several counted in each; the gateway is shared and not counted) and its peak PSS (shared pages split:
what the tree holds), its CPU per rollout, the memory of one agent program (RSS, PSS and USS: its own pages;
medians of samples of the programs running), the program server's RSS and own CPU per rollout (what a fork costs
it), and the failures by message. Needs Python >= 3.12 (exit 2 without). Figures and what they mean:
docs/agl-v1.md, "Beside 1.0's local runner", and docs/performance.md.

With --long N, a long run instead: N short rollouts on one worker node with warm starts, its memory, open files,
program directories and in-flight entries sampled as it goes, and a verdict on their growth
(``bridge_lab.bench.agl_v1_long``).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from bridge.core.gateway import GatewayClient, V1State
from bridge_lab.agl_v1_env import (
    start_gateway,
    start_local_controller,
    start_v1_dispatcher,
    train,
    v1_project_virtualenv,
)
from bridge_lab.bench import agl_v1_long
from bridge_lab.bench import metrics as bm
from bridge_lab.bench.run import load_inputs
from bridge_lab.procs import ManagedProcess, free_port
from bridge_lab.render import rows_table, show
from bridge_lab.stack import LocalStack, StackConfig
from workers.agents import webshop_program
from workers.v1.program_server import SERVER_MARKER

KEY = "bench-v1"
AGENT_MODULE = webshop_program.AGENT_CLASS.partition(":")[0]
_BOXED = {"AGL_V1_ISOLATION": "box"}
STARTS: dict[str, dict[str, str]] = {  # the worker's settings for each way ours starts programs
    "warm": {"AGL_V1_WARM_START": "true", "AGL_V1_PRELOAD_AGENTS": "false", "AGL_V1_AGENT_MODULES": "", **_BOXED},
    "warm-agent": {
        "AGL_V1_WARM_START": "true",
        "AGL_V1_PRELOAD_AGENTS": "true",
        "AGL_V1_AGENT_MODULES": AGENT_MODULE,
        **_BOXED,
    },
    "cold": {"AGL_V1_WARM_START": "false", "AGL_V1_PRELOAD_AGENTS": "false", "AGL_V1_AGENT_MODULES": "", **_BOXED},
    # warm without boxes (AGL_V1_ISOLATION=none): what containment costs (docs/agl-v1.md, "Boxes")
    "warm-unboxed": {
        "AGL_V1_WARM_START": "true",
        "AGL_V1_PRELOAD_AGENTS": "false",
        "AGL_V1_AGENT_MODULES": "",
        "AGL_V1_ISOLATION": "none",
    },
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    add = parser.add_argument
    add("--rollouts", type=int, default=40, help="WebShop rollouts per run (default 40)")
    add("--slots", type=int, default=8, help="execution slots of each executor (default 8)")
    add("--llm-latency-ms", type=float, default=300.0, help="stand-in latency per LLM call (default 300)")
    add("--local-poll-s", type=float, default=1.0, help="1.0 controller's poll interval (its default is 10; ours 1)")
    add("--restart", action="store_true", help="also a run per executor with its controller restarted mid-run")
    add("--restart-signal", choices=["TERM", "KILL"], default="TERM", help="how the controller stops (default TERM)")
    add(
        "--pause-s",
        type=float,
        default=0.0,
        help="in every run, pause the gateway's proxy (/proxy/pause, as 1.0's trainer does around a weight update) "
        "for this long once a third of the rollouts finished (default 0: no pause)",
    )
    add(
        "--program-start",
        nargs="+",
        choices=list(STARTS),
        default=["warm"],
        help="ours: a run for each way to start programs listed (default warm)",
    )
    add("--split", default="train", help="WebShop task split (default train)")
    add("--timeout-s", type=float, default=None, help="give up a run after this long (default 600; --long 3600)")
    add("--log-dir", type=Path, default=None, help="where component logs go (default: a temp dir)")
    add("--json", action="store_true", help="print the figures as one JSON object on the last line")
    agl_v1_long.add_arguments(parser)


def main(args: argparse.Namespace) -> int:
    if args.long is not None:
        return agl_v1_long.main(args)
    args.timeout_s = args.timeout_s or 600.0
    if args.rollouts < 3 or args.slots < 1:
        print("error: --rollouts must be at least 3 and --slots at least 1", file=sys.stderr)
        return 2
    venv = agl_v1_long.built_virtualenv(v1_project_virtualenv)
    if venv is None:
        return 2
    port = free_port()
    env = {"AGL_V1_SERVER_URL": f"http://127.0.0.1:{port}", "AGL_V1_KEY": KEY, "LOG_LEVEL": "INFO"}
    env["AGL_V1_PASS_ENV"] = webshop_program.PASS_ENV  # what the WebShop program reads of the worker's settings
    config = StackConfig(
        store=False,
        workers=0,
        concurrency=args.slots,
        pool="threads",
        bridge=False,
        policy_latency_ms=args.llm_latency_ms,
        log_dir=args.log_dir,
        extra_env=env,
    )
    results: list[dict[str, Any]] = []
    with LocalStack(config) as stack:
        gateway = start_gateway(stack, venv, key=KEY, port=port)
        print(f"logs of every process: {stack.log_dir}", file=sys.stderr)
        bench = Bench(stack, venv, gateway, args)
        restarts = [False, True] if args.restart else [False]
        runs = [("celery", start) for start in dict.fromkeys(args.program_start)] + [("local", "")]
        for executor, start in runs:
            for restart in restarts:
                stack.config.extra_env.update(STARTS.get(start, {}))
                results.append(bench.run(executor, restart, start))
                print(f"{results[-1]['run']}: {results[-1]['seconds']} s", file=sys.stderr)
    show(rows_table(results, COLUMNS), sys.stdout)
    if args.json:
        print(json.dumps({"runs": results}))
    steady = [r for r in results if not r["restarted"]]
    return 0 if all(r["succeeded"] == r["rollouts"] for r in steady) else 1


COLUMNS = {
    "run": "run",
    "rollouts": "rollouts",
    "succeeded": "ok",
    "failed": "failed",
    "seconds": "seconds",
    "throughput_per_s": "rollouts/s",
    "peak_rss_mb": "peak RSS MB",
    "peak_pss_mb": "peak PSS MB",
    "cpu_ms_per_rollout": "CPU ms/rollout",
    "program_rss_mb": "program RSS MB",
    "program_pss_mb": "program PSS MB",
    "program_uss_mb": "program USS MB",
    "server_rss_mb": "server RSS MB",
    "server_cpu_ms_per_rollout": "server CPU ms/rollout",
    "mean_reward": "mean reward",
    "failures": "failures",
}


class Bench:
    def __init__(self, stack: LocalStack, venv: Path, gateway: str, args: argparse.Namespace) -> None:
        self.stack, self.venv, self.gateway, self.args = stack, venv, gateway, args
        self.inputs = load_inputs(args.split, args.rollouts)

    def run(self, executor: str, restart: bool, start: str = "") -> dict[str, Any]:
        """One run of the workload by ``executor``, its controller restarted mid-run if asked; stopped after."""
        controller, roots = self._start(executor)
        sampler = bm.MemorySampler({executor: roots}).start()
        programs = ProgramMemory(roots).start()
        watch = bm.Stopwatch({executor: roots})
        faults = []
        if restart:
            faults.append(threading.Thread(target=self._restart, args=(executor, controller, roots), daemon=True))
        if self.args.pause_s > 0:
            faults.append(threading.Thread(target=self._pause, daemon=True))
        for fault in faults:
            fault.start()
        try:
            done = train(self.venv, self._spec(), timeout_s=self.args.timeout_s)
        finally:
            for fault in faults:
                fault.join(120 + self.args.pause_s)
            cpu = watch.cpu()[executor]
            sampler.stop()
            programs.stop()
            self._stop(executor)
        name = f"{executor} (controller SIG{self.args.restart_signal} mid-run)" if restart else executor
        name += f", {start}" if start else ""
        name += f", proxy paused {self.args.pause_s:g} s" if self.args.pause_s > 0 else ""
        # A restarted controller's own CPU leaves with it: CPU is given for the steady runs only.
        row = figures(name, executor, restart, done, sampler.peak_total[executor], None if restart else cpu)
        memory = programs.figures()
        server_cpu_s = memory.pop("server_cpu_s") or 0.0
        per_fork = round(1000 * server_cpu_s / len(done), 2) if server_cpu_s and done else None
        return {**row, **memory, "server_cpu_ms_per_rollout": per_fork}

    def _spec(self) -> dict[str, Any]:
        return {
            "gateway": self.gateway,
            "key": KEY,
            "model_endpoint": self.stack.llm_base_url,
            "agent_class": webshop_program.AGENT_CLASS,
            "env_map": webshop_program.ENV_MAP,
            "timeout_s": 300,
            "tasks": self.inputs,
        }

    def _start(self, executor: str) -> tuple[Callable[[], ManagedProcess], list[int]]:
        """The executor's processes; returns how to start its controller again and its process roots."""
        if executor == "celery":
            worker = self.stack.add_worker()

            def controller() -> ManagedProcess:
                return start_v1_dispatcher(self.stack, self.gateway, key=KEY)
        else:
            worker = None

            def controller() -> ManagedProcess:
                return start_local_controller(
                    self.stack, self.venv, self.gateway, key=KEY, slots=self.args.slots, poll_s=self.args.local_poll_s
                )

        started = controller()
        return controller, [p.pid or 0 for p in (worker, started) if p is not None]

    def _a_third_finished(self) -> None:
        """Wait (at most the run's timeout) until a third of the rollouts finished."""
        gateway = GatewayClient(self.gateway, key=KEY)
        try:
            deadline = time.monotonic() + self.args.timeout_s
            while time.monotonic() < deadline:
                unfinished = len(gateway.list_rollouts(V1State.QUEUING, V1State.RUNNING))
                if unfinished and self.args.rollouts - unfinished >= self.args.rollouts // 3:
                    break
                time.sleep(0.2)
        finally:
            gateway.close()

    def _pause(self) -> None:
        """Once a third of the rollouts finished: pause the gateway's proxy for ``--pause-s``, then resume it."""
        self._a_third_finished()
        headers = {"Authorization": f"Bearer {KEY}"}
        body = {"retry_after_seconds": 5, "reason": "bench-v1 --pause-s"}
        httpx.post(f"{self.gateway}/proxy/pause", json=body, headers=headers, timeout=30).raise_for_status()
        try:
            time.sleep(self.args.pause_s)
        finally:
            httpx.post(f"{self.gateway}/proxy/resume", headers=headers, timeout=30).raise_for_status()

    def _restart(self, executor: str, controller: Callable[[], ManagedProcess], roots: list[int]) -> None:
        """Once a third of the rollouts finished: stop the controller with the signal asked for, start it again."""
        self._a_third_finished()
        old = self.stack.process(_controller_name(executor))
        old.signal(getattr(signal, f"SIG{self.args.restart_signal}"))
        if old.proc is not None:
            old.proc.wait(30)
        roots.append(controller().pid or 0)

    def _stop(self, executor: str) -> None:
        self.stack.process(_controller_name(executor)).stop()
        for worker in list(self.stack.workers):
            worker.stop()
            self.stack.workers.remove(worker)


def figures(
    name: str, executor: str, restarted: bool, done: list[dict[str, Any]], peak_mb: float, cpu_s: float | None
) -> dict[str, Any]:
    """One run's row from the trainer client's finished rollouts (``bridge_lab.agl_v1_trainer``): time from
    the first enqueue to the last finish by the gateway's clock, throughput, failures grouped by first line."""
    finished = [r["finished_at"] for r in done if r.get("finished_at")]
    enqueued = [r["enqueued_at"] for r in done if r.get("enqueued_at")]
    seconds = max(finished) - min(enqueued) if finished and enqueued else None
    ok = [r for r in done if r["state"] == V1State.SUCCEEDED]
    rewards = [float(r["reward"] or 0.0) for r in ok]
    failed = [str(r["error"] or "(no error)").splitlines()[0][:80] for r in done if r["state"] != V1State.SUCCEEDED]
    return {
        "run": name,
        "executor": executor,
        "restarted": restarted,
        "rollouts": len(done),
        "succeeded": len(ok),
        "failed": len(failed),
        "seconds": round(seconds, 2) if seconds else None,
        "throughput_per_s": round(len(done) / seconds, 3) if seconds else None,
        "peak_rss_mb": round(peak_mb, 1),
        "cpu_ms_per_rollout": None if cpu_s is None else round(1000 * cpu_s / max(1, len(done)), 1),
        "mean_reward": round(sum(rewards) / len(rewards), 3) if rewards else None,
        "failures": "; ".join(f"{n} x {message}" for message, n in Counter(failed).most_common()) or "-",
    }


class ProgramMemory:
    """Samples memory in a process tree every second: of each agent program (a process whose command line names
    the WebShop program: a cold start, 1.0's local runner; or a child of a program server: a warm start, whose
    fork keeps its server's command line), of the program server, and the tree's PSS (shared pages split among
    the processes that share them: what the tree really holds)."""

    def __init__(self, roots: list[int], interval_s: float = 1.0) -> None:
        self.roots, self.interval_s = roots, interval_s
        self.rss: list[float] = []
        self.pss: list[float] = []
        self.uss: list[float] = []
        self.server_rss = 0.0
        self.server_cpu: dict[int, tuple[float, float]] = {}  # pid -> its own CPU (children not) first, last seen
        self.peak_pss = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-programs", daemon=True)

    def start(self) -> ProgramMemory:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            total = 0.0
            for pid in bm.tree(self.roots):
                try:
                    process = psutil.Process(pid)
                    kind = self._kind(process)
                    info = process.memory_full_info()
                except psutil.Error:
                    continue
                total += info.pss / 2**20
                if kind == "program":
                    self.rss.append(info.rss / 2**20)
                    self.pss.append(info.pss / 2**20)
                    self.uss.append(info.uss / 2**20)
                elif kind == "server":
                    self.server_rss = max(self.server_rss, info.rss / 2**20)
                    times = process.cpu_times()
                    first = self.server_cpu.get(pid, (times.user + times.system, 0.0))[0]
                    self.server_cpu[pid] = (first, times.user + times.system)
            self.peak_pss = max(self.peak_pss, total)

    @staticmethod
    def _kind(process: psutil.Process) -> str | None:
        command = " ".join(process.cmdline())
        if SERVER_MARKER in command:
            parent = process.parent()
            return "program" if parent is not None and SERVER_MARKER in " ".join(parent.cmdline()) else "server"
        return "program" if webshop_program.AGENT_CLASS in command else None

    def figures(self) -> dict[str, float | None]:
        return {
            "peak_pss_mb": round(self.peak_pss, 1),
            "program_rss_mb": round(statistics.median(self.rss), 1) if self.rss else None,
            "program_pss_mb": round(statistics.median(self.pss), 1) if self.pss else None,
            "program_uss_mb": round(statistics.median(self.uss), 1) if self.uss else None,
            "server_rss_mb": round(self.server_rss, 1) if self.server_rss else None,
            "server_cpu_s": round(sum(last - first for first, last in self.server_cpu.values()), 3),
            "program_samples": len(self.rss),
        }


def _controller_name(executor: str) -> str:
    return "v1-dispatcher" if executor == "celery" else "agl-controller"
