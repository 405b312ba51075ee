"""Boxes for 1.0 agent programs, the worker's side (docs/agl-v1.md, "Boxes"). What happens in the program's own
process (its uid, limits, directory, and the sweep at its end) is ``workers.v1.program_server``'s ``enter_box`` and
``sweep_box``, which both starts run.

Contract:

* ``check_isolation`` at the worker's start, with AGL_V1_URL set: under ``AGL_V1_ISOLATION=box`` it starts one
  boxed probe of the programs' interpreter and raises ConfigError, naming what is missing, when the box cannot be
  made (CAP_SETUID and CAP_SETGID; an interpreter other uids cannot read) or when ``.env`` in the worker's cwd is
  readable by other users; it logs what programs run under. Under ``none`` it logs that they are not isolated;
* ``program_box`` is the box of one program: its uid base, a fresh directory's path in the node's box root
  (``box_root``: mode 1733 in TMPDIR, so a program makes its own directory there and lists or removes no other),
  the limits, and its directory's disk quota (a tmpfs, where the box has its own mount namespace); None under
  ``none``;
* ``limit_hit`` names the limit a failed program ran into, from its exit and its last output;
* ``Isolation`` is what an attempt records of the box it ran in: an ``ISOLATION_EVENT`` of the attempt on the
  gateway, its log line, its outcome's detail when it failed, and ``agl_worker_programs_started_total{start,
  isolation}``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

from bridge.core.infra import ConfigError
from bridge.core.settings import WorkerSettings
from workers.lifecycle import state
from workers.v1 import program_server
from workers.v1.program_directories import BOX_ROOT_PREFIX, directory_prefix, sweep_stale_directories
from workers.v1.programs import bootstrap

log = logging.getLogger("workers.v1.box")

CAP_SETGID, CAP_SETUID = 6, 7
ISOLATION_EVENT = "agl_celery_bridge.isolation"
"""The event type under which each attempt's box is recorded on the 1.0 gateway (``Isolation.record``, plus the
start and the worker's host); 1.0's trainer keeps events of types it does not know beside the rollout."""
PROBE_TIMEOUT_S = 60.0
_root_lock = threading.Lock()


@dataclass(frozen=True)
class Isolation:
    """The box a program ran in, as an attempt records it."""

    kind: str  # "box" or "none"
    uid: int | None
    limits: dict[str, int]
    namespaces: bool = False  # PID and mount namespaces of its own

    @property
    def disk_quota(self) -> bool:
        """Whether its directory had a disk quota (``limits["disk_bytes"]``); else only the per-file limit."""
        return "disk_bytes" in self.limits

    def record(self) -> dict[str, Any]:
        """What the attempt's ``ISOLATION_EVENT`` on the gateway holds, for the trainer to read."""
        return {
            "kind": self.kind,
            "uid": self.uid,
            "pid_namespace": self.namespaces,
            "disk_quota": self.disk_quota,
            "limits": dict(self.limits),
        }

    def describe(self) -> str:
        if self.kind == "none" or self.uid is None:
            return "not isolated (AGL_V1_ISOLATION=none)"
        shown = ", ".join(f"{name} {value}" for name, value in self.limits.items())
        where = ", own PID namespace" if self.namespaces else ""
        quota = "" if self.disk_quota else "; no disk quota"
        return f"boxed as uid {self.uid}{where} ({shown}{quota})"


def limits(settings: WorkerSettings) -> dict[str, int]:
    """The limits of every program's box, as ``enter_box`` takes them."""
    mib = 2**20
    return {
        "memory_bytes": settings.agl_v1_program_memory_mb * mib,
        "processes": settings.agl_v1_program_max_processes,
        "open_files": settings.agl_v1_program_max_open_files,
        "cpu_s": settings.agl_v1_program_cpu_s,
        "file_bytes": settings.agl_v1_program_max_file_mb * mib,
    }


def box_root() -> str:
    """The node's box root: made once per node (by its main process, before a prefork pool forks), mode 1733."""
    node = state.node
    with _root_lock:
        if node.box_root is None or not os.path.isdir(node.box_root):
            root = tempfile.mkdtemp(prefix=directory_prefix(BOX_ROOT_PREFIX))
            os.chmod(root, 0o1733)  # search and make, never list; the sticky bit keeps each entry its maker's
            node.box_root = root
            atexit.register(_remove_root, root, os.getpid())
        return node.box_root


def _remove_root(root: str, owner: int) -> None:
    if os.getpid() == owner:  # not a prefork child's exit: the node's main process owns the root
        shutil.rmtree(root, ignore_errors=True)  # each program's directory went at its end


