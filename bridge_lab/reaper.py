"""Children die with their starter, however it dies: a watchdog process per starter that kills what is left.

Every process the lab starts (``bridge_lab.procs.ManagedProcess``: the demo's, the benchmark's, the chaos and
cluster runs', the integration tests') runs in a process group of its own, so that a Ctrl-C in a terminal reaches
the tool only and the tool stops its children in order. The price is that nothing stops them when the tool itself
dies without running its teardown (SIGKILL, a test's time limit, a crash): they would keep serving, and a later run
on the same broker would hand its work to them.

So the first child a process starts also starts a *reaper*: ``python -m bridge_lab.reaper``, in a session of its
own, reading the starter's pipe. The starter writes ``+PGID STARTED`` for each group it starts (with its leader's
start time) and ``-PGID`` for each it stopped. When the pipe ends (the starter exited, whatever the cause: the kernel
closes its end), the reaper sends SIGTERM to every group still listed, waits up to ``GRACE_S``, and SIGKILLs what is
left; never to a group whose number now belongs to another process (``ours``: pids are reused, and a listed child
that exited on its own may have been gone for minutes). A normal exit leaves no
group listed, so the reaper then exits at once. A forked child of the starter closes its copy of the pipe (it is
not the starter) and starts a reaper of its own if it starts children.

Unlike ``PR_SET_PDEATHSIG``, this does not depend on the thread that started the child living on (the chaos
runner restarts processes from threads), and it reaches the whole group (a Celery worker's pool processes, a
gateway's children), not only the direct child.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("bridge_lab.reaper")

GRACE_S = 5.0  # SIGTERM, then this long before SIGKILL: a Celery worker's warm shutdown with nothing running fits


class _Watch:
    """The starter's side: one reaper per process, started on the first ``watch``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.groups: dict[int, int | None] = {}  # pgid -> its leader's start time
        self.process: subprocess.Popen[bytes] | None = None

    def watch(self, pgid: int) -> int | None:
        with self.lock:
            started = self.groups[pgid] = start_time(pgid)
            self._send(f"+{pgid} {started}\n")
            return started

    def forget(self, pgid: int) -> None:
        with self.lock:
            if self.groups.pop(pgid, -1) != -1:
                self._send(f"-{pgid}\n")

    def _send(self, line: str) -> None:
        """Write to the reaper, starting it (again, listing every group) when there is none or it died."""
        for _ in range(2):
            if self.process is None or self.process.poll() is not None:
                self._start()
                line = "".join(f"+{group} {started}\n" for group, started in self.groups.items())  # all, as now
            assert self.process is not None and self.process.stdin is not None
            try:
                self.process.stdin.write(line.encode())
                self.process.stdin.flush()
                return
            except (BrokenPipeError, ValueError):  # killed by someone: start another
                self.process = None
        log.warning("no reaper runs: the children of pid %d may outlive it", os.getpid())

    def _start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bridge_lab.reaper"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # not in any group it kills, nor reached by the terminal's Ctrl-C
        )

    def after_fork_in_child(self) -> None:
        """A forked child is not the starter: it drops the starter's pipe (so the reaper still sees the starter's
        exit) and its list, and starts its own reaper for children it starts."""
        process, self.process = self.process, None
        self.groups = {}
        self.lock = threading.Lock()
        if process is not None and process.stdin is not None:
            with contextlib.suppress(OSError):
                os.close(process.stdin.fileno())


_WATCH = _Watch()
os.register_at_fork(after_in_child=_WATCH.after_fork_in_child)


def watch(pgid: int) -> int | None:
    """Have the process group ``pgid`` killed when this process exits without calling ``forget`` for it; returns its
    leader's start time (``start_time``), which names the group for ``ours``."""
    return _WATCH.watch(pgid)


def forget(pgid: int) -> None:
    """The group ``pgid`` was stopped by its starter: nothing to kill for it any more."""
    _WATCH.forget(pgid)


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, ``/proc/PID/stat``), or None when no such process runs. With
    the pid, it names one process: pids are reused (32,768 of them on many machines, a busy test run goes round)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])


def ours(pgid: int, started: int | None) -> bool:
    """Whether the group ``pgid`` is still the one whose leader started at ``started``: not when a process with that
    pid runs and started at another time (the number was reused). A leader that is gone leaves its number to its
    group's last members (the kernel reuses no pid that still names a group), so those are still ours."""
    now = start_time(pgid)
    return now is None or started is None or now == started


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal(groups: dict[int, int | None], signum: int) -> None:
    for pgid, started in groups.items():
        if ours(pgid, started):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signum)


def reap(groups: dict[int, int | None], grace_s: float = GRACE_S) -> None:
    """SIGTERM each group (pgid -> its leader's start time) that is still ours, wait up to ``grace_s`` for all of
    them to go, SIGKILL the rest."""
    _signal(groups, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(pgid) and ours(pgid, t) for pgid, t in groups.items()):
        time.sleep(0.1)
    _signal(groups, signal.SIGKILL)


def main() -> int:
    """The reaper: read ``+PGID STARTED``/``-PGID`` lines until the starter's pipe ends, then kill what is listed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the starter's to handle
    groups: dict[int, int | None] = {}
    for raw in sys.stdin.buffer:
        fields = raw.decode(errors="replace")[1:].split()
        if not fields or not fields[0].isdigit():
            continue
        if raw.startswith(b"+"):
            groups[int(fields[0])] = int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None
        elif raw.startswith(b"-"):
            groups.pop(int(fields[0]), None)
    if groups:
        reap(groups)
    return 0


if __name__ == "__main__":
    sys.exit(main())
