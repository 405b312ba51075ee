"""What runs in an agent program's own process, cold or warm: the program itself, and the node's program server
that forks one program per attempt (docs/agl-v1.md, "Warm starts"; the worker's side is ``workers.v1.launch``).

Standard library only, never imported by the worker: the interpreter that runs it (``AGL_V1_AGENT_PYTHON``) may
be another virtualenv without this project. ``launch`` runs this file's source with ``python -c``:

* cold: ``cold_main``, with ``sys.argv`` ``['-c', agent_class, worker_pid]``, as 1.0's ``local`` runner starts a
  program;
* warm: ``server_main`` with one JSON argument (socket path, ready fd, modules to import, the environment names it
  was given, the worker's pid).

The server's protocol, one Unix stream connection per program (the socket lies in a 0700 directory):

* request: one JSON line ``{"agent_class", "env", "cwd", "worker_pid"}`` sent with one file descriptor
  (SCM_RIGHTS), the write end of the pipe the program's output goes to;
* replies, JSON lines: ``{"pid": N}`` once forked (or ``{"error": "..."}``), then ``{"exit": code}`` once the
  program ended (as ``Popen.returncode``: negative for a signal) and its whole process group was killed;
* the worker may send ``{"kill": true}``; a connection closed before the exit kills the program's group too (and
  everything of a boxed program's uid, as that uid: the server needs no CAP_KILL).

A forked program starts as a cold one does: it leads a new session, dies with its parent (PR_SET_PDEATHSIG), is
non-dumpable (``seal``: no other program of its uid reads its token),
has fd 0 on /dev/null, 1 and 2 on the output pipe and nothing else open, exactly the attempt's environment (plus
what the interpreter adds at its start, as it adds it to a cold program's), the worker's cwd, the cold argv and
``sys.path``, the signal dispositions and mask the server started with, fresh ``sys.std*`` streams and the
garbage collector on (the server's objects frozen out of it); it ends as an interpreter does (non-daemon threads
joined, atexit handlers run, streams flushed).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import importlib
import inspect
import io
import json
import os
import selectors
import shutil
import signal
import socket
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
_CAPABILITY_VERSION_3 = 0x20080522
_CLONE_NEWNS, _CLONE_NEWPID, _CAP_SYS_ADMIN = 0x20000, 0x20000000, 21
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
BOX_FAILED = 125  # the exit code of a program whose box could not be made (it never ran): BOX_FAILED_MARK says why
BOX_FAILED_MARK = "agl-box: not run:"
_LIMITS = {  # a box's limits (``box["limits"]``) and the resource each one sets, soft and hard
    "memory_bytes": "RLIMIT_AS",
    "processes": "RLIMIT_NPROC",
    "open_files": "RLIMIT_NOFILE",
    "cpu_s": "RLIMIT_CPU",
    "file_bytes": "RLIMIT_FSIZE",
}
OOM_SCORE_ADJ = 1000  # a box's processes': in an OOM, the kernel kills a program before the worker (or anything else)
FILES_PER_MIB = 128  # the files (inodes) a box's disk quota holds per MiB: each costs about 1 KiB of kernel memory
MAX_REQUEST_BYTES = 8 * 2**20
RECV_BYTES = 65536
SHARED_TEMP = ("/tmp", "/var/tmp", "/dev/shm")  # writable by every uid: a box's files there go with it
SERVER_MARKER = "agl-program-server"  # in the server's argument: how tools find a node's server among processes

# --- the program: shared by both starts ----------------------------------------------------------------


def die_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> bool:
    """Have ``signum`` (SIGKILL unless told) sent to this process when its parent dies (Linux
    ``PR_SET_PDEATHSIG``); False when the parent already did (the caller exits)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum)
    except (OSError, AttributeError):
        return True
    return os.getppid() == parent_pid