def program_box(settings: WorkerSettings) -> dict[str, Any] | None:
    """One program's box, for ``enter_box`` in its process; None when programs are not isolated."""
    if settings.agl_v1_isolation == "none":
        return None
    return {
        "uid_base": settings.agl_v1_program_uid_base,
        "directory": os.path.join(box_root(), secrets.token_hex(12)),
        "import_from": os.getcwd(),
        "pid_namespace": settings.agl_v1_program_pid_namespace,
        "limits": limits(settings),
        "disk_bytes": settings.agl_v1_program_disk_mb * 2**20,
    }


def isolation_of(box: dict[str, Any] | None, pid: int) -> Isolation:
    if box is None:
        return Isolation("none", None, {})
    uid = program_server.box_uid(int(box["uid_base"]), pid)
    namespaces = bool(box.get("pid_namespace")) and state.node.box_namespaces  # as the start-up probe found
    shown = dict(box["limits"])
    if namespaces and int(box.get("disk_bytes") or 0) > 0:  # its directory is a tmpfs of that size
        shown["disk_bytes"] = int(box["disk_bytes"])
    return Isolation("box", uid, shown, namespaces)


def limit_hit(code: int, output: str, settings: WorkerSettings, *, disk_quota: bool = False) -> str | None:
    """The limit a boxed program that exited with ``code`` (``Popen.returncode``) and wrote ``output`` last ran into,
    named with its setting; None when nothing says it hit one. A full disk names the disk quota only where the
    program's directory had one (``disk_quota``, as ``Isolation.disk_quota``)."""
    if settings.agl_v1_isolation == "none":
        return None
    if code == -signal.SIGXCPU:
        return f"its CPU time limit (AGL_V1_PROGRAM_CPU_S={settings.agl_v1_program_cpu_s})"
    processes = f"its process limit (AGL_V1_PROGRAM_MAX_PROCESSES={settings.agl_v1_program_max_processes})"
    signs: tuple[tuple[str, str], ...] = (
        ("MemoryError", f"its memory limit (AGL_V1_PROGRAM_MEMORY_MB={settings.agl_v1_program_memory_mb})"),
        ("File too large", f"its file size limit (AGL_V1_PROGRAM_MAX_FILE_MB={settings.agl_v1_program_max_file_mb})"),
        (
            "Too many open files",
            f"its open files limit (AGL_V1_PROGRAM_MAX_OPEN_FILES={settings.agl_v1_program_max_open_files})",
        ),
        ("can't start new thread", processes),
        ("Resource temporarily unavailable", processes),
    )
    if disk_quota:
        disk = f"its disk quota (AGL_V1_PROGRAM_DISK_MB={settings.agl_v1_program_disk_mb}, its directories together)"
        signs += (("No space left on device", disk),)
    for sign, limit in signs:
        if sign in output:
            return limit
    return None


def missing_capabilities() -> list[str]:
    """What this process lacks of what making boxes needs (CAP_SETUID, CAP_SETGID); empty when it has both."""
    held = 0
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("CapEff:"):
                held = int(line.split()[1], 16)
    return [name for bit, name in ((CAP_SETUID, "CAP_SETUID"), (CAP_SETGID, "CAP_SETGID")) if not held >> bit & 1]


def node_isolation(settings: WorkerSettings, namespaces: bool = False) -> str:
    """How this node contains its programs, in one line: what it advertises for ``python -m bridge status``."""
    if settings.agl_v1_isolation == "none":
        return "none: programs run as the worker's uid (AGL_V1_ISOLATION=none)"
    seen = "own PID and mount namespaces" if namespaces else "other processes visible"
    return (
        f"box: uid {settings.agl_v1_program_uid_base}+pid, no capabilities, own 0700 directory, {seen}; limits "
        f"{settings.agl_v1_program_memory_mb} MiB, {settings.agl_v1_program_max_processes} processes, "
        f"{settings.agl_v1_program_max_open_files} files, {settings.agl_v1_program_cpu_s} s CPU, "
        f"{settings.agl_v1_program_max_file_mb} MiB per file, {disk_quota(settings, namespaces)}"
    )


def disk_quota(settings: WorkerSettings, namespaces: bool) -> str:
    """A box's disk quota in words: AGL_V1_PROGRAM_DISK_MB where its box has a mount namespace of its own, else
    why there is none (its directory is then bounded per file only)."""
    if not settings.agl_v1_program_disk_mb:
        return "no disk quota (AGL_V1_PROGRAM_DISK_MB=0)"
    if not namespaces:
        return "no disk quota (no mount namespace)"
    return f"{settings.agl_v1_program_disk_mb} MiB disk quota"


