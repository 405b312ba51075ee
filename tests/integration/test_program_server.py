"""The 1.0 program server and both starts of a program (``workers.v1.launch``), with real processes and no
Celery: what a warm program sees against a cold one, exit codes and output, the group kill, a server SIGKILLed
under its programs or hung, a requesting process that dies, concurrent requests from threads, and the protocol's
refusals.
The same guarantees under Celery's pools: tests/integration/test_agl_v1.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.core.infra import ConfigError
from bridge.core.settings import Settings, load_settings
from bridge_lab.agl_v1_env import v1_virtualenv
from tests.helpers import process_alive, serving_programs, wait_for
from workers.lifecycle import state
from workers.v1 import launch, program_client
from workers.v1.environment import base_environment
from workers.v1.programs import ColdProgram, Program, ProgramLost, WarmProgram, kill_group
from workers.v1.server_supervisor import ProgramServer

pytestmark = [pytest.mark.cost(12)]

ROOT = Path(__file__).resolve().parents[2]
AGENTS = "tests.agl_v1_agents"


@pytest.fixture(scope="module")
def settings() -> Settings:
    return load_settings(agl_v1_pass_env="PYTHONPATH")


@pytest.fixture(scope="module")
def server(settings: Settings) -> Iterator[ProgramServer]:
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    with serving_programs(settings) as started:
        yield started


def env_for(settings: Settings, **extra: str) -> dict[str, str]:
    """A program's environment as the attempt builds it: the base, the attempt's own variables."""
    return {**base_environment(settings), "AGL_KEY": "k", **extra}


def run(program: Program, timeout_s: float = 30) -> tuple[int | None, str]:
    """Read the program's output to its end, then its exit code."""
    out = b""
    while chunk := os.read(program.output_fd, 4096):
        out += chunk
    code = program.wait(timeout_s)
    program.kill()
    return code, out.decode()


def warm(server: ProgramServer, agent: str, env: dict[str, str]) -> WarmProgram:
    program = server.start_program(f"{AGENTS}:{agent}", env)
    assert isinstance(program, WarmProgram)
    return program


def cold(agent: str, env: dict[str, str]) -> ColdProgram:
    return ColdProgram(sys.executable, f"{AGENTS}:{agent}", env)


def test_a_warm_program_sees_exactly_what_a_cold_one_sees(
    server: ProgramServer, settings: Settings, tmp_path: Path
) -> None:
    facts = {}
    env = env_for(settings, FACTS_FILE=str(tmp_path / "facts"), TASK=json.dumps({"q": "what?"}))
    for start in ("warm", "cold"):
        program = warm(server, "Facts", env) if start == "warm" else cold("Facts", env)
        code, out = run(program)
        assert code == 0, out
        assert out.splitlines() == ["to stdout", "to stderr"] or sorted(out.splitlines()) == ["to stderr", "to stdout"]
        facts[start] = json.loads((tmp_path / "facts").read_text())
    warm_facts, cold_facts = facts["warm"], facts["cold"]
    assert warm_facts.pop("random") != cold_facts.pop("random")  # each program draws its own numbers
    assert warm_facts == cold_facts
    assert warm_facts["fds"] == {"0": "/dev/null", "1": "pipe", "2": "pipe"}  # no server socket, no other file
    assert warm_facts["session_leader"] and warm_facts["group_leader"] and warm_facts["main_thread_only"]
    assert warm_facts["argv"] == ["-c", f"{AGENTS}:Facts", str(os.getpid())]


def test_a_crashing_program_reports_its_exit_code_and_last_lines_warm_as_cold(
    server: ProgramServer, settings: Settings
) -> None:
    warm_code, warm_out = run(warm(server, "Crashing", env_for(settings)))
    cold_code, cold_out = run(cold("Crashing", env_for(settings)))
    assert warm_code == cold_code == 1
    assert warm_out == cold_out and "about to fail" in warm_out and "the agent broke on purpose" in warm_out
    code, out = run(warm(server, "LongLine", env_for(settings)))  # a SystemExit's own code; output unbuffered
    assert code == 3 and len(out) == 2 * 1024 * 1024