def seal() -> None:
    """Make this program non-dumpable: another program of the same uid (not root) can then read neither its
    environment (its attempt's token) nor its memory through ``/proc``, nor attach to it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0)


# --- the box: shared by both starts (docs/agl-v1.md, "Boxes"; the worker's side is ``workers.v1.box``) ----------


def box_uid(uid_base: int, pid: int) -> int:
    """The uid of the program whose process is ``pid``: unique among the programs alive in a PID namespace, and
    never reused while anything of its box lives (the box is swept before its leader is reaped)."""
    return uid_base + pid


@dataclass
class Boxed:
    """What a program's box turned out to be, from inside."""

    shown: list[str] = field(default_factory=list)  # interpreter paths shown in its mount namespace
    namespaces: bool = False  # PID and mount namespaces of its own, with its own /proc
    disk_bytes: int = 0  # the size of the tmpfs its directory is (its disk quota); 0 without one


def enter_box(box: dict[str, Any] | None, parent_pid: int) -> Boxed:
    """Put this process, a program before any of its code runs, in its box, dying with ``parent_pid`` (the worker or
    the program server): the limits, the OOM killer's first pick (``OOM_SCORE_ADJ``), its own uid and gid
    (``box_uid``) with no groups, no capabilities (checked) and ``no_new_privs``, umask 077, and its own 0700
    directory ``box["directory"]`` (with ``tmp`` in it) as cwd, HOME and TMPDIR; ``sys.path``'s entry for the
    current directory becomes ``box["import_from"]`` (the worker's), so modules import as they did unboxed. Where
    this process holds CAP_SYS_ADMIN it also gets PID and mount namespaces of its own (``_own_namespaces``: it sees
    no process but its own), and its directory is a tmpfs of ``box["disk_bytes"]`` there (its disk quota; none when
    0 or absent). With ``box`` None (the operator's opt-out) it only dies with its parent. OSError or RuntimeError
    when any step fails: the caller must not run it; the process exits 1 when the parent is gone."""
    if box is None:
        if not die_with_parent(parent_pid):
            os._exit(1)
        return Boxed()
    import resource
    import tempfile

    for name, value in box["limits"].items():
        which = getattr(resource, _LIMITS[name])
        _, hard = resource.getrlimit(which)
        unlimited = hard == resource.RLIM_INFINITY
        value = int(value) if unlimited else min(int(value), hard)
        # CPU: SIGXCPU at the limit (the exit names it), SIGKILL a second later
        resource.setrlimit(which, (value, value + 1 if name == "cpu_s" and (unlimited or value < hard) else value))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file of a program's memory
    with open("/proc/self/oom_score_adj", "w") as adj:  # raising it needs no privilege
        adj.write(str(OOM_SCORE_ADJ))
    uid = box_uid(int(box["uid_base"]), os.getpid())
    if "" in sys.path:  # where ``python -c`` would import from: the worker's directory, not the box's
        sys.path[sys.path.index("")] = str(box["import_from"])
    cpu_s = float(box["limits"].get("cpu_s", 0)) or None
    boxed = _own_namespaces(
        uid,
        parent_pid,
        pid_namespace=bool(box.get("pid_namespace", True)),
        cpu_s=cpu_s,
        root=os.path.dirname(str(box["directory"])),
        quota=(str(box["directory"]), int(box.get("disk_bytes") or 0)),
    )
    _become(uid)
    if boxed.namespaces:  # the keeper outside killed what a box of this uid left; this one dies with the keeper
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    else:
        with contextlib.suppress(ProcessLookupError):  # what a box of this uid left when its worker died: gone
            os.kill(-1, signal.SIGKILL)
        if not die_with_parent(parent_pid):  # after the uid changed: that clears the parent-death signal
            os._exit(1)
    os.umask(0o077)
    home = str(box["directory"])
    if not boxed.disk_bytes:  # else it is the quota's tmpfs, 0700 and this uid's, on a directory made as mkdir here
        os.mkdir(home, 0o700)  # fails on anything already there: nobody else's directory is ever taken
    os.mkdir(os.path.join(home, "tmp"), 0o700)
    os.chdir(home)
    os.environ.update({"HOME": home, "TMPDIR": os.path.join(home, "tmp")})
    tempfile.tempdir = None  # the server may have asked for it before: the program finds its own
    return boxed


