"""Agent Lightning 1.0 agent programs for the tests: classes with ``run()``, started by the workers exactly as
1.0's ``local`` runner starts them (the task's fields arrive through ``config.local.env_map``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import httpx


def _post_reward(value: float) -> None:
    response = httpx.post(
        os.environ["AGL_EVENT_URL"],
        json={"event_type": "reward", "data": {"value": value}},
        headers={"Authorization": f"Bearer {os.environ['AGL_KEY']}"},
        timeout=10,
    )
    response.raise_for_status()


class AskAndReward:
    """Asks the LLM the task's question through the gateway's proxy, then posts the task's reward."""

    def run(self) -> None:
        from openai import OpenAI  # here: the other agents also run under interpreters without openai

        client = OpenAI(base_url=os.environ["AGL_OPENAI_BASE_URL"], api_key=os.environ["AGL_KEY"] or "none")
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": os.environ["TASK_QUESTION"]}])
        _post_reward(float(json.loads(os.environ["TASK_REWARD"])))


class Crashing:
    def run(self) -> None:
        print("about to fail", flush=True)
        raise RuntimeError("the agent broke on purpose")


class Sleeping:
    """Starts a child of its own (to show the whole group is killed), writes both pids and its uid, then sleeps."""

    def run(self) -> None:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.environ["PID_FILE"], "w") as out:
            out.write(f"{os.getpid()} {child.pid} {os.getuid()}\n")
        time.sleep(600)


class SlowReward:
    """Sleeps ``TASK_SLEEP`` seconds, then posts the task's reward: long enough to lose its worker meanwhile."""

    def run(self) -> None:
        time.sleep(float(os.environ["TASK_SLEEP"]))
        _post_reward(float(json.loads(os.environ["TASK_REWARD"])))


class DumpEnv:
    """Writes its whole environment as JSON to ``DUMP_FILE``, then posts the task's reward."""

    def run(self) -> None:
        with open(os.environ["DUMP_FILE"], "w") as out:
            json.dump(dict(os.environ), out)
        _post_reward(float(json.loads(os.environ["TASK_REWARD"])))


class Tattletale:
    """What a broker writer would run: leaves ``MARKER_FILE`` behind to show it ran."""

    def run(self) -> None:
        with open(os.environ["MARKER_FILE"], "w") as out:
            out.write("ran\n")


class Quick:
    """Exits 0 at once."""

    def run(self) -> None:
        print("quick", flush=True)


class LeavesChild:
    """Starts a child that outlives it, writes both pids and its uid to ``PID_FILE`` and exits 0 at once."""

    def run(self) -> None:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=False)
        with open(os.environ["PID_FILE"], "w") as out:
            out.write(f"{os.getpid()} {child.pid} {os.getuid()}\n")


class LongLine:
    """Writes 2 MB without a newline, then fails."""

    def run(self) -> None:
        sys.stdout.write("x" * (2 * 1024 * 1024))
        sys.stdout.flush()
        raise SystemExit(3)


class Facts:
    """Writes what its process looks like from inside as JSON to ``FACTS_FILE`` (environment, cwd, argv, open
    files, session, signals, streams...), writes a line to stdout and one to stderr, and exits 0: a warm
    start's program must look like a cold start's."""

    def run(self) -> None:
        import random
        import signal

        fds = sorted(os.listdir("/proc/self/fd"))
        fds = [fd for fd in fds if os.path.exists(f"/proc/self/fd/{fd}")]  # the listing's own fd is gone now
        handlers = {}
        for signum in sorted(signal.valid_signals()):
            if signum in (signal.SIGKILL, signal.SIGSTOP):
                continue
            try:
                handler = signal.getsignal(signum)
            except (OSError, ValueError):
                continue
            handlers[int(signum)] = getattr(handler, "__name__", repr(handler))
        streams = {
            name: [
                stream.encoding,
                stream.errors,
                stream.line_buffering,
                getattr(stream, "write_through", None),
                stream.fileno(),
            ]
            for name, stream in (("stdin", sys.stdin), ("stdout", sys.stdout), ("stderr", sys.stderr))
        }
        facts = {
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "argv": sys.argv,
            "path": sys.path,
            "fds": {fd: os.readlink(f"/proc/self/fd/{fd}").split(":")[0] for fd in fds},
            "session_leader": os.getsid(0) == os.getpid(),
            "group_leader": os.getpgid(0) == os.getpid(),
            "signals": handlers,
            "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            "streams": streams,
            "stdout_isatty": sys.stdout.isatty(),
            "stdin_empty": sys.stdin.read() == "",
            "umask": os.umask(0o022),
            "executable": sys.executable,
            "version": list(sys.version_info[:2]),
            "flags": list(sys.flags),
            "main_thread_only": __import__("threading").active_count() == 1,
            "gc_enabled": __import__("gc").isenabled(),
            "random": random.random(),
        }
        with open(os.environ["FACTS_FILE"], "w") as out:
            json.dump(facts, out)
        print("to stdout")
        print("to stderr", file=sys.stderr)


