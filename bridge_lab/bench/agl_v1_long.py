"""``python -m bridge bench-v1 --long N``: a long run of short Agent Lightning 1.0 rollouts on ONE worker node
with warm starts, watching for what grows.

One local stack (Redis, the WebShop server and the LLM stand-in, unused but for the gateway's model), one real
`agl-server` from the 1.0 virtualenv, `python -m bridge v1` and one `celery -A workers worker -P POOL -c SLOTS`
whose TMPDIR is a directory of the run's own. N rollouts of a program that posts its rollout's reward and exits
(``bridge_lab.bench.reward_program``: milliseconds of work) are created on the gateway with 1.0's HTTP API, at
most 4 x SLOTS unfinished at a time. Every --sample-every finished rollouts the run lets the node go quiet (no
rollout unfinished, no in-flight entry in Redis, no program alive: up to 30 s) and samples:

  worker      RSS (main process + pool children) and open file descriptors (/proc/PID/fd) of the node's
              celery processes, and their threads;
  server      the node's program server: RSS, fds, and its pid (a replaced server would hide a leak);
  dispatcher  RSS and fds of `python -m bridge v1`;
  node        program directories in TMPDIR (agl-v1-programs-*: the live server's only), programs alive,
              in-flight entries left in Redis.

Verdict (exit 0 when it holds): every rollout succeeded on its first attempt with exactly its reward (one
reward event, the value it was given); no in-flight entry and no program left at any sample; at the end no
program directory but the live server's; one program server for the whole run; and from the first sample at or
after --warmup finished rollouts to every later one, RSS grew by at most --max-rss-growth-mib and fds by at most
--max-fd-growth, for the worker, the server and the dispatcher alike (the worker's fds: plus one per slot).
Seconds run from the first create to the last finish seen, the quiet pauses included. Figures and the bounds'
reasons: docs/performance.md, "A long run of 1.0 rollouts".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis

from bridge.core.coordination import coordination_client, keys
from bridge.core.gateway import GatewayClient, V1State
from bridge_lab.agl_v1_env import start_gateway, start_v1_dispatcher, v1_virtualenv
from bridge_lab.bench import reward_program
from bridge_lab.procs import StackError, free_port
from bridge_lab.render import key_value_table, rows_table, show
from bridge_lab.stack import LocalStack, StackConfig
from workers.v1.program_directories import DIRECTORY_PREFIX
from workers.v1.program_server import SERVER_MARKER

KEY = "bench-v1-long"
QUIET_WAIT_S = 30.0  # how long a sample waits for the node to go quiet before it records what is left
POLL_S = 0.2
MIB = 2**20
COLD_MARKER = "cold_main"  # in a cold program's command line (``workers.v1.programs.bootstrap``)


@dataclass(frozen=True)
class Bounds:
    """Growth allowed from the baseline sample to any later one (the measured figures and why these:
    docs/performance.md, "A long run of 1.0 rollouts").

    ``rss_mib`` and ``fds`` hold for each process group sampled (the worker's processes together, the program
    server, the dispatcher), but the worker's open files get ``fds`` plus one per slot: redis-py's pool in each
    pool process (or thread) grows to the most commands it ever had in flight at once, the task's and the
    heartbeat's, one more connection now and then until it has them all."""

    rss_mib: float = 8.0
    fds: int = 2
    slots: int = 0

    def limit(self, series: str) -> float:
        if series.endswith("_mib"):
            return self.rss_mib
        return self.fds + (self.slots if series == "worker_fds" else 0)


@dataclass(frozen=True)
class Sample:
    finished: int
    seconds: float
    worker_rss_mib: float
    worker_fds: int
    worker_threads: int
    worker_processes: int
    server_pid: int | None
    server_rss_mib: float | None
    server_fds: int | None
    dispatcher_rss_mib: float | None
    dispatcher_fds: int | None
    programs_alive: int
    program_dirs: int
    inflight: int


@dataclass(frozen=True)
class Outcome:
    """One finished rollout as the gateway tells it: its state, its current attempt and its reward events."""

    rollout_id: str
    expected_reward: float
    state: str
    attempt_id: str | None
    rewards: tuple[float, ...]
    error: str | None = None


@dataclass
class LongRun:
    total: int
    samples: list[Sample] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float | None = None
    quiet_s: float = 0.0  # spent waiting for the node to go quiet before the samples


