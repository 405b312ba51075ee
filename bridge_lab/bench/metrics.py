"""What ``python -m bridge bench`` reads to compute its figures: process trees (psutil) and Prometheus counters.

CPU and memory come from whole process trees (a prefork worker is a parent plus its pool children),
read through ``psutil``, so nothing is estimated. Store requests come from the Store's own counters
(``agl store --tracker prometheus`` serves ``agl_http_total`` at ``/v1/prometheus/``), so every client
is counted, ours and the SDK runner's alike.
"""

from __future__ import annotations

import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

from bridge_lab.stats import mean, percentile

__all__ = ["mean", "percentile"]  # re-exported: the benchmark's figures use the lab's one implementation

_HTTP_TOTAL = re.compile(r"^agl_http_total\{(?P<labels>.*)\}\s+(?P<value>[0-9.eE+-]+)$")  # paths hold {rollout_id}
_LABEL = re.compile(r'(\w+)="([^"]*)"')


# --- process trees -------------------------------------------------------------------------------


def tree(roots: Iterable[int]) -> list[int]:
    """The roots and all their live descendants (pool children come and go: read it at each sample)."""
    found: list[int] = []
    for root in roots:
        if root <= 0:  # "not started": pid 0 would be the kernel's whole tree to psutil
            continue
        try:
            process = psutil.Process(root)
            found += [process.pid, *(child.pid for child in process.children(recursive=True))]
        except psutil.Error:  # gone since
            continue
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process, including children it has already reaped (recycled pool children)."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return float(times.user + times.system + times.children_user + times.children_system)


def tree_cpu_seconds(roots: Iterable[int]) -> float:
    return sum(cpu_seconds(pid) for pid in tree(roots))


def rss_mb(pid: int) -> float:
    """Resident memory of one process in MiB; 0 for one that is gone."""
    try:
        return float(psutil.Process(pid).memory_info().rss) / 2**20
    except psutil.Error:
        return 0.0


@dataclass
class MemorySampler:
    """Samples the RSS of process trees in a thread: peak per process and peak of the sum per group."""

    groups: dict[str, list[int]]
    interval_s: float = 0.5
    peak_per_pid: dict[int, float] = field(default_factory=dict)
    peak_total: dict[str, float] = field(default_factory=dict)
    last_total: dict[str, float] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> MemorySampler:
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="bench-rss", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> dict[str, float]:
        for name, roots in self.groups.items():
            total = 0.0
            for pid in tree(roots):
                value = rss_mb(pid)
                total += value
                self.peak_per_pid[pid] = max(self.peak_per_pid.get(pid, 0.0), value)
            self.last_total[name] = total
            self.peak_total[name] = max(self.peak_total.get(name, 0.0), total)
        return dict(self.last_total)

    def peak_process_mb(self, name: str) -> float:
        pids = set(tree(self.groups[name])) | set(self.groups[name])
        return max((v for p, v in self.peak_per_pid.items() if p in pids), default=0.0)


# --- Store counters ------------------------------------------------------------------------------


class NoCounters(RuntimeError):
    """The Store runs without ``--tracker prometheus``: request counts cannot be measured."""


def store_requests(store_url: str) -> dict[str, float]:
    """``"METHOD path" -> requests`` from the Store's Prometheus endpoint (all statuses summed)."""
    response = httpx.get(f"{store_url}/v1/prometheus/", timeout=30)
    if response.status_code == 404:
        raise NoCounters(f"{store_url} serves no /v1/prometheus/: start it with `agl store --tracker prometheus`")
    response.raise_for_status()
    counts: dict[str, float] = defaultdict(float)
    for line in response.text.splitlines():
        match = _HTTP_TOTAL.match(line)
        if not match:
            continue
        labels = dict(_LABEL.findall(match["labels"]))
        counts[f"{labels.get('method', '?')} {labels.get('path', '?')}"] += float(match["value"])
    return dict(counts)


def diff_counts(after: dict[str, float], before: dict[str, float], minus: dict[str, float]) -> dict[str, float]:
    """Requests made between two snapshots, less the benchmark's own (``minus``), zeros dropped."""
    out: dict[str, float] = {}
    for key in set(after) | set(before):
        value = after.get(key, 0.0) - before.get(key, 0.0) - minus.get(key, 0.0)
        if value > 0:
            out[key] = value
    return out