class ExitWith:
    """Exits with the code ``EXIT_CODE`` names, after a short sleep (to overlap with others)."""

    def run(self) -> None:
        time.sleep(0.2)
        sys.exit(int(os.environ["EXIT_CODE"]))


class Trespasser:
    """A hostile program: with only what its environment gives it, tries each thing beyond its own rollout
    against the relay its URLs name and against the gateway itself (``GATEWAY``, which a program could guess),
    writes each answer's status to ``DUMP_FILE``, then posts its own reward as any program may."""

    def run(self) -> None:
        victim, gateway = os.environ["VICTIM"], os.environ["GATEWAY"]
        base = os.environ["AGL_OPENAI_BASE_URL"]
        relay = base[: base.index("/proxy/")]
        own = base[len(relay) :].removesuffix("/openai/v1")
        rollout, attempt = own.split("/")[3], own.split("/")[5]
        tries = {
            "list rollouts": ("GET", "/api/rollouts", None),
            "read another rollout": ("GET", f"/api/rollouts/{victim}", None),
            "read its own rollout": ("GET", f"/api/rollouts/{rollout}", None),
            "patch another rollout": ("PATCH", f"/api/rollouts/{victim}", {"status": {"state": "failed"}}),
            "delete another rollout": ("DELETE", f"/api/rollouts/{victim}", None),
            "create a rollout": ("POST", "/api/rollouts", [{"input": {}, "config": {"local": {"agent_class": "a:B"}}}]),
            "reward another attempt": (
                "POST",
                f"/api/rollouts/{victim}/attempt/0/events",
                {"event_type": "reward", "data": {"value": 1.0}},
            ),
            "reward a made-up attempt": (
                "POST",
                f"/api/rollouts/{rollout}/attempt/{attempt}x/events",
                {"event_type": "reward", "data": {"value": 1.0}},
            ),
            "read events": ("GET", f"/api/rollouts/{victim}/events", None),
            "pause the proxy": ("POST", "/proxy/pause", {}),
            "resume the proxy": ("POST", "/proxy/resume", {}),
            "register a model server": ("POST", "/api/models", [{"url": "http://attacker.example/v1"}]),
            "delete the model servers": ("DELETE", "/api/models", None),
            "call another rollout's proxy": (
                "POST",
                f"/proxy/rollout/{victim}/attempt/0/mode/train/openai/v1/chat/completions",
                {"model": "any", "messages": [{"role": "user", "content": "hi"}]},
            ),
            "climb out of its proxy path": (
                "POST",
                f"{own}/openai/v1/../../../../../../../api/rollouts",
                [{"input": {}, "config": {"local": {"agent_class": "a:B"}}}],
            ),
        }
        key = os.environ["AGL_KEY"]
        seen: dict[str, dict[str, int]] = {}
        with httpx.Client(timeout=10) as client:
            for name, (method, path, body) in tries.items():
                seen[name] = {}
                for where, root in (("relay", relay), ("gateway", gateway)):
                    for header in ({"Authorization": f"Bearer {key}"}, {"x-api-key": key}, {}):
                        request = client.build_request(method, root + path, json=body, headers=header)
                        request.url = request.url.copy_with(raw_path=path.encode())  # no client-side ".." folding
                        label = f"{where} {next(iter(header), 'no key')}"
                        seen[name][label] = client.send(request).status_code
        with open(os.environ["DUMP_FILE"], "w") as out:
            json.dump(seen, out)
        _post_reward(0.125)