# --- what a sample reads -------------------------------------------------------------------------


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _rss_fds(process: psutil.Process) -> tuple[float, int]:
    return process.memory_info().rss / MIB, process.num_fds()


class NodeProbe:
    """Reads one worker node (its main process's pid), the dispatcher's pid, the node's TMPDIR and the
    deployment's in-flight sets in Redis."""

    def __init__(self, worker_pid: int, dispatcher_pid: int | None, tmpdir: Path, client: redis.Redis, scope: str):
        self.worker_pid, self.dispatcher_pid, self.tmpdir = worker_pid, dispatcher_pid, tmpdir
        self.client, self.scope = client, scope

    def inflight(self) -> int:
        return sum(int(self.client.zcard(k)) for k in self.client.scan_iter(match=keys.inflight(self.scope, "*")))

    def program_dirs(self) -> int:
        return sum(1 for entry in self.tmpdir.iterdir() if entry.name.startswith(DIRECTORY_PREFIX))

    def processes(self) -> tuple[list[psutil.Process], psutil.Process | None, int]:
        """The node's celery processes (the main one and its pool children), its program server, and how many
        other processes are alive below the main one (programs, cold or warm, and whatever they started). The
        server and the pool children are the main process's children; so is a cold program (``cold_main``) under
        ``-P threads``."""
        main = psutil.Process(self.worker_pid)
        workers, server = [main], None
        for child in main.children():
            try:
                line = " ".join(child.cmdline())
            except psutil.Error:
                continue
            if SERVER_MARKER in line and server is None:
                server = child
            elif COLD_MARKER not in line:
                workers.append(child)
        known = {p.pid for p in workers} | ({server.pid} if server is not None else set())
        others = sum(1 for p in main.children(recursive=True) if p.pid not in known and _alive(p))
        return workers, server, others

    def sample(self, finished: int, seconds: float) -> Sample:
        workers, server, programs = self.processes()
        worker_rss, worker_fds, threads = 0.0, 0, 0
        for process in workers:
            rss, fds = _rss_fds(process)
            worker_rss, worker_fds, threads = worker_rss + rss, worker_fds + fds, threads + process.num_threads()
        server_rss, server_fds = _rss_fds(server) if server is not None else (None, None)
        dispatcher_rss, dispatcher_fds = (
            _rss_fds(psutil.Process(self.dispatcher_pid)) if self.dispatcher_pid else (None, None)
        )
        return Sample(
            finished=finished,
            seconds=round(seconds, 1),
            worker_rss_mib=round(worker_rss, 2),
            worker_fds=worker_fds,
            worker_threads=threads,
            worker_processes=len(workers),
            server_pid=server.pid if server is not None else None,
            server_rss_mib=None if server_rss is None else round(server_rss, 2),
            server_fds=server_fds,
            dispatcher_rss_mib=None if dispatcher_rss is None else round(dispatcher_rss, 2),
            dispatcher_fds=dispatcher_fds,
            programs_alive=programs,
            program_dirs=self.program_dirs(),
            inflight=self.inflight(),
        )

    def quiet(self) -> bool:
        return self.inflight() == 0 and self.processes()[2] == 0


# --- the run -------------------------------------------------------------------------------------


def expected_reward(index: int) -> float:
    """Rollout ``index``'s reward: distinct among neighbours, exact through JSON (a few decimal digits)."""
    return (index % 1000) / 1000


@dataclass(frozen=True)
class Plan:
    """What a long run does: ``total`` rollouts, at most ``backlog`` unfinished at a time, a sample every
    ``sample_every`` finished; it gives up after ``timeout_s``. Each rollout's own ``timeout_seconds``."""

    total: int
    sample_every: int
    backlog: int
    timeout_s: float = 3600.0
    timeout_seconds: int = 60


