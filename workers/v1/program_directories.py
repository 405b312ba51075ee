"""The 1.0 program servers' directories and the nodes' box roots in TMPDIR: each names its owner, and a stale one
is swept.

A directory's name says who owns it: ``agl-v1-programs-<pid namespace>.<pid>-<random>`` (a server's socket) or
``agl-v1-boxes-<pid namespace>.<pid>-<random>`` (a node's box root, ``workers.v1.box``), the worker process that
made it (its PID, and the inode of its PID namespace, ``/proc/self/ns/pid``, in hex; 0 where there is none). A
worker SIGKILLed before its server removed the directory leaves it in TMPDIR, so each program server first sweeps
TMPDIR (``sweep_stale_directories``): it removes a directory of this pattern only when it is this user's (not a
link), names this process's PID namespace, and no process of that PID exists. A live worker's directory is never
removed (its PID exists); one named by another PID namespace (another container sharing TMPDIR) is never touched;
a dead worker's directory whose PID was reused since is left until that process is gone too. A box root's entries
belong to the programs' uids: each is removed as its owner (``sweep_box``, without killing: that uid may be a live
program's again), which needs the capabilities the boxes need; without them the root stays.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import subprocess
import tempfile

log = logging.getLogger("workers.v1.program_directories")

DIRECTORY_PREFIX = "agl-v1-programs-"
BOX_ROOT_PREFIX = "agl-v1-boxes-"
_DIRECTORY_NAME = re.compile(
    f"(?P<prefix>{re.escape(DIRECTORY_PREFIX)}|{re.escape(BOX_ROOT_PREFIX)})"
    + r"(?P<namespace>[0-9a-f]+)\.(?P<pid>\d+)-[^/]+"
)


def pid_namespace() -> int:
    """The inode of this process's PID namespace (PIDs mean something only within it); 0 where unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def directory_prefix(prefix: str = DIRECTORY_PREFIX) -> str:
    """``mkdtemp``'s prefix for a program server's directory (or, with ``BOX_ROOT_PREFIX``, a box root) made by this
    process: its owner in the name."""
    return f"{prefix}{pid_namespace():x}.{os.getpid()}-"


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


def _empty_box_root(root: str) -> None:
    from workers.v1.program_server import sweep_box

    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        try:
            owner = entry.stat(follow_symlinks=False).st_uid
        except OSError:
            continue
        if owner != os.getuid():
            try:
                sweep_box(owner, entry.path, kill=False)
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("could not remove %s of a dead worker's box root: %r", entry.path, exc)


def sweep_stale_directories(tmpdir: str | None = None) -> list[str]:
    """Remove the program servers' directories in ``tmpdir`` (default: ``tempfile.gettempdir()``) whose owner is
    gone, by the rule of this module's docstring; the paths removed."""
    root = tmpdir or tempfile.gettempdir()
    namespace, uid = pid_namespace(), os.getuid()
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        match = _DIRECTORY_NAME.fullmatch(name)
        if match is None or int(match["namespace"], 16) != namespace:
            continue
        pid = int(match["pid"])
        if _pid_exists(pid):  # ours included
            continue
        path = os.path.join(root, name)
        try:
            found = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != uid:
            continue
        if match["prefix"] == BOX_ROOT_PREFIX:
            _empty_box_root(path)
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append(path)
    if removed:
        log.info("removed %d program server directories of dead workers: %s", len(removed), ", ".join(removed))
    return removed