class Inmate:
    """A hostile program in its box: tries, with what any program can call, to reach beyond it (signal and
    ``ptrace`` the processes in ``TARGETS``, a JSON object of names to pids; read every process it can see;
    ``SECRET_FILE``; ``OUTSIDE_DIR``; other uids), and writes what it managed as JSON to ``FACTS_FILE``."""

    def run(self) -> None:
        import errno

        own = {os.getpid()}
        status = {}
        with open("/proc/self/status") as lines:
            for line in lines:
                name, _, value = line.partition(":")
                if name in ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapAmb", "NoNewPrivs"):
                    status[name] = value.split()
        read: list[str] = []
        seen = 0
        shown = []  # what every process shows any uid: its command line and status
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in own:
                continue
            try:
                if os.stat(f"/proc/{entry}").st_uid == os.getuid():
                    continue  # its own processes
            except OSError:
                continue
            seen += 1
            for what in ("cmdline", "status"):
                try:
                    with open(f"/proc/{entry}/{what}", "rb") as f:
                        shown.append(f.read().decode(errors="replace"))
                except OSError:
                    pass
            for what in ("environ", "cwd", "fd", "mem", "maps"):
                path = f"/proc/{entry}/{what}"
                try:
                    if what == "cwd":
                        os.readlink(path)
                    elif what == "fd":
                        os.listdir(path)
                    else:
                        with open(path, "rb") as f:
                            if not f.read(1):  # a kernel thread's: nothing to read
                                continue
                    read.append(f"{entry}/{what}")
                except OSError:
                    pass
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        signalled, traced = {}, {}
        for name, pid in json.loads(os.environ.get("TARGETS", "{}")).items():
            try:
                os.kill(int(pid), 0)
                signalled[name] = "allowed"
            except PermissionError:
                signalled[name] = "refused"
            except ProcessLookupError:
                signalled[name] = "gone"
            if libc.ptrace(16, int(pid), None, None) == 0:  # PTRACE_ATTACH
                traced[name] = "attached"
                libc.ptrace(17, int(pid), None, None)  # PTRACE_DETACH
            else:
                traced[name] = errno.errorcode.get(ctypes.get_errno(), "?")

        def attempt(action: Any) -> str:
            try:
                action()
                return "done"
            except OSError as exc:
                return errno.errorcode.get(exc.errno or 0, str(exc))

        def read_secret() -> None:
            with open(os.environ["SECRET_FILE"]) as f:
                f.read()

        def write_outside() -> None:
            with open(os.path.join(os.environ["OUTSIDE_DIR"], "written-by-a-program"), "w") as f:
                f.write("x")

        cwd = os.getcwd()
        facts = {
            "uid": os.getuid(),
            "status": status,
            "cwd": cwd,
            "cwd_mode": oct(os.stat(cwd).st_mode & 0o7777),
            "home": os.environ.get("HOME"),
            "tmpdir": os.environ.get("TMPDIR"),
            "umask": os.umask(0o077),
            "seen": seen,
            "read": read,
            "shown": shown,
            "signalled": signalled,
            "traced": traced,
            "secret": attempt(read_secret),
            "outside": attempt(write_outside),
            "setuid_0": attempt(lambda: os.setuid(0)),
            "setuid_worker": attempt(lambda: os.setuid(int(os.environ.get("WORKER_UID", "1000")))),
        }
        with open(os.environ["FACTS_FILE"], "w") as out:
            os.fchmod(out.fileno(), 0o644)  # its report, for a reader without CAP_DAC_OVERRIDE (a container's root)
            json.dump(facts, out)


