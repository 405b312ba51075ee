"""1.0 programs in their boxes (``workers.v1.box``, ``enter_box`` in ``workers.v1.program_server``), warm and cold,
with real processes and no Celery: a hostile program (``Inmate``) reaches nothing beyond its box, a program that
runs into a limit fails naming it, and nothing of a box outlives its program. The same under Celery's pools, with
a real gateway: tests/integration/test_agl_v1.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from bridge.core.settings import Settings, load_settings
from tests.helpers import program_alive, serving_programs, wait_for
from workers.v1 import box
from workers.v1.environment import base_environment
from workers.v1.program_directories import pid_namespace
from workers.v1.program_server import OOM_SCORE_ADJ, box_uid
from workers.v1.programs import ColdProgram, Program
from workers.v1.server_supervisor import ProgramServer

pytestmark = [pytest.mark.cost(10)]

ROOT = Path(__file__).resolve().parents[2]
AGENTS = "tests.agl_v1_agents"
STARTS = ["warm", "cold"]
SWEEP = [sys.executable, "-c", "import sys; from workers.v1 import program_directories as d; "]
SWEEP[-1] += "print(d.sweep_stale_directories(sys.argv[1]))"


@pytest.fixture(scope="module")
def settings() -> Settings:
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return load_settings(agl_v1_pass_env="PYTHONPATH", agl_v1_program_max_processes=32, agl_v1_program_memory_mb=768)


@pytest.fixture(scope="module")
def server(settings: Settings) -> Iterator[ProgramServer]:
    with serving_programs(settings) as started:
        yield started


def start(server: ProgramServer, settings: Settings, how: str, agent: str, **env: str) -> Program:
    """A boxed program, as ``launch.start_program`` starts one."""
    given = {**base_environment(settings), "AGL_KEY": "k", **env}
    boxed = box.program_box(settings)
    if how == "warm":
        program = server.start_program(f"{AGENTS}:{agent}", given, boxed)
        assert program is not None
        return program
    return ColdProgram(sys.executable, f"{AGENTS}:{agent}", given, boxed)


def finish(program: Program, timeout_s: float = 60) -> tuple[int | None, str]:
    """Its exit code and output, read as the attempt reads it: beside the wait (what it leaves running may hold the
    pipe open until its box is swept)."""
    out: list[bytes] = []

    def read() -> None:
        while chunk := os.read(program.output_fd, 4096):
            out.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code = program.wait(timeout_s)
    program.kill()
    reader.join(10)
    return code, b"".join(out).decode(errors="replace")


def holding(capabilities: str, *argv: str) -> list[str]:
    """``argv`` run with only ``capabilities`` (setpriv's syntax), in every set a child inherits."""
    kept = capabilities
    return ["setpriv", f"--inh-caps={kept}", f"--ambient-caps={kept}", f"--bounding-set={kept}", *argv]


def uid_processes(uid: int) -> list[int]:
    found = []
    for process in psutil.process_iter(["uids"]):
        uids = process.info["uids"]
        if uids is not None and uid in (uids.real, uids.effective, uids.saved):
            found.append(process.pid)
    return found


@pytest.mark.parametrize("how", STARTS)
@pytest.mark.parametrize("namespaces", [True, False], ids=["pid-namespace", "uid-only"])
def test_a_hostile_program_reaches_nothing_beyond_its_box(
    server: ProgramServer, settings: Settings, outbox: Path, tmp_path: Path, how: str, namespaces: bool
) -> None:
    """docs/agl-v1.md, "Boxes": its own uid with no capability, no other process's environ, cwd, fds or memory, no
    signal or ptrace to the worker, its server or another program, the worker's secret file and directory out of
    reach, and its own 0700 directory, gone at its end. In a PID namespace of its own (this worker holds
    CAP_SYS_ADMIN) it sees no other process at all; without one (AGL_V1_PROGRAM_PID_NAMESPACE=false, as in a
    container) the uid alone refuses it."""
    settings = settings.model_copy(update={"agl_v1_program_pid_namespace": namespaces})
    secret = tmp_path / "secret.env"  # as an operator's .env: 0600, the worker's
    secret.write_text("OPENAI_API_KEY=sk-the-operators\n")
    secret.chmod(0o600)
    neighbour = start(server, settings, how, "SlowReward", TASK_SLEEP="30", TASK_REWARD="0", AGL_EVENT_URL="x")
    try:
        facts_file = outbox / f"inmate-{how}.json"
        targets = {"worker": os.getpid(), "server": server.process.pid if server.process else 0}
        targets["neighbour"] = neighbour.pid
        inmate = start(
            server,
            settings,
            how,
            "Inmate",
            FACTS_FILE=str(facts_file),
            TARGETS=json.dumps(targets),
            SECRET_FILE=str(secret),
            OUTSIDE_DIR=str(ROOT),
            WORKER_UID=str(os.getuid()),
        )
        uid = box_uid(settings.agl_v1_program_uid_base, inmate.pid)
        code, output = finish(inmate)
        assert code == 0, output
        facts: dict[str, Any] = json.loads(facts_file.read_text())
    finally:
        neighbour.kill()
    assert facts["uid"] == uid and facts["status"]["Uid"] == [str(uid)] * 4 and facts["status"]["Gid"] == [str(uid)] * 4
    assert facts["status"].get("Groups", []) == []
    for caps in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
        assert int(facts["status"][caps][0], 16) == 0, facts["status"]
    assert facts["status"]["NoNewPrivs"] == ["1"] and facts["read"] == []  # nothing of any process it sees
    if namespaces:  # not one of them exists for it
        assert facts["seen"] == 0 and facts["shown"] == [], facts["shown"]
        assert facts["signalled"] == {"worker": "gone", "server": "gone", "neighbour": "gone"}
        assert facts["traced"] == {"worker": "ESRCH", "server": "ESRCH", "neighbour": "ESRCH"}
    else:  # it sees them, and its uid is refused
        assert facts["seen"] > 2
        assert facts["signalled"] == {"worker": "refused", "server": "refused", "neighbour": "refused"}
        assert facts["traced"] == {"worker": "EPERM", "server": "EPERM", "neighbour": "EPERM"}
    assert facts["secret"] == "EACCES" and facts["outside"] == "EACCES"
    assert facts["setuid_0"] == "EPERM" and facts["setuid_worker"] == "EPERM"
    home = facts["cwd"]
    assert facts["home"] == home and facts["tmpdir"] == home + "/tmp" and facts["cwd_mode"] == "0o700"
    assert facts["umask"] == 0o077 and not (ROOT / "written-by-a-program").exists()
    assert not os.path.exists(home) and uid_processes(uid) == []  # the box is gone with its program


@pytest.mark.parametrize("how", STARTS)
@pytest.mark.parametrize("namespaces", [True, False], ids=["pid-namespace", "uid-only"])
def test_what_a_program_leaves_running_dies_with_its_box_even_out_of_its_session(
    server: ProgramServer, settings: Settings, outbox: Path, how: str, namespaces: bool
) -> None:
    """A process left behind outside the program's session (a double fork): killed with its PID namespace, or by
    the sweep of its uid where there is none."""
    settings = settings.model_copy(update={"agl_v1_program_pid_namespace": namespaces})
    pid_file = outbox / f"pids-{how}-{namespaces}"
    program = start(server, settings, how, "Escapee", PID_FILE=str(pid_file))
    uid = box_uid(settings.agl_v1_program_uid_base, program.pid)
    code, output = finish(program)
    assert code == 0, output
    assert int(pid_file.read_text()) > 0  # it ran, outside the program's session
    wait_for(lambda: uid_processes(uid) == [], 10, "every process of the box's uid gone")


@pytest.mark.parametrize("how", STARTS)
def test_what_a_program_leaves_in_the_shared_temporary_directories_goes_with_its_box(
    server: ProgramServer, settings: Settings, outbox: Path, how: str
) -> None:
    """/tmp and /dev/shm: a file left there would be readable by the next program whose pid, and so uid, is the
    same. (A world-writable folder another uid made there keeps what the program wrote: the tests' outbox.)"""
    name = f"litter-{how}-{os.getpid()}"
    places = [Path("/tmp"), Path("/dev/shm")]
    program = start(server, settings, how, "Litterer", LITTER=",".join(map(str, places)), LITTER_NAME=name)
    code, output = finish(program)
    assert code == 0, output
    left = [str(place / name) for place in places if (place / name).exists()]
    assert left == [], left


@pytest.mark.parametrize(
    ("how", "hog", "named"),
    [
        ("warm", "memory", "AGL_V1_PROGRAM_MEMORY_MB=768"),
        ("cold", "files", "AGL_V1_PROGRAM_MAX_OPEN_FILES=4096"),
        ("warm", "processes", "AGL_V1_PROGRAM_MAX_PROCESSES=32"),
    ],
)
def test_a_program_past_a_limit_fails_naming_it_and_its_box_goes(
    server: ProgramServer, settings: Settings, outbox: Path, how: str, hog: str, named: str
) -> None:
    facts_file = outbox / f"hog-{hog}.json"
    program = start(server, settings, how, "Hog", HOG=hog, FACTS_FILE=str(facts_file))
    uid = box_uid(settings.agl_v1_program_uid_base, program.pid)
    code, output = finish(program)
    assert code == 1, output
    limit = box.limit_hit(code, output, settings)
    assert limit is not None and named in limit, output
    if hog == "processes":  # it forked until its uid held the limit, and every child died with the box
        assert 20 <= json.loads(facts_file.read_text())["children"] < settings.agl_v1_program_max_processes
    wait_for(lambda: uid_processes(uid) == [], 10, "every process of the box's uid gone")


def test_a_program_past_its_cpu_time_ends_by_sigxcpu_naming_the_limit(server: ProgramServer) -> None:
    tight = load_settings(agl_v1_pass_env="PYTHONPATH", agl_v1_program_cpu_s=1)
    program = start(server, tight, "warm", "Hog", HOG="cpu")
    code, output = finish(program)
    assert code == -24 and box.limit_hit(code, output, tight) == "its CPU time limit (AGL_V1_PROGRAM_CPU_S=1)"


def kill_running_programs(outbox: str) -> None:
    """Start ``Sleeping`` warm and cold (no PID namespace, as in a container), kill each while it runs, and print
    for each how it ended: its exit code, and whether anything of its uid outlived the kill by 5 s."""
    settings = load_settings(agl_v1_pass_env="PYTHONPATH", agl_v1_program_pid_namespace=False)
    report: dict[str, Any] = {}
    with serving_programs(settings) as server:
        for how in STARTS:
            pid_file = Path(outbox) / f"sleeping-{how}"
            program = start(server, settings, how, "Sleeping", PID_FILE=str(pid_file))
            wait_for(lambda f=pid_file: f.exists() and len(f.read_text().split()) == 3, 30, "the program's pids")  # type: ignore[misc]
            kept = pid_file.with_name(f"kept-{how}")  # this process's: the box's own files in TMPDIR go with it
            kept.write_text(pid_file.read_text())
            program.kill()
            deadline = time.monotonic() + 5
            while program_alive(kept) and time.monotonic() < deadline:
                time.sleep(0.05)
            report[how] = {"code": program.wait(1), "alive": program_alive(kept)}
    print(json.dumps(report))


def test_a_worker_without_cap_kill_kills_its_running_programs_and_all_they_started(outbox: Path) -> None:
    """The worker's kill of a running program (a stop, a cancel, a lost lease), warm and cold, from a worker that
    holds CAP_SETUID and CAP_SETGID but not CAP_KILL, as docker-compose.yml's worker-agl-v1 runs: a signal from its
    uid to a box's is refused, so the kill goes as the box's uid. (Kept besides, for this test's sake only:
    CAP_SYS_ADMIN to show this machine's interpreter, which lies in root's 0700 home, in the box's mount namespace,
    and CAP_DAC_READ_SEARCH to read the pids the program wrote.)"""
    kept = "-all,+setuid,+setgid,+sys_admin,+dac_read_search"
    done = subprocess.run(
        holding(kept, sys.executable, "-c", f"from {__name__} import kill_running_programs as k; k({str(outbox)!r})"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(outbox)},
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {how: {"code": -9, "alive": False} for how in STARTS}, done.stderr


def test_a_worker_without_setuid_refuses_boxed_programs_with_one_line_naming_it() -> None:
    """A worker without capabilities (as an ordinary user's, or a container's that drops them all): it does not
    start, and says what to grant or set."""
    code = (
        "from bridge.core.settings import load_settings; from workers.v1 import box; "
        "box.check_isolation(load_settings())"
    )
    done = subprocess.run(
        ["setpriv", "--inh-caps=-all", "--bounding-set=-all", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env={**os.environ, "PYTHONPATH": str(ROOT), "AGL_V1_SERVER_URL": "http://127.0.0.1:9"},
    )
    assert done.returncode != 0
    assert "lacks CAP_SETUID and CAP_SETGID" in done.stderr and "AGL_V1_ISOLATION=none" in done.stderr, done.stderr


def test_an_env_file_others_can_read_stops_a_boxed_worker(tmp_path: Path, settings: Settings) -> None:
    (tmp_path / ".env").write_text("REDIS_PASSWORD=p\n")
    (tmp_path / ".env").chmod(0o644)
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(Exception, match=r"readable by every user.*chmod 600"):
            box.check_isolation(settings)
        (tmp_path / ".env").chmod(0o600)
        started = time.monotonic()
        box.check_isolation(settings)  # the probe: a real box of the worker's interpreter
        assert time.monotonic() - started < 30
    finally:
        os.chdir(here)


def test_a_dead_workers_box_root_is_removed_with_its_programs_directories(outbox: Path) -> None:
    """A worker SIGKILLed leaves its box root in TMPDIR, with directories of its programs' uids that the next
    worker cannot remove as itself: the sweep (run as root without CAP_DAC_OVERRIDE, as a container's worker is
    without it) removes each as its owner, then the root, and leaves a live worker's root alone."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    root = outbox / f"agl-v1-boxes-{pid_namespace():x}.{dead.pid}-abc"
    inside = root / "0123456789abcdef"
    (inside / "tmp").mkdir(parents=True)
    (inside / "tmp" / "left").write_text("x")
    for path in (inside, inside / "tmp", inside / "tmp" / "left"):
        os.chown(path, 2_000_000_123, 2_000_000_123)
        path.chmod(0o700)
    root.chmod(0o1733)
    live = outbox / f"agl-v1-boxes-{pid_namespace():x}.{os.getpid()}-def"
    live.mkdir()
    kept = "-all,+setuid,+setgid"
    done = subprocess.run(
        holding(kept, *SWEEP, str(outbox)),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0 and done.stdout.strip() == repr([str(root)]), done
    assert not root.exists() and live.exists()


def test_a_tmpdir_other_uids_cannot_search_still_holds_the_boxes_and_is_left_clean(
    settings: Settings, server: ProgramServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TMPDIR below a 0700 directory (pytest's own, here): the box root is shown in the program's mount namespace,
    and the box's directory is gone after it, as the worker's user removes it."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setenv("TMPDIR", str(private))
    monkeypatch.setattr(tempfile, "tempdir", None)
    program = start(server, settings, "cold", "Quick")
    code, output = finish(program)
    assert code == 0 and "quick" in output, output
    [root] = list(private.iterdir())  # the node's box root, and nothing left in it
    assert root.name.startswith("agl-v1-boxes-") and list(root.iterdir()) == []


def mount_namespace_users(namespace: str) -> list[int]:
    """The pids of the processes in the mount namespace ``namespace`` (``/proc/<pid>/ns/mnt``'s link)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.readlink(f"/proc/{entry}/ns/mnt") == namespace:
                found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.mark.parametrize(("how", "where"), [("warm", "cwd"), ("cold", "tmp"), ("warm", "tmp")])
def test_a_program_past_its_disk_quota_fails_naming_it_beside_a_neighbour_and_its_space_is_freed(
    server: ProgramServer, settings: Settings, outbox: Path, how: str, where: str
) -> None:
    """docs/agl-v1.md, "Boxes": a box's directory (its cwd and TMPDIR together) is a tmpfs of AGL_V1_PROGRAM_DISK_MB
    in its own mount namespace. A program writing past it, in files each under the per-file limit, gets ENOSPC and
    fails naming the quota; a neighbour writing while that box is full has a quota of its own and succeeds; the full
    box's space goes with its mount namespace, which no process holds after the box ends."""
    settings = settings.model_copy(update={"agl_v1_program_disk_mb": 16})
    box.check_isolation(settings)  # the node's probe: as root here, its boxes get PID and mount namespaces
    facts_file, go = outbox / f"fill-{how}-{where}.json", outbox / f"go-{how}-{where}"
    hog = start(
        server, settings, how, "Filler", FILL_MB="1000", FILL_WHERE=where, FACTS_FILE=str(facts_file), GO_FILE=str(go)
    )
    assert hog.box is not None
    directory = str(hog.box["directory"])
    try:
        wait_for(facts_file.exists, 60, "the hog's facts")
        filled = json.loads(facts_file.read_text())
        assert filled["errno"] == 28 and filled["size_mb"] == 16, filled  # ENOSPC, at the quota
        assert 12 <= filled["written_mb"] <= 16 and filled["where"].startswith(directory), filled
        isolation = box.isolation_of(hog.box, hog.pid)  # as its attempt records it
        assert isolation.record()["disk_quota"] is True and isolation.limits["disk_bytes"] == 16 * 2**20
        namespace = os.readlink(f"/proc/{hog.pid}/ns/mnt")  # its keeper's: outside the PID namespace, inside this
        assert Path(f"/proc/{hog.pid}/oom_score_adj").read_text().strip() == str(OOM_SCORE_ADJ)  # killed first
        inside = os.statvfs(f"/proc/{hog.pid}/root{directory}")  # its directory as its own mount namespace shows it
        assert inside.f_blocks * inside.f_frsize == 16 * 2**20 and inside.f_bavail == 0
        assert os.listdir(directory) == []  # outside, an empty mount point: nothing the program wrote
        neighbour_facts = outbox / f"neighbour-{how}-{where}.json"
        neighbour = start(
            server, settings, how, "Filler", FILL_MB="12", FILL_WHERE=where, FACTS_FILE=str(neighbour_facts)
        )
        code, output = finish(neighbour)
        assert code == 0, output
        assert json.loads(neighbour_facts.read_text())["written_mb"] == 12
    finally:
        go.touch()
    code, output = finish(hog)
    assert code == 1 and "[Errno 28] No space left on device" in output, output
    limit = box.limit_hit(code, output, settings, disk_quota=isolation.disk_quota)
    assert limit is not None and "AGL_V1_PROGRAM_DISK_MB=16" in limit, output
    wait_for(lambda: mount_namespace_users(namespace) == [], 10, "no process left in the box's mount namespace")
    assert not os.path.exists(directory)


def test_without_a_mount_namespace_a_box_has_no_disk_quota_says_so_and_keeps_the_per_file_limit(
    server: ProgramServer, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """AGL_V1_PROGRAM_PID_NAMESPACE=false (as a worker without CAP_SYS_ADMIN): no mount namespace, so no quota. The
    worker's start says so, each attempt records it, and a program writes past AGL_V1_PROGRAM_DISK_MB, bounded only
    by AGL_V1_PROGRAM_MAX_FILE_MB per file."""
    settings = settings.model_copy(
        update={"agl_v1_program_pid_namespace": False, "agl_v1_program_disk_mb": 16, "agl_v1_program_max_file_mb": 8}
    )
    with caplog.at_level("INFO", logger="workers.v1.box"):
        box.check_isolation(settings)
    assert "AGL_V1_PROGRAM_DISK_MB=16 is not applied" in caplog.text and "AGL_V1_PROGRAM_MAX_FILE_MB=8" in caplog.text
    assert "no disk quota (no mount namespace)" in caplog.text
    program = start(server, settings, "warm", "Filler", FILL_MB="24", FILL_FILE_MB="4")
    isolation = box.isolation_of(program.box, program.pid)
    assert isolation.record()["disk_quota"] is False and "disk_bytes" not in isolation.limits
    assert "no disk quota" in isolation.describe()
    code, output = finish(program)
    assert code == 0, output  # 24 MiB in its directory, past the 16 a quota would have held
    program = start(server, settings, "cold", "Filler", FILL_MB="12", FILL_FILE_MB="12")
    code, output = finish(program)
    assert code == 1 and "File too large" in output, output
    limit = box.limit_hit(code, output, settings, disk_quota=False)
    assert limit is not None and "AGL_V1_PROGRAM_MAX_FILE_MB=8" in limit