def check_isolation(settings: WorkerSettings) -> None:
    """At the worker's start: ConfigError when programs should be boxed and cannot be (see the module's contract);
    the node's ``node_isolation`` otherwise, for its adverts."""
    state.node.isolation = None
    if settings.agl_v1_isolation == "none":
        log.warning(
            "AGL_V1_ISOLATION=none: 1.0 programs run as uid %d like this worker, in its cwd, without limits; a "
            "program can read every file this user can (docs/agl-v1.md, 'Boxes')",
            os.getuid(),
        )
        state.node.isolation = node_isolation(settings)
        return
    missing = missing_capabilities()
    if missing:
        raise ConfigError(
            f"1.0 programs run in boxes of their own uid, and this worker (uid {os.getuid()}) lacks "
            f"{' and '.join(missing)}: run it as root or grant them (docs/agl-v1.md, 'Boxes'); "
            "AGL_V1_ISOLATION=none runs programs unboxed",
            setting="AGL_V1_ISOLATION",
        )
    env_file = os.path.join(os.getcwd(), ".env")
    if os.path.isfile(env_file) and os.stat(env_file).st_mode & stat.S_IROTH:
        raise ConfigError(
            f"{env_file} is readable by every user, the boxed programs' uids among them: chmod 600 it",
            setting="AGL_V1_ISOLATION",
        )
    sweep_stale_directories()
    facts = probe(settings)
    namespaces = bool(facts.get("namespaces"))
    if settings.agl_v1_program_disk_mb and not namespaces:
        log.warning(
            "AGL_V1_PROGRAM_DISK_MB=%d is not applied: 1.0 programs' boxes have no mount namespace of their own "
            "(AGL_V1_PROGRAM_PID_NAMESPACE=false, or no CAP_SYS_ADMIN), so a program's directory is bounded only "
            "per file, by AGL_V1_PROGRAM_MAX_FILE_MB=%d (docs/agl-v1.md, 'Boxes')",
            settings.agl_v1_program_disk_mb,
            settings.agl_v1_program_max_file_mb,
        )
    log.info(
        "1.0 programs run in boxes: each as uid %d plus its pid, no capabilities, its own 0700 directory in %s, "
        "limits %s, %s, %s%s; with a token of their attempt for this worker's relay, never AGL_V1_KEY "
        "(docs/agl-v1.md, 'Boxes')",
        settings.agl_v1_program_uid_base,
        box_root(),
        limits(settings),
        disk_quota(settings, namespaces),
        "PID and mount namespaces of their own"
        if namespaces
        else "no PID namespace (AGL_V1_PROGRAM_PID_NAMESPACE=false, or no CAP_SYS_ADMIN)",
        f"; shown in their mount namespace: {facts['shown']}" if facts.get("shown") else "",
    )
    state.node.isolation = node_isolation(settings, namespaces)
    state.node.box_namespaces = namespaces


def probe(settings: WorkerSettings) -> dict[str, Any]:
    """Make one box for the programs' interpreter and check it from inside: its uid, no capabilities."""
    python = settings.agl_v1_agent_python or sys.executable
    box = program_box(settings)
    try:
        done = subprocess.run(
            [python, "-c", bootstrap("probe_main"), "probe", str(os.getpid()), json.dumps(box)],
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            start_new_session=True,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"the boxed probe of {python} did not run: {exc}", setting="AGL_V1_ISOLATION") from exc
    finally:
        if box is not None:  # a disk quota's mount point, left empty outside the probe's mount namespace
            shutil.rmtree(box["directory"], ignore_errors=True)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        if "AGL_V1_PROGRAM_DISK_MB" in why:
            raise ConfigError(
                f"a 1.0 program's disk quota cannot be mounted here ({why}): AGL_V1_PROGRAM_DISK_MB=0 bounds its "
                "directory per file only (AGL_V1_PROGRAM_MAX_FILE_MB)",
                setting="AGL_V1_PROGRAM_DISK_MB",
            )
        if settings.agl_v1_program_pid_namespace and ("mount" in why or "unshare" in why):
            raise ConfigError(
                f"a 1.0 program's PID and mount namespaces cannot be made here ({why}; a security module such as "
                "AppArmor may refuse the mounts): AGL_V1_PROGRAM_PID_NAMESPACE=false boxes programs by uid alone",
                setting="AGL_V1_PROGRAM_PID_NAMESPACE",
            )
        raise ConfigError(f"a 1.0 program's box cannot be made here: {why}", setting="AGL_V1_ISOLATION")
    facts: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return facts