class Stopwatch:
    """Wall time of a phase, plus CPU of named process trees over it."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self.started = time.monotonic()
        self.cpu0 = {name: tree_cpu_seconds(roots) for name, roots in groups.items()}

    def cpu(self) -> dict[str, float]:
        return {name: tree_cpu_seconds(roots) - self.cpu0[name] for name, roots in self.groups.items()}

    def elapsed(self) -> float:
        return time.monotonic() - self.started


# --- rollout timeline (from the Store's rollout views) ---------------------------------------------


def task_start(view: dict[str, Any]) -> float | None:
    """When the worker began the attempt: its own ``started_at``, else its report time minus its duration
    (an overestimate by the fence read and the report's own latency, which a loaded Store makes large)."""
    attempt = view.get("attempt") or {}
    meta = attempt.get("metadata") or {}
    if meta.get("started_at") is not None:
        return float(meta["started_at"])
    if attempt.get("end_time") is None or meta.get("duration_s") is None:
        return None
    return float(attempt["end_time"]) - float(meta["duration_s"])


def latencies_ms(views: list[dict[str, Any]]) -> list[float]:
    out = []
    for view in views:
        start = task_start(view)
        if start is not None and view.get("start_time") is not None:
            out.append(max(0.0, (start - float(view["start_time"])) * 1000))
    return out


def dequeue_to_start_ms(views: list[dict[str, Any]]) -> list[float]:
    """Attempt created by a dequeue -> task start: the bridge's publish plus the broker and pool hand-off."""
    out = []
    for view in views:
        start, attempt = task_start(view), view.get("attempt") or {}
        if start is not None and attempt.get("start_time") is not None:
            out.append(max(0.0, (start - float(attempt["start_time"])) * 1000))
    return out


def _busy_window(attempts: list[dict[str, Any]], slots: int) -> tuple[float, float] | None:
    """From the dequeue that filled the last free slot to the last dequeue: every slot had work (after the
    last dequeue the queue is empty and slots go idle one by one, a tail that is a large part of a short run
    of long rollouts)."""
    starts = sorted(float(a["start_time"]) for a in attempts if a.get("start_time") is not None)
    if len(starts) <= slots or starts[-1] <= starts[slots - 1]:
        return None
    return starts[slots - 1], starts[-1]


def sustained_rate(views: list[dict[str, Any]], slots: int) -> float | None:
    """Rollouts finished per second within the busy window.

    Biased low when the window holds few rollouts per slot: every slot starts its first rollout at the
    window's start, so none finishes for a whole rollout's time, and the count misses about half a rollout
    per slot (a perfect executor scores 0.945 at 128 slots, 8 rollouts each). ``slot_time`` has no such
    bias; this count stays for executors that report no episode times (the peer) and for 0 ms runs, whose
    windows hold thousands of rollouts per slot.
    """
    attempts = [v.get("attempt") or {} for v in views]
    window = _busy_window(attempts, slots)
    if window is None:
        return None
    begin, end = window
    finished = sum(1 for a in attempts if a.get("end_time") is not None and begin < float(a["end_time"]) <= end)
    return finished / (end - begin)


DEQUEUE = "POST /v1/agl/queues/rollouts/dequeue"
BATCH_GAP_S = 0.002


def claiming_dequeues(views: list[dict[str, Any]]) -> int:
    """How many dequeues claimed these rollouts: the Store stamps a batch's attempts one after another (about
    0.1 ms apart), and one executor's consecutive dequeues are milliseconds apart at least (a request
    each). The rest of the Store's dequeue count found the queue empty: polls while slots were free."""
    attempts = [v.get("attempt") or {} for v in views]
    starts = sorted(float(a["start_time"]) for a in attempts if a.get("start_time") is not None)
    return sum(1 for i, start in enumerate(starts) if i == 0 or start - starts[i - 1] > BATCH_GAP_S)


def _overlap(start: float, stop: float, begin: float, end: float) -> float:
    return max(0.0, min(stop, end) - max(start, begin))


def slot_time(
    views: list[dict[str, Any]], slots: int, ideal_s: Callable[[dict[str, Any]], float | None]
) -> dict[str, float] | None:
    """How the slots spent the busy window, as shares of ``slots`` x its length.

    ``ideal``: what an executor with no cost of its own would spend (``ideal_s`` of each attempt's
    metadata, from its worker's start): the sustained efficiency, exactly 1 for a perfect executor however
    few rollouts the window holds. ``overhead``: the rest of the episodes (the worker's ``started_at`` to
    ``started_at + duration_s``: HTTP, parsing, spans, waits for the GIL). ``hand_off``: the attempts
    outside their episodes (dequeue to start: publish, broker, pool; the report). ``free``: no attempt
    held the slot (the bridge noticing a freed slot, coalescing, its dequeue). None when an attempt lacks
    the worker's times.
    """
    attempts = [v.get("attempt") or {} for v in views]
    window = _busy_window(attempts, slots)
    if window is None:
        return None
    begin, end = window
    ideal = episode = held = 0.0
    for attempt in attempts:
        meta = attempt.get("metadata") or {}
        seconds = ideal_s(meta)
        if seconds is None or meta.get("started_at") is None or meta.get("duration_s") is None:
            return None
        started = float(meta["started_at"])
        ideal += _overlap(started, started + seconds, begin, end)
        episode += _overlap(started, started + float(meta["duration_s"]), begin, end)
        if attempt.get("start_time") is not None and attempt.get("end_time") is not None:
            held += _overlap(float(attempt["start_time"]), float(attempt["end_time"]), begin, end)
    total = slots * (end - begin)
    return {
        "ideal": ideal / total,
        "overhead": max(0.0, episode - ideal) / total,
        "hand_off": max(0.0, held - episode) / total,
        "free": max(0.0, total - held) / total,
    }