def test_a_killed_warm_program_takes_its_whole_group_with_it(
    server: ProgramServer, settings: Settings, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pids"
    program = warm(server, "Sleeping", env_for(settings, PID_FILE=str(pid_file)))
    wait_for(lambda: len(pid_file.read_text().split()) == 3 if pid_file.exists() else False, 30, "both pids")
    pids = [int(p) for p in pid_file.read_text().split()[:2]]
    assert pids[0] == program.pid and program.wait(0.2) is None  # still running: no exit code yet
    program.kill()
    assert program.code == -signal.SIGKILL
    wait_for(lambda: not any(process_alive(pid) for pid in pids), 10, "the program and its child gone")


def test_children_a_warm_program_leaves_behind_at_its_exit_are_killed(
    server: ProgramServer, settings: Settings, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pids"
    program = warm(server, "LeavesChild", env_for(settings, PID_FILE=str(pid_file)))
    assert program.wait(30) == 0
    pids = [int(p) for p in pid_file.read_text().split()[:2]]
    wait_for(lambda: not any(process_alive(pid) for pid in pids), 10, "the child it left gone")
    program.kill()


def test_a_program_dies_with_the_worker_process_that_asked_for_it(
    server: ProgramServer, settings: Settings, tmp_path: Path
) -> None:
    """A prefork pool process connects to the node's server and dies: its program dies with its connection."""
    pid_file = tmp_path / "pids"
    script = (
        "import json, sys, time; from workers.v1.program_client import request_program; "
        f"p = request_program({server.socket_path!r}, '{AGENTS}:Sleeping', json.loads(sys.argv[1])); "
        "print(p.pid, flush=True); time.sleep(600)"
    )
    env = json.dumps(env_for(settings, PID_FILE=str(pid_file)))
    asker = subprocess.Popen([sys.executable, "-c", script, env], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        assert asker.stdout is not None
        int(asker.stdout.readline())
        wait_for(lambda: pid_file.exists() and len(pid_file.read_text().split()) == 3, 30, "both pids")
        pids = [int(p) for p in pid_file.read_text().split()[:2]]
        asker.kill()
        asker.wait(10)
        wait_for(lambda: not any(process_alive(pid) for pid in pids), 10, "the program and its child gone")
    finally:
        asker.kill()
        asker.wait(10)


def test_a_node_that_dies_takes_its_server_and_programs_with_it(settings: Settings, tmp_path: Path) -> None:
    """The worker's main process SIGKILLed: its server dies (PR_SET_PDEATHSIG on the supervisor thread), the
    program with the server, and the server's socket directory goes with them (nothing left in TMPDIR)."""
    pid_file = tmp_path / "pids"
    script = (
        "import json, sys, time; from bridge.core.settings import load_settings; from workers.v1 import launch; "
        "s = load_settings(agl_v1_pass_env='PYTHONPATH'); server = launch.node_server(s); "
        f"p = server.start_program('{AGENTS}:Sleeping', json.loads(sys.argv[1])); "
        "print(server.process.pid, server.directory, flush=True); time.sleep(600)"
    )
    env = json.dumps(env_for(settings, PID_FILE=str(pid_file)))
    node = subprocess.Popen([sys.executable, "-c", script, env], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        assert node.stdout is not None
        pid_text, directory = node.stdout.readline().decode().split()
        server_pid = int(pid_text)
        assert os.path.isdir(directory) and Path(directory).name.startswith("agl-v1-programs-")
        wait_for(lambda: pid_file.exists() and len(pid_file.read_text().split()) == 3, 30, "both pids")
        program_pid = int(pid_file.read_text().split()[0])
        node.kill()
        node.wait(10)
        wait_for(lambda: not process_alive(server_pid) and not process_alive(program_pid), 10, "server, program gone")
        wait_for(lambda: not os.path.exists(directory), 10, "the server's socket directory removed")
    finally:
        node.kill()
        node.wait(10)
        for pid in [int(p) for p in pid_file.read_text().split()[:2]] if pid_file.exists() else []:
            kill_group(pid)


def test_a_server_killed_under_its_program_loses_it_and_a_new_server_serves_the_next(
    server: ProgramServer, settings: Settings, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pids"
    program = warm(server, "Sleeping", env_for(settings, PID_FILE=str(pid_file)))
    wait_for(lambda: pid_file.exists() and len(pid_file.read_text().split()) == 3, 30, "both pids")
    pids = [int(p) for p in pid_file.read_text().split()[:2]]
    assert server.process is not None
    old = server.process.pid
    os.kill(old, signal.SIGKILL)
    with pytest.raises(ProgramLost):
        while program.wait(1.0) is None:
            pass
    program.kill()  # the leader died with its server (PR_SET_PDEATHSIG); its child goes with the group kill
    wait_for(lambda: not any(process_alive(pid) for pid in pids), 10, "the program and its child gone")
    wait_for(
        lambda: server.ready.is_set() and server.process is not None and server.process.pid != old, 60, "a new one"
    )
    code, out = run(warm(server, "Quick", env_for(settings)))
    assert code == 0 and out == "quick\n"
    assert server.restarts >= 1


def test_a_server_stopped_while_its_worker_lives_is_replaced_in_its_directory_made_again(
    server: ProgramServer, settings: Settings
) -> None:
    """SIGTERM (not the worker's stop): the server removes its directory on the way out, as at its worker's death;
    the supervisor makes it again, private, for the next server."""
    wait_for(lambda: server.ready.is_set(), 60, "a server")
    assert server.process is not None
    old = server.process.pid
    os.kill(old, signal.SIGTERM)
    wait_for(lambda: not process_alive(old), 10, "the server gone")
    wait_for(
        lambda: server.ready.is_set() and server.process is not None and server.process.pid != old, 60, "a new one"
    )
    assert stat.S_IMODE(os.stat(server.directory).st_mode) == 0o700
    assert run(warm(server, "Quick", env_for(settings))) == (0, "quick\n")


def test_requests_from_many_threads_each_get_their_own_program(server: ProgramServer, settings: Settings) -> None:
    """The ``-P threads`` case: one connection per program, nothing shared between the threads' requests."""
    codes: dict[int, int | None] = {}

    def one(i: int) -> None:
        codes[i] = run(warm(server, "ExitWith", env_for(settings, EXIT_CODE=str(10 + i))))[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert codes == {i: 10 + i for i in range(8)}


def test_the_channel_is_a_unix_socket_in_a_private_directory_and_refuses_malformed_requests(
    server: ProgramServer,
) -> None:
    assert stat.S_IMODE(os.stat(server.directory).st_mode) == 0o700
    assert stat.S_ISSOCK(os.stat(server.socket_path).st_mode)
    for request, fds, why in (
        (b"not json\n", True, "malformed request"),
        (b'{"agent_class": "a:B", "env": {}, "cwd": "/", "worker_pid": 1}\n', False, "expected the output pipe"),
    ):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(server.socket_path)
        read_fd, write_fd = os.pipe()
        socket.send_fds(sock, [request], [write_fd] if fds else [])
        sock.settimeout(10)
        assert why in json.loads(sock.recv(4096))["error"]
        sock.close()
        os.close(read_fd)
        os.close(write_fd)


def test_a_preload_that_does_not_import_stops_the_start_with_the_reason(settings: Settings) -> None:
    broken = load_settings(agl_v1_pass_env="PYTHONPATH", agl_v1_preload="no_such_module_here")
    with pytest.raises(ConfigError, match="no_such_module_here"):
        ProgramServer(broken).start()
    with pytest.raises(ConfigError, match="AGL_V1_PRELOAD_AGENTS needs AGL_V1_AGENT_MODULES"):
        load_settings(agl_v1_preload_agents=True)


def test_with_warm_start_off_a_program_starts_cold(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    cold_settings = load_settings(agl_v1_pass_env="PYTHONPATH", agl_v1_warm_start=False)
    monkeypatch.setattr(state.node, "program_server", None)
    started = time.monotonic()
    program = launch.start_program(cold_settings, f"{AGENTS}:Quick", env_for(cold_settings))
    assert isinstance(program, ColdProgram) and state.node.program_server is None
    assert run(program) == (0, "quick\n") and time.monotonic() - started < 60


def test_a_server_that_hangs_is_killed_at_the_reply_timeout_and_replaced(
    server: ProgramServer, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(program_client, "REPLY_TIMEOUT_S", 2.0)
    wait_for(lambda: server.ready.is_set(), 60, "a server")
    assert server.process is not None
    hung = server.process.pid
    os.kill(hung, signal.SIGSTOP)
    try:
        with pytest.raises(ProgramLost, match="did not answer within 2s"):
            server.start_program(f"{AGENTS}:Quick", env_for(settings))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung, signal.SIGCONT)
    wait_for(lambda: server.ready.is_set() and getattr(server.process, "pid", hung) != hung, 60, "a new server")
    assert run(warm(server, "Quick", env_for(settings))) == (0, "quick\n")


def test_programs_run_under_agl_v1_agent_python_warm_and_cold(tmp_path: Path) -> None:
    """AGL_V1_AGENT_PYTHON, what the worker-agl-v1 image sets: the server and cold programs run under that
    interpreter (here the 1.0 virtualenv's Python 3.12, without this project), not the worker's."""
    python = str(v1_virtualenv() / "bin/python")
    other = load_settings(agl_v1_pass_env="PYTHONPATH", agl_v1_agent_python=python)
    env = env_for(other, FACTS_FILE=str(tmp_path / "facts"))
    started = ProgramServer(other)
    started.start()
    facts = {}
    try:
        for start in ("warm", "cold"):
            if start == "warm":
                program: Program = warm(started, "Facts", env)
            else:
                program = ColdProgram(python, f"{AGENTS}:Facts", env)
            code, out = run(program)
            assert code == 0, out
            facts[start] = json.loads((tmp_path / "facts").read_text())
    finally:
        started.stop()
    for seen in facts.values():
        assert seen["executable"] == python and seen["version"] >= [3, 12]
    facts["warm"].pop("random"), facts["cold"].pop("random")
    assert facts["warm"] == facts["cold"]
