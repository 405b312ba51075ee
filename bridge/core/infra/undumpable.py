"""Keeping other processes of the same user out of a process that holds the operators' keys (docs/agl-v1.md,
"Trust model").

``make_undumpable`` clears the process's dumpable flag (``prctl(PR_SET_DUMPABLE, 0)``): a process of the same uid,
not root, can then neither read the ``/proc`` entries that hold its secrets (``environ``, ``mem``, ``fd``, ``maps``)
nor attach to it, and a crash writes no core dump of its memory. A fork keeps the flag (every
process of a prefork pool); an ``exec`` clears it (the 1.0 program server and the programs, which hold none of the
keys). Root (a debugger run as root too) still reads it, even without CAP_SYS_PTRACE.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

PR_SET_DUMPABLE, PR_GET_DUMPABLE = 4, 3


def _prctl(option: int, value: int) -> int:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return int(libc.prctl(option, value, 0, 0, 0))


def make_undumpable(role: str) -> bool:
    """Clear this process's dumpable flag (``role`` names the process in the log line); False, with a warning,
    where the system has no such call."""
    if not sys.platform.startswith("linux"):
        log.warning("%s: not on Linux, so other processes of this user can read this one's environment", role)
        return False
    if _prctl(PR_SET_DUMPABLE, 0) != 0:
        log.warning("%s: prctl(PR_SET_DUMPABLE) failed (errno %d)", role, ctypes.get_errno())
        return False
    log.info("%s: non-dumpable (processes of this user cannot read its environment or memory)", role)
    return True


def is_dumpable() -> bool:
    """This process's flag, as ``prctl(PR_GET_DUMPABLE)`` reads it."""
    return _prctl(PR_GET_DUMPABLE, 0) != 0