def run_long(
    gateway: GatewayClient, probe: NodeProbe, plan: Plan, say: Callable[[str], None] = lambda _message: None
) -> LongRun:
    """Create the plan's rollouts of the reward program on ``gateway`` and follow them; a sample before the first
    and after every ``plan.sample_every`` finished (and the last), each once the node is quiet. Stops early at
    ``plan.timeout_s``."""
    total, sample_every, backlog = plan.total, plan.sample_every, plan.backlog
    timeout_s, timeout_seconds = plan.timeout_s, plan.timeout_seconds
    local = {"agent_class": reward_program.AGENT_CLASS, "env_map": reward_program.ENV_MAP}
    config: dict[str, Any] = {"timeout_seconds": timeout_seconds, "local": local}
    result = LongRun(total)
    began = time.monotonic()
    deadline = began + timeout_s
    result.samples.append(probe.sample(0, 0.0))
    unfinished: dict[str, float] = {}  # rollout id -> its reward
    created, last_finish, next_sample = 0, began, min(sample_every, total)
    while len(result.outcomes) < total and time.monotonic() < deadline:
        wave = min(backlog - len(unfinished), next_sample - created)
        if wave > 0:
            batch = [
                {"input": {"reward": expected_reward(i)}, "is_train": True, "config": config}
                for i in range(created, created + wave)
            ]
            for index, rollout in enumerate(gateway.create_rollouts(batch), start=created):
                unfinished[rollout.rollout_id] = expected_reward(index)
            created += wave
        time.sleep(POLL_S)
        live = {r.rollout_id for r in gateway.list_rollouts(V1State.QUEUING, V1State.RUNNING, limit=100_000)}
        for rollout_id in [rid for rid in unfinished if rid not in live]:
            result.outcomes.append(_outcome(gateway, rollout_id, unfinished.pop(rollout_id)))
            last_finish = time.monotonic()
        if len(result.outcomes) >= next_sample:
            quiet_from = time.monotonic()
            while not probe.quiet() and time.monotonic() - quiet_from < QUIET_WAIT_S:
                time.sleep(POLL_S)
            result.quiet_s += time.monotonic() - quiet_from
            result.samples.append(probe.sample(len(result.outcomes), time.monotonic() - began))
            say(_progress(result.samples[-1]))
            next_sample = min(next_sample + sample_every, total)
    result.seconds = round(last_finish - began, 2) if result.outcomes else None
    return result


def _outcome(gateway: GatewayClient, rollout_id: str, reward: float) -> Outcome:
    rollout = gateway.get_rollout(rollout_id)
    if rollout is None:
        return Outcome(rollout_id, reward, "deleted", None, ())
    events = gateway.events(rollout_id, event_type="reward")
    rewards = tuple(float(e.get("data", {}).get("value", "nan")) for e in events)
    status = rollout.status
    return Outcome(rollout_id, reward, status.state.value, status.last_attempt_id, rewards, status.error_message)


def _progress(sample: Sample) -> str:
    return (
        f"{sample.finished} finished, {sample.seconds} s: worker {sample.worker_rss_mib} MiB {sample.worker_fds} fds, "
        f"server {sample.server_rss_mib} MiB {sample.server_fds} fds, dispatcher {sample.dispatcher_rss_mib} MiB, "
        f"{sample.program_dirs} program dirs, {sample.inflight} in flight"
    )


# --- the verdict ---------------------------------------------------------------------------------

SERIES = {  # what each bound applies to: the sample's field, and how the verdict names it
    "worker_rss_mib": "worker RSS",
    "server_rss_mib": "program server RSS",
    "dispatcher_rss_mib": "dispatcher RSS",
    "worker_fds": "worker fds",
    "server_fds": "program server fds",
    "dispatcher_fds": "dispatcher fds",
}


def baseline(samples: list[Sample], warmup: int) -> Sample | None:
    """The first sample at or after ``warmup`` finished rollouts: where growth is counted from."""
    return next((s for s in samples if s.finished >= warmup), None)


def growth(samples: list[Sample], warmup: int) -> dict[str, float | None]:
    """Per series of ``SERIES``: the largest rise from the baseline sample to any later one (0 when none rose;
    None without a baseline, a later sample, or the series)."""
    base = baseline(samples, warmup)
    if base is None:
        return dict.fromkeys(SERIES)
    later = [s for s in samples if s.finished > base.finished]
    grown: dict[str, float | None] = {}
    for name in SERIES:
        start = getattr(base, name)
        values = [getattr(s, name) for s in later if getattr(s, name) is not None]
        grown[name] = None if start is None or not values else round(max(0, max(values) - start), 2)
    return grown