def _become(uid: int) -> None:
    """Take ``uid`` as every uid and gid, no groups, no capability, ``no_new_privs``."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    _drop_capabilities()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


def _own_namespaces(
    uid: int,
    parent_pid: int,
    *,
    pid_namespace: bool,
    cpu_s: float | None = None,
    root: str | None = None,
    quota: tuple[str, int] = ("", 0),
) -> Boxed:
    """Namespaces for the box, where they are needed or can be had (this process still holds its privileges).

    With CAP_SYS_ADMIN (and ``pid_namespace``): mount and PID namespaces of its own. This process stays outside as
    the box's keeper: it forks the program, takes ``uid``, kills what an earlier box of that uid left, lets the
    program go on, waits for it and exits as it did (a signal's death re-raised), dying with ``parent_pid``
    meanwhile. The program is PID 1 of its namespace with a /proc of its own, and dies with the keeper. As PID 1 it
    never gets SIGXCPU (the kernel drops it): a program SIGKILLed with ``cpu_s`` spent ends the keeper by SIGXCPU.

    Its interpreter's paths and the box ``root`` its directory is made in, where they lie below a directory other
    uids cannot search (a virtualenv in root's 0700 home, a private TMPDIR), are shown in that directory's place:
    an empty tmpfs with only those paths bound in (without ``pid_namespace``, in a mount namespace alone). Without
    CAP_SYS_ADMIN: nothing, unless such paths exist (OSError naming them).

    ``quota``, a directory and a size in bytes (with ``pid_namespace``): that directory is made (as ``mkdir`` would,
    so never one already there) and a tmpfs of that size, ``FILES_PER_MIB`` files per MiB, 0700 and ``uid``'s, is
    mounted on it in the new mount namespace: a write past it fails with ENOSPC, and it is freed with the namespace.
    Outside, the directory stays empty."""
    wanted = {sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path, *([root] if root else [])}
    paths = sorted({os.path.realpath(p) for p in wanted if p and os.path.isdir(p)})
    closed: dict[str, list[str]] = {}
    for path in paths:
        ancestor = _closed_directory(path)
        if ancestor == path and path != root:
            raise OSError(f"{path} (the interpreter's) cannot be searched by other uids")
        if ancestor is not None and not any(path.startswith(p + os.sep) for p in closed.get(ancestor, [])):
            closed.setdefault(ancestor, []).append(path)
    if not _holds_capability(_CAP_SYS_ADMIN):
        if closed:
            hidden = sorted(path for inside in closed.values() for path in inside)
            raise OSError(
                f"{', '.join(hidden)} (the interpreter's, or the box root in TMPDIR) lie under {', '.join(closed)}, "
                "which other uids cannot search, and this worker cannot make a mount namespace to show them "
                "(install the interpreter and point TMPDIR where others can search, or run the worker as root)"
            )
        return Boxed()
    libc = ctypes.CDLL(None, use_errno=True)

    def mount(source: str | None, target: str, kind: str | None, flags: int, data: str | None = None) -> None:
        encoded = [None if v is None else v.encode() for v in (source, target, kind, data)]
        if libc.mount(*encoded[:3], ctypes.c_ulong(flags), encoded[3]) != 0:
            raise OSError(ctypes.get_errno(), f"mount {source} on {target}")

    if not pid_namespace and not closed:
        return Boxed()
    if libc.unshare(_CLONE_NEWNS | (_CLONE_NEWPID if pid_namespace else 0)) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS | CLONE_NEWPID)")
    mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    for ancestor, inside in closed.items():
        held = [os.open(path, os.O_PATH | os.O_DIRECTORY) for path in inside]
        mount("tmpfs", ancestor, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=1m")
        for path, fd in zip(inside, held, strict=True):
            os.makedirs(path, mode=0o755, exist_ok=True)
            mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
            os.close(fd)
    shown = [path for inside in closed.values() for path in inside]
    if not pid_namespace:
        return Boxed(shown)
    directory, disk_bytes = quota
    if disk_bytes > 0:
        os.mkdir(directory, 0o700)
        files = max(1, disk_bytes // 2**20) * FILES_PER_MIB
        try:
            options = f"size={disk_bytes},nr_inodes={files},mode=0700,uid={uid},gid={uid}"
            mount("tmpfs", directory, "tmpfs", _MS_NOSUID | _MS_NODEV, options)
        except OSError as exc:
            raise OSError(exc.errno, f"the disk quota's tmpfs (AGL_V1_PROGRAM_DISK_MB) on {directory}: {exc}") from exc
    go_r, go_w = os.pipe()
    program = os.fork()
    if program == 0:  # the program: PID 1 of its namespace; waits until the keeper swept the uid
        os.close(go_w)
        if os.read(go_r, 1) != b"1":
            os._exit(1)
        os.close(go_r)
        mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        return Boxed(shown, namespaces=True, disk_bytes=max(disk_bytes, 0))
    os.close(go_r)
    _keep(program, uid, parent_pid, go_w, cpu_s)
    raise AssertionError("unreachable")  # _keep exits


def _keep(program: int, uid: int, parent_pid: int, go: int, cpu_s: float | None) -> None:
    """The keeper's life (``_own_namespaces``); it never returns."""
    try:
        _become(uid)
        if not die_with_parent(parent_pid):
            os._exit(1)
        with contextlib.suppress(ProcessLookupError):  # what a box of this uid left when its worker died: gone
            os.kill(-1, signal.SIGKILL)  # the program is still root's here: not among them
        os.write(go, b"1")
        os.close(go)
        _, status, usage = os.wait4(program, 0)
    except BaseException as exc:
        os.kill(program, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.write(2, f"{BOX_FAILED_MARK} its box's keeper failed: {exc!r}\n".encode())
        os._exit(BOX_FAILED)
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum == signal.SIGKILL and cpu_s is not None and usage.ru_utime + usage.ru_stime >= cpu_s:
            signum = signal.SIGXCPU  # the hard CPU limit's SIGKILL: its soft SIGXCPU never reached PID 1
        with contextlib.suppress(OSError, ValueError):
            signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
            os.kill(os.getpid(), signum)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _holds_capability(bit: int) -> bool:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def _closed_directory(path: str) -> str | None:
    """The first directory on the way to ``path`` (itself included) that other uids cannot search, or None."""
    current = os.sep
    for part in [p for p in path.split(os.sep) if p]:
        if not os.stat(current).st_mode & 0o001:
            return current
        current = os.path.join(current, part)
    return None if os.stat(current).st_mode & 0o001 else current


def _drop_capabilities() -> None:
    """Empty this thread's capability sets (a uid change between nonzero uids keeps them), then check all five."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.capset(ctypes.byref(Header(_CAPABILITY_VERSION_3, 0)), (Data * 2)()) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    with open("/proc/self/status") as status:
        held = [line.split()[0] for line in status if line.startswith("Cap") and int(line.split()[1], 16)]
    if [name for name in held if name != "CapBnd:"]:
        raise RuntimeError(f"capabilities still held: {held}")


def kill_box(uid: int, *, litter: bool = False) -> None:
    """SIGKILL every process of ``uid`` (a box's program and what it left running, in its session or out of it), as
    ``uid`` itself: ``kill -1`` reaches exactly that uid's processes, and needs no CAP_KILL (a container's worker
    has none), only CAP_SETUID and CAP_SETGID, as making the box did. With ``litter``, also remove that uid's entries
    at the top of the shared temporary directories (``_shared_temp``), whole: what a program left there would
    outlive it, readable by the next program given its uid (a folder another uid made world-writable there is its
    maker's to keep: a test's outbox, for one)."""
    script = "kill -s KILL -- -1 2>/dev/null"
    places = _shared_temp() if litter else ""
    if places:
        script += f"; find {places} -mindepth 1 -maxdepth 1 -xdev -user {uid} -exec rm -rf -- {{}} + 2>/dev/null"
    _run_as_uid(uid, "/bin/sh", "-c", script + "; true")


def _shared_temp() -> str:
    """``SHARED_TEMP`` and this process's TMPDIR, those that exist, quoted for the shell."""
    import shlex
    import tempfile

    places = dict.fromkeys((*SHARED_TEMP, tempfile.gettempdir()))
    return " ".join(shlex.quote(path) for path in places if os.path.isdir(path))


def sweep_box(uid: int, directory: str, *, kill: bool = True) -> None:
    """``kill_box`` with its litter, unless ``kill`` is False (a dead worker's box root, whose uids may be live
    programs' now). Then remove the box's directory: as the caller where it may (root: a TMPDIR that other uids
    cannot search included), else as ``uid``."""
    if kill:
        kill_box(uid, litter=True)
    shutil.rmtree(directory, ignore_errors=True)
    if os.path.lexists(directory):  # the caller may not (a container's worker): its owner may
        _run_as_uid(uid, "/bin/rm", "-rf", "--", directory)


def _run_as_uid(uid: int, *argv: str) -> None:
    import subprocess

    subprocess.run(
        argv,
        user=uid,
        group=uid,
        extra_groups=[],
        env={"PATH": "/usr/bin:/bin"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
        check=False,
        timeout=60,
    )


def boxed_or_exit(box: dict[str, Any] | None, parent_pid: int) -> Boxed:
    """``enter_box``, or exit ``BOX_FAILED`` with the reason on stderr: a program never runs half-boxed."""
    try:
        return enter_box(box, parent_pid)
    except (OSError, RuntimeError, ValueError, KeyError, TypeError) as exc:
        print(f"{BOX_FAILED_MARK} its box could not be made: {exc!r}", file=sys.stderr, flush=True)
        os._exit(BOX_FAILED)


def run_program(path: str) -> int:
    """Import the class ``path`` names (``module:Class`` or ``module.Class``), call ``run()`` (awaiting it when it
    is a coroutine) and return the exit code an interpreter would: 0 on return, 1 with the traceback on an
    exception, a ``SystemExit``'s own code."""
    try:
        module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        if not isinstance(cls, type):
            raise TypeError(f"{path} is not a class")
        result = cls().run()
        if inspect.isawaitable(result):
            asyncio.run(result)  # type: ignore[arg-type]
    except SystemExit as exc:
        return _exit_code(exc)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def cold_main() -> None:
    """A cold start: ``python -c`` with argv ``[agent_class, worker_pid, box]`` (the box as JSON, ``null`` for
    none), which the program then sees as ``[agent_class, worker_pid]``."""
    box = json.loads(sys.argv.pop(3))
    boxed_or_exit(box, int(sys.argv[2]))
    seal()
    sys.exit(run_program(sys.argv[1]))


def probe_main() -> None:
    """The worker's start-up check of the box (``workers.v1.box.check_isolation``), argv ``['probe', worker_pid,
    box]``: make the box, print one JSON line of what it is from inside (``disk_bytes``: its directory's size as
    statvfs reads it, 0 without a quota), empty its directory (the worker removes what is left outside)."""
    box = json.loads(sys.argv[3])
    boxed = boxed_or_exit(box, int(sys.argv[2]))
    facts: dict[str, Any] = {
        "uid": os.getuid(),
        "groups": os.getgroups(),
        "cwd": os.getcwd(),
        "shown": boxed.shown,
        "namespaces": boxed.namespaces,
        "processes": sum(entry.isdigit() for entry in os.listdir("/proc")),
        "disk_bytes": 0,
    }
    if boxed.disk_bytes:
        found = os.statvfs(os.getcwd())
        facts["disk_bytes"] = found.f_blocks * found.f_frsize
    if box is not None and os.getuid() < int(box["uid_base"]):
        print(f"{BOX_FAILED_MARK} the probe runs as uid {os.getuid()}", file=sys.stderr)
        sys.exit(BOX_FAILED)
    os.chdir("/")
    if box is not None:
        shutil.rmtree(box["directory"], ignore_errors=True)
    print(json.dumps(facts), flush=True)


# --- the server ----------------------------------------------------------------------------------------


@dataclass
class Initial:
    """What the server's interpreter was like at its start, before it imported anything: each program is reset
    to it."""

    added_env: dict[str, str]  # what the interpreter itself set (PEP 538's LC_CTYPE), as it sets it in a cold one
    handlers: dict[int, Any]
    mask: set[int]
    path: list[str]

    @classmethod
    def capture(cls, given: list[str]) -> Initial:
        handlers = {}
        for signum in signal.valid_signals():
            if signum in (signal.SIGKILL, signal.SIGSTOP):
                continue
            try:
                handlers[int(signum)] = signal.getsignal(signum)
            except (OSError, ValueError):
                continue
        added = {k: v for k, v in os.environ.items() if k not in set(given)}
        return cls(added, handlers, set(signal.pthread_sigmask(signal.SIG_BLOCK, [])), list(sys.path))


@dataclass
class Connection:
    sock: socket.socket
    buffer: bytearray = field(default_factory=bytearray)
    fds: list[int] = field(default_factory=list)
    pid: int | None = None


class Server:
    """Single-threaded: one selector over the listening socket, the connections and a SIGCHLD wake-up pipe;
    forking from one thread is what keeps the programs' start safe."""

    def __init__(self, listener: socket.socket, initial: Initial) -> None:
        self.listener, self.initial, self.pid = listener, initial, os.getpid()
        self.selector = selectors.DefaultSelector()
        self.connections: dict[int, Connection] = {}  # by the socket's fd
        self.children: dict[int, Connection | None] = {}  # pid -> its connection (None once that closed)
        self.boxes: dict[int, tuple[int, str]] = {}  # pid -> its box's uid and directory, until swept
        self.stopping = False
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        listener.setblocking(False)
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")

    def _stop(self, *_: Any) -> None:
        self.stopping = True

    def serve(self) -> None:
        while not self.stopping:
            for key, _ in self.selector.select(timeout=1.0):
                if key.data == "accept":
                    self._accept()
                elif key.data == "wake":
                    _drain(self.wake_r)
                else:
                    self._on_readable(key.data)
            self._reap()
        for pid in list(self.children):
            self._kill(pid)
        while self.children:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                return
            self._ended(pid, status)

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)
        connection = Connection(sock)
        self.connections[sock.fileno()] = connection
        self.selector.register(sock, selectors.EVENT_READ, connection)

    def _on_readable(self, connection: Connection) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(connection.sock, RECV_BYTES, 4)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, fds = b"", []
        connection.fds += fds
        if not data:
            self._close(connection)
            return
        connection.buffer += data
        while b"\n" in connection.buffer:
            line, _, rest = bytes(connection.buffer).partition(b"\n")
            connection.buffer = bytearray(rest)
            if connection.pid is None:
                self._start(connection, line)
            elif json.loads(line).get("kill") and connection.pid in self.children:
                self._kill(connection.pid, sweep=False)
        if connection.pid is None and len(connection.buffer) > MAX_REQUEST_BYTES:
            self._refuse(connection, f"request over {MAX_REQUEST_BYTES} bytes")

    def _start(self, connection: Connection, line: bytes) -> None:
        try:
            request = json.loads(line)
            agent_class, env = str(request["agent_class"]), {str(k): str(v) for k, v in request["env"].items()}
            cwd, worker_pid = str(request["cwd"]), int(request["worker_pid"])
            box = request.get("box")
            if box is not None and not isinstance(box, dict):
                raise TypeError("box is not an object")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self._refuse(connection, f"malformed request: {exc!r}")
            return
        if len(connection.fds) != 1:
            self._refuse(connection, f"expected the output pipe with the request, got {len(connection.fds)} fds")
            return
        output = connection.fds.pop()
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here may be written twice
            stream.flush()
        gc.freeze()  # the program's collections never touch (and so never copy) the server's objects
        pid = os.fork()
        if pid == 0:
            try:
                self._child(output, agent_class, env, cwd, worker_pid, box)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(127)
        os.close(output)
        connection.pid = pid
        self.children[pid] = connection
        if box is not None:
            self.boxes[pid] = (box_uid(int(box["uid_base"]), pid), str(box["directory"]))
        _send(connection.sock, {"pid": pid})

    def _child(
        self, output: int, agent_class: str, env: dict[str, str], cwd: str, worker_pid: int, box: dict[str, Any] | None
    ) -> None:
        gc.enable()
        os.setsid()
        signal.set_wakeup_fd(-1)
        for signum, handler in self.initial.handlers.items():
            if handler is None:  # set outside Python: neither changed here nor restorable
                continue
            try:
                signal.signal(signum, handler)
            except (OSError, ValueError, TypeError):
                pass
        signal.pthread_sigmask(signal.SIG_SETMASK, self.initial.mask)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 65536)
        os.environ.clear()
        os.environ.update({**self.initial.added_env, **env})
        sys.argv = ["-c", agent_class, str(worker_pid)]
        sys.path[:] = self.initial.path
        _fresh_stdio()
        if box is None:
            os.chdir(cwd)
        boxed_or_exit(box, self.pid)
        seal()
        code = run_program(agent_class)
        _finalize()
        os._exit(code)

    def _refuse(self, connection: Connection, why: str) -> None:
        _send(connection.sock, {"error": why})
        self._close(connection)

    def _close(self, connection: Connection) -> None:
        """The worker closed (or lost) the connection: a program it still had is killed with its group."""
        if connection.pid is not None and self.children.get(connection.pid) is connection:
            self._kill(connection.pid, sweep=False)
            self.children[connection.pid] = None
        for fd in connection.fds:
            os.close(fd)
        connection.fds.clear()
        self.connections.pop(connection.sock.fileno(), None)
        try:
            self.selector.unregister(connection.sock)
        except (KeyError, ValueError):
            pass
        connection.sock.close()

    def _reap(self) -> None:
        """Each program that ended: kill what is left of its group and box while its pid is still held (not
        reaped, so neither the group's id nor the box's uid can be reused), then reap it and tell its worker."""
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None or info.si_pid == 0:
                return
            self._kill(info.si_pid)
            _, status = os.waitpid(info.si_pid, 0)
            self._ended(info.si_pid, status)

    def _kill(self, pid: int, *, sweep: bool = True) -> None:
        """Kill the program's group and, when it has a box, everything of its uid (as that uid: the server may lack
        CAP_KILL); with ``sweep``, its box's directory goes too (at the reap: the pid, and so the uid, is still
        held)."""
        _kill_group(pid)
        box = self.boxes.get(pid)
        if box is None:
            return
        if sweep:
            del self.boxes[pid]
            sweep_box(*box)
        else:
            kill_box(box[0])

    def _ended(self, pid: int, status: int) -> None:
        connection = self.children.pop(pid, None)
        if connection is not None:
            _send(connection.sock, {"exit": os.waitstatus_to_exitcode(status)})


def _kill_group(pid: int) -> None:
    if pid < 1:  # killpg(0) would be the server's own group
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    try:
        sock.setblocking(True)
        sock.settimeout(5.0)
        sock.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass  # the worker went: its connection's close kills the program
    finally:
        try:
            sock.setblocking(False)
        except OSError:
            pass


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, InterruptedError):
        pass


def _fresh_stdio() -> None:
    """``sys.stdin/stdout/stderr`` as a starting interpreter makes them for fds 0-2 (CPython's ``create_stdio``):
    stdout block-buffered on a pipe, stderr line-buffered with ``backslashreplace``, unbuffered under ``-u``."""
    encoding = sys.stdout.encoding if sys.stdout is not None else "utf-8"
    errors = sys.stdout.errors if sys.stdout is not None else "strict"
    unbuffered = bool(getattr(sys.__stdout__, "write_through", False))  # -u or PYTHONUNBUFFERED
    streams = []
    for fd, write in ((0, False), (1, True), (2, True)):
        raw_only = write and unbuffered
        buffer = open(fd, "wb" if write else "rb", buffering=0 if raw_only else -1, closefd=False)  # noqa: SIM115
        raw = buffer if raw_only else buffer.raw  # type: ignore[attr-defined]
        line = not unbuffered and (raw.isatty() or fd == 2)
        text = io.TextIOWrapper(
            buffer,
            encoding=encoding,
            errors="backslashreplace" if fd == 2 else errors,
            newline="\n" if write else None,
            line_buffering=line,
            write_through=raw_only,
        )
        streams.append(text)
    sys.stdin, sys.stdout, sys.stderr = streams
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams  # type: ignore[misc]


def _finalize() -> None:
    """What an interpreter does at its end before the process exits: join non-daemon threads, run atexit."""
    threading = sys.modules.get("threading")
    if threading is not None:
        try:
            threading._shutdown()
        except Exception:
            traceback.print_exc()
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def preload(required: list[str], optional: list[str]) -> tuple[list[str], dict[str, str]]:
    """Import the modules; a required one that fails raises, an optional one is skipped with the reason."""
    loaded, skipped = [], {}
    for name in required:
        importlib.import_module(name)
        loaded.append(name)
    for name in optional:
        try:
            importlib.import_module(name)
        except Exception as exc:
            skipped[name] = f"{type(exc).__name__}: {exc}"
        else:
            loaded.append(name)
    return loaded, skipped


def server_main() -> None:
    """The node's program server: capture the interpreter's initial state, import the modules, listen, report
    ready (or why not) on the ready fd, serve until SIGTERM or its parent's death.

    Its parent, the worker, dying sends it SIGTERM (as ``ProgramServer.stop`` does): it kills its programs'
    groups. Whatever ends it short of SIGKILL, it removes its socket's directory on the way out, so a worker killed
    leaves nothing in TMPDIR; the worker's supervisor makes the directory again for the server it starts next."""
    config = json.loads(sys.argv[1])
    initial = Initial.capture(config["given"])
    try:
        _serve(config, initial, int(config["worker_pid"]))
    finally:
        shutil.rmtree(os.path.dirname(config["socket"]), ignore_errors=True)


def _terminate(*_: Any) -> None:
    raise SystemExit(143)  # SIGTERM before the server serves (its imports): exit through the cleanup


def _serve(config: dict[str, Any], initial: Initial, worker_pid: int) -> None:
    gc.disable()  # no collections leaving holes in the pages the programs share (Python's gc.freeze recipe)
    ready = os.fdopen(int(config["ready_fd"]), "w")
    signal.signal(signal.SIGTERM, _terminate)
    try:
        if not die_with_parent(worker_pid, signal.SIGTERM):
            raise SystemExit(1)
        loaded, skipped = preload(config["preload"], config["optional"])
        path = config["socket"]
        if os.path.exists(path):
            os.unlink(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        os.chmod(path, 0o600)
        listener.listen(128)
    except BaseException as exc:
        with contextlib.suppress(OSError):  # the worker may be gone
            ready.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
            ready.close()
        sys.exit(2)
    threads = sys.modules["threading"].active_count() if "threading" in sys.modules else 1
    ready.write(json.dumps({"loaded": loaded, "skipped": skipped, "threads": threads}) + "\n")
    ready.close()
    Server(listener, initial).serve()