class Hog:
    """Runs into the limit ``HOG`` names (``cpu``, ``memory``, ``files``, ``processes``: children that sleep) and,
    for processes, writes how many it made to ``FACTS_FILE``; the error (or SIGXCPU) ends it."""

    def run(self) -> None:
        kind = os.environ["HOG"]
        if kind == "cpu":
            while True:
                pass
        if kind == "memory":
            hoard = []
            while True:
                hoard.append(bytearray(64 * 2**20))
        if kind == "files":
            files = []
            while True:
                files.append(open(os.devnull))  # noqa: SIM115
        if kind == "processes":
            children = 0
            try:
                while True:
                    if os.fork() == 0:
                        time.sleep(600)
                        os._exit(0)
                    children += 1
            finally:
                with open(os.environ["FACTS_FILE"], "w") as out:
                    json.dump({"children": children}, out)


class Filler:
    """Writes ``FILL_MB`` MiB in 1 MiB writes, into files of ``FILL_FILE_MB`` MiB (default 4) in its cwd, or in its
    TMPDIR with ``FILL_WHERE=tmp``, then posts ``TASK_REWARD`` where that is set. A write that fails ends it with that
    error, after it wrote JSON facts to ``FACTS_FILE`` where set (MiB written, the error's errno, its directory's
    size as statvfs reads it) and waited for ``GO_FILE`` to exist, where set (at most 60 s): meanwhile its box,
    full, lives on."""

    def run(self) -> None:
        where = os.getcwd() if os.environ.get("FILL_WHERE", "cwd") == "cwd" else os.environ["TMPDIR"]
        wanted, per_file = int(os.environ["FILL_MB"]) * 2**20, int(os.environ.get("FILL_FILE_MB", "4")) * 2**20
        block, written, failed = b"x" * 2**20, 0, None
        try:
            while written < wanted:
                with open(os.path.join(where, f"fill-{written // per_file}"), "ab", buffering=0) as out:
                    while written < wanted and out.tell() < per_file:
                        written += out.write(block) or 0
        except OSError as exc:
            failed = exc
        size = os.statvfs(where)
        facts = {"written_mb": written / 2**20, "errno": failed.errno if failed else None, "where": where}
        facts["size_mb"] = size.f_blocks * size.f_frsize / 2**20
        if os.environ.get("FACTS_FILE"):
            with open(os.environ["FACTS_FILE"], "w") as out:
                os.fchmod(out.fileno(), 0o644)
                json.dump(facts, out)
        if failed is not None:
            deadline = time.monotonic() + 60
            while os.environ.get("GO_FILE") and not os.path.exists(os.environ["GO_FILE"]):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            raise failed
        if os.environ.get("TASK_REWARD"):
            _post_reward(float(json.loads(os.environ["TASK_REWARD"])))


class Escapee:
    """Leaves a process behind outside its session (a double fork and ``setsid``), writes its pid to
    ``PID_FILE`` and exits 0: only a sweep of its uid finds it."""

    def run(self) -> None:
        read_end, write_end = os.pipe()
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.write(write_end, str(os.getpid()).encode())
                time.sleep(600)
            os._exit(0)
        os.close(write_end)
        pid = os.read(read_end, 64).decode()
        with open(os.environ["PID_FILE"], "w") as out:
            out.write(pid)


class Litterer:
    """Leaves a file in each directory of ``LITTER`` (comma-separated: /tmp, /dev/shm, a world-writable folder)
    named ``LITTER_NAME``, and exits 0."""

    def run(self) -> None:
        for directory in os.environ["LITTER"].split(","):
            with open(os.path.join(directory, os.environ["LITTER_NAME"]), "w") as out:
                out.write("left for the next program of this uid\n")


class Dialer:
    """Connects to each ``host:port`` of ``DIAL`` (comma-separated) and writes, as JSON to ``FACTS_FILE``, which
    answered (``ok``) and which did not (the error's name)."""

    def run(self) -> None:
        import socket

        reached = {}
        for target in os.environ["DIAL"].split(","):
            host, _, port = target.rpartition(":")
            try:
                socket.create_connection((host, int(port)), timeout=5).close()
                reached[target] = "ok"
            except OSError as exc:
                reached[target] = type(exc).__name__
        with open(os.environ["FACTS_FILE"], "w") as out:
            os.fchmod(out.fileno(), 0o644)
            json.dump(reached, out)