def slope_per_1000(samples: list[Sample], warmup: int, name: str) -> float | None:
    """The least-squares trend of series ``name`` per 1,000 rollouts over the baseline and later samples."""
    base = baseline(samples, warmup)
    points = [(s.finished, getattr(s, name)) for s in samples if base and s.finished >= base.finished]
    points = [(x, y) for x, y in points if y is not None]
    if len(points) < 3:
        return None
    fit = statistics.linear_regression([float(x) for x, _ in points], [float(y) for _, y in points])
    return round(1000 * fit.slope, 2)


def verdict(run: LongRun, warmup: int, bounds: Bounds) -> list[str]:
    """What is wrong with the run, one line each; empty when it passed."""
    problems: list[str] = []
    if len(run.outcomes) < run.total:
        problems.append(f"{run.total - len(run.outcomes)} of {run.total} rollouts did not finish")
    failed = [o for o in run.outcomes if o.state != V1State.SUCCEEDED.value]
    if failed:
        first = failed[0]
        problems.append(f"{len(failed)} rollouts did not succeed (first: {first.state}, {first.error!r})")
    wrong = [o for o in run.outcomes if o.rewards != (o.expected_reward,)]
    if wrong:
        problems.append(f"{len(wrong)} rollouts' reward events are not exactly their reward (first: {wrong[0]})")
    reruns = [o for o in run.outcomes if o.attempt_id not in (None, "0")]
    if reruns:
        problems.append(f"{len(reruns)} rollouts ran again (first: attempt {reruns[0].attempt_id})")
    for s in run.samples:
        if s.inflight or s.programs_alive:
            problems.append(f"at {s.finished}: {s.inflight} in-flight entries and {s.programs_alive} programs left")
    if run.samples and run.samples[-1].program_dirs > 1:
        problems.append(f"{run.samples[-1].program_dirs - 1} program directories left beside the live server's")
    servers = {s.server_pid for s in run.samples}
    if len(servers) != 1 or None in servers:
        problems.append(f"the program server did not stay one process: {sorted(map(str, servers))}")
    base = baseline(run.samples, warmup)
    if base is None or base is run.samples[-1]:
        problems.append(f"no sample after the baseline at {warmup} rollouts: growth not measured")
    for name, grown in growth(run.samples, warmup).items():
        limit = bounds.limit(name)
        if grown is not None and grown > limit:
            problems.append(f"{SERIES[name]} grew by {grown} after {warmup} rollouts (bound {limit})")
    return problems


def summary(run: LongRun, warmup: int, bounds: Bounds) -> dict[str, Any]:
    """The run's figures: counts, time, rate, the baseline and last samples, growth, trends, the verdict."""
    base, last = baseline(run.samples, warmup), (run.samples[-1] if run.samples else None)
    ok = sum(o.state == V1State.SUCCEEDED.value for o in run.outcomes)
    rate = round(len(run.outcomes) / run.seconds, 2) if run.seconds else None
    problems = verdict(run, warmup, bounds)
    return {
        "rollouts": run.total,
        "finished": len(run.outcomes),
        "succeeded": ok,
        "seconds": run.seconds,
        "quiet_s": round(run.quiet_s, 1),
        "rollouts_per_s": rate,
        "warmup": warmup,
        "bounds": asdict(bounds),
        "baseline": asdict(base) if base else None,
        "last": asdict(last) if last else None,
        "growth": growth(run.samples, warmup),
        "slope_per_1000": {name: slope_per_1000(run.samples, warmup, name) for name in SERIES},
        "problems": problems,
        "verdict": "pass" if not problems else "FAIL",
    }


COLUMNS = {
    "finished": "finished",
    "seconds": "s",
    "worker_rss_mib": "worker RSS MiB",
    "worker_fds": "worker fds",
    "worker_threads": "threads",
    "worker_processes": "procs",
    "server_rss_mib": "server RSS MiB",
    "server_fds": "server fds",
    "dispatcher_rss_mib": "dispatcher RSS MiB",
    "dispatcher_fds": "dispatcher fds",
    "program_dirs": "program dirs",
    "programs_alive": "programs",
    "inflight": "in flight",
}


