"""follow agl_bridge_desired_slots: start and stop local Celery worker processes

For hosts without Kubernetes (whose KEDA or HPA do this from the same series: deploy/kubernetes). Every
--interval it scrapes the bridges' /metrics (--metrics-url, repeatable: the leader exports the series, a
standby nothing), reads agl_bridge_desired_slots for --queue, and keeps ceil(desired / --slots-per-worker)
worker processes running, between --min-workers and --max-workers. It scales up at once and down only after
the lower target held for --scale-down-after seconds, one worker at a time, by SIGTERM: a warm shutdown that
withdraws the node's slots at once and finishes (or, with WORKER_SHUTDOWN_GRACE_S, hands back) its rollouts.
Without a reading (no leader, a scrape that fails) it keeps what runs. Workers get this process's
environment (.env included); the command after `--` replaces the default worker command, with {python},
{slots}, {queue} and {n} filled in. Ctrl-C or SIGTERM stops every worker it started, warm, and exits 0; if
it dies without that (SIGKILL), each worker it started gets SIGTERM, the same warm shutdown.
Recipes and measured scale-up times: docs/operations.md, "Autoscaling".
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("bridge.autoscale")

DESIRED = "agl_bridge_desired_slots"
DEFAULT_WORKER = "{python} -m celery -A workers worker -P threads -c {slots} -Q {queue} -n autoscaled{n}@%h -l INFO"
PR_SET_PDEATHSIG = 1
STOP_WAIT_S = 900.0  # a warm shutdown waits for its episodes; at exit we wait this long, then SIGKILL


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    add = parser.add_argument
    add("--metrics-url", action="append", required=True, help="a bridge's /metrics URL (repeat for standbys)")
    add("--queue", default="rollouts", help="the Celery queue to scale (default rollouts)")
    add("--slots-per-worker", type=int, default=8, help="slots each worker process offers, its -c (default 8)")
    add("--min-workers", type=int, default=0, help="never fewer (default 0)")
    add("--max-workers", type=int, default=8, help="never more (default 8)")
    add("--interval", type=float, default=2.0, help="seconds between readings (default 2)")
    add("--scale-down-after", type=float, default=60.0, help="a lower target must hold this long (default 60 s)")
    add(
        "command",
        nargs=argparse.REMAINDER,
        help="-- then the worker command (default: {})".format(
            DEFAULT_WORKER.replace("%", "%%")
        ),  # help is %-formatted
    )


@dataclass
class Policy:
    """How many workers a reading of desired slots asks for, with scale-down hysteresis."""

    slots_per_worker: int
    min_workers: int
    max_workers: int
    scale_down_after_s: float
    _lower_since: float | None = field(default=None, init=False)

    def target(self, desired: float | None, running: int, now: float) -> int:
        """Workers to run now: up at once, down by one once a lower target held ``scale_down_after_s``; the
        running count without a reading."""
        if desired is None:
            return max(self.min_workers, min(self.max_workers, running))
        wanted = max(self.min_workers, min(self.max_workers, math.ceil(max(0.0, desired) / self.slots_per_worker)))
        if wanted >= running:
            self._lower_since = None
            return wanted
        if self._lower_since is None:
            self._lower_since = now
        if now - self._lower_since < self.scale_down_after_s:
            return running
        self._lower_since = now  # the next step down waits a whole window again
        return running - 1


def desired_slots(text: str, queue: str) -> float | None:
    """The highest ``agl_bridge_desired_slots{queue=...}`` in a Prometheus exposition; None when absent."""
    values = [
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == DESIRED
        for sample in family.samples
        if sample.labels.get("queue") == queue
    ]
    return max(values) if values else None


def scrape_desired(http: httpx.Client, url: str, queue: str) -> float | None:
    """``desired_slots`` from one bridge's /metrics; None (logged) when it does not answer."""
    try:
        response = http.get(url)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        log.warning("could not read %s: %r", url, exc)
        return None
    return desired_slots(response.text, queue)


class Autoscaler:
    def __init__(self, args: argparse.Namespace, stop: threading.Event) -> None:
        self.args, self.stop = args, stop
        self.policy = Policy(args.slots_per_worker, args.min_workers, args.max_workers, args.scale_down_after)
        command = [part for part in args.command if part != "--"]
        self.template = command or DEFAULT_WORKER.split()
        self.workers: list[subprocess.Popen[bytes]] = []
        self._seq = 0
        self.http = httpx.Client(timeout=5.0)

    def reading(self) -> float | None:
        values = [scrape_desired(self.http, url, self.args.queue) for url in self.args.metrics_url]
        return max((v for v in values if v is not None), default=None)

    def step(self, now: float) -> None:
        for gone in [w for w in self.workers if w.poll() is not None]:
            log.warning("worker pid %d exited with code %s", gone.pid, gone.returncode)
            self.workers.remove(gone)
        desired = self.reading()
        target = self.policy.target(desired, len(self.workers), now)
        while len(self.workers) < target:
            self._start()
        if len(self.workers) > target:
            victim = self.workers.pop()
            log.info("desired %s slots: stopping worker pid %d (warm shutdown)", desired, victim.pid)
            victim.send_signal(signal.SIGTERM)

    def _start(self) -> None:
        self._seq += 1
        fill = {"python": sys.executable, "slots": self.args.slots_per_worker, "queue": self.args.queue, "n": self._seq}
        argv = [part.format(**fill) for part in self.template]
        # In this process's group: a Ctrl-C in the terminal, or a supervisor's signal to the group, reaches
        # the workers as well, and each starts its warm shutdown. If this process dies without its own stop
        # (SIGKILL, a crash), each worker gets SIGTERM from the kernel: the same warm shutdown, never an orphan.
        parent = os.getpid()
        self.workers.append(
            subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=lambda: _terminate_with(parent))
        )
        log.info("started worker %d (pid %d): %s", self._seq, self.workers[-1].pid, " ".join(argv))

    def run(self) -> None:
        while not self.stop.is_set():
            self.step(time.monotonic())
            self.stop.wait(self.args.interval)

    def close(self) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT_S
        for worker in self.workers:
            try:
                worker.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill()
        self.http.close()


def _terminate_with(parent: int) -> None:
    """In a started worker, before it runs: SIGTERM when the autoscaler dies (Linux ``PR_SET_PDEATHSIG``; the
    autoscaler starts workers from its main thread, whose end is the process's), at once if it already died."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def main(args: argparse.Namespace) -> int:
    if args.slots_per_worker < 1 or not 0 <= args.min_workers <= args.max_workers or args.interval <= 0:
        print(
            "error: need --slots-per-worker >= 1, 0 <= --min-workers <= --max-workers, --interval > 0", file=sys.stderr
        )
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    scaler = Autoscaler(args, stop)
    try:
        scaler.run()
    finally:
        scaler.close()
    return 0