# --- the command ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``bench-v1``'s options for ``--long`` (``bridge_lab.bench.agl_v1`` adds them to its own)."""
    add = parser.add_argument
    add("--long", type=int, default=None, metavar="N", help="a long run instead: N short rollouts on one node")
    add("--pool", choices=["prefork", "threads"], default="prefork", help="--long: the worker's pool (prefork)")
    add("--sample-every", type=int, default=100, help="--long: sample every this many rollouts (default 100)")
    add("--warmup", type=int, default=200, help="--long: growth counts from this many rollouts (default 200)")
    add("--max-rss-growth-mib", type=float, default=Bounds.rss_mib, help="--long: RSS bound per process group")
    add("--max-fd-growth", type=int, default=Bounds.fds, help="--long: open files bound (the worker's: + --slots)")


def main(args: argparse.Namespace) -> int:
    if args.long < 1 or args.sample_every < 1 or args.slots < 1:
        print("error: --long, --sample-every and --slots must be at least 1", file=sys.stderr)
        return 2
    venv = built_virtualenv(v1_virtualenv)
    if venv is None:
        return 2
    port = free_port()
    config = StackConfig(
        store=False,
        workers=0,
        concurrency=args.slots,
        pool=args.pool,
        bridge=False,
        log_dir=args.log_dir,
        extra_env={"AGL_V1_SERVER_URL": f"http://127.0.0.1:{port}", "AGL_V1_KEY": KEY, "LOG_LEVEL": "INFO"},
    )
    bounds = Bounds(args.max_rss_growth_mib, args.max_fd_growth, args.slots)
    with LocalStack(config) as stack:
        tmpdir = stack.log_dir / "tmp"  # the node's TMPDIR: its program directories are counted there
        tmpdir.mkdir(exist_ok=True)
        stack.config.extra_env["TMPDIR"] = str(tmpdir)
        print(f"logs of every process: {stack.log_dir}", file=sys.stderr)
        plan = Plan(args.long, args.sample_every, 4 * args.slots, args.timeout_s or 3600.0)
        run = long_run(stack, venv, port, tmpdir, plan, say=lambda line: print(line, file=sys.stderr))
    figures = summary(run, args.warmup, bounds)
    show(rows_table([asdict(s) for s in run.samples], COLUMNS), sys.stdout)
    show(key_value_table(_verdict_rows(figures), title="verdict"), sys.stdout)
    if args.json:
        print(json.dumps({**figures, "samples": [asdict(s) for s in run.samples]}))
    return 0 if not figures["problems"] else 1


def built_virtualenv(build: Callable[[], Path]) -> Path | None:
    """``build()``'s virtualenv (``bridge_lab.agl_v1_env``), or None once it said why it cannot be built."""
    try:
        return build()
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def long_run(
    stack: LocalStack, venv: Path, port: int, tmpdir: Path, plan: Plan, say: Callable[[str], None] = print
) -> LongRun:
    """On a started ``stack`` whose extra_env names the gateway's URL (on ``port``) and the node's TMPDIR
    (``tmpdir``): the gateway, one worker, the dispatcher, then ``run_long``."""
    gateway_url = start_gateway(stack, venv, key=KEY, port=port)
    worker = stack.add_worker()
    dispatcher = start_v1_dispatcher(stack, gateway_url, key=KEY)
    client = coordination_client(stack.redis_url or stack.broker_url, socket_timeout=5)
    probe = NodeProbe(worker.pid or 0, dispatcher.pid, tmpdir, client, stack.scope)
    gateway = GatewayClient(gateway_url, key=KEY, timeout_s=30.0)
    try:
        return run_long(gateway, probe, plan, say)
    finally:
        gateway.close()
        client.close()


def _verdict_rows(figures: dict[str, Any]) -> list[tuple[str, object]]:
    grown, slopes = figures["growth"], figures["slope_per_1000"]
    rows: list[tuple[str, object]] = [
        ("rollouts", f"{figures['succeeded']} of {figures['rollouts']} succeeded"),
        ("seconds", f"{figures['seconds']} ({figures['quiet_s']} of them waiting for quiet samples)"),
        ("rollouts/s", figures["rollouts_per_s"]),
    ]
    rows += [
        (f"{label} growth after {figures['warmup']}", f"{grown[name]} (trend {slopes[name]} per 1,000 rollouts)")
        for name, label in SERIES.items()
    ]
    rows.append(("verdict", figures["verdict"] + "".join(f"\n  {p}" for p in figures["problems"])))
    return rows
