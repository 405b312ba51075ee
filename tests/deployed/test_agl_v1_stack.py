"""Both lines on one `docker compose up`: profiles `standin`, `agl-v1`, `agl-v1-gateway` and `monitoring` (its
Prometheus; Grafana has no local image and is only read), one project shared by the module's checks.

1.0 rollouts of the built-in WebShop program, created on compose's gateway as 1.0's trainer creates them, run to the
rewards the WebShop server's ledger holds, beside a 0.3 batch; Prometheus's own query API returns both lines'
backlog series; a 1.0 worker container stopped mid-program drains and the rollouts still end with exact rewards,
each bought once; the 1.0 workers' memory limit holds at the documented `-c 8`.
"""

from __future__ import annotations

import collections
import contextlib
import json
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis

from bridge.core.coordination import keys
from bridge.core.gateway import V1State
from bridge.core.settings import Settings
from bridge_lab import docker_here
from bridge_lab.chaos.scenarios import CHAOS_ENV
from bridge_lab.demo import GatewayRollouts
from tests.deployed.conftest import Project, assert_secrets_placed, process_uids, services
from tests.deployed.test_compose_stack import run_batch
from tests.unit.test_compose_environment import SECRETS
from webshop_env.goals import load_tasks

pytestmark = pytest.mark.deployed

# agl-server's default `default_proxy.model_name`: compose's gateway forces it on every proxied call, so the trainer
# (this test) registers its model endpoint under it.
GATEWAY_MODEL = "Qwen/Qwen2.5-7B-Instruct"
SERVICES = [  # every service of the four profiles but Grafana
    *("redis", "store", "webshop", "policy", "worker", "bridge"),
    *("dispatcher-v1", "worker-agl-v1", "agl-gateway", "prometheus"),
]
GRACE_S = 8
BATCH = 10  # more than one 1.0 worker's 8 slots: with all running, each of two containers runs some
DEADLINE_S = 300.0
MIB = 1024 * 1024
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lines(compose_module: Callable[..., Project]) -> Project:
    env = {**CHAOS_ENV, "AGL_V1_KEY": uuid.uuid4().hex, "WORKER_SHUTDOWN_GRACE_S": str(GRACE_S)}
    env["WEBSHOP_TOKEN"] = f"secret-webshop-token-{uuid.uuid4().hex}"
    env["GRAFANA_ADMIN_PASSWORD"] = f"secret-grafana-{uuid.uuid4().hex}"
    project = compose_module(["standin", "agl-v1", "agl-v1-gateway", "monitoring"], POLICY_LATENCY_MS="1000", **env)
    project.run("up", "-d", "--wait", "--wait-timeout", "480", *SERVICES, timeout=600)
    register = [{"model": GATEWAY_MODEL, "endpoint": "http://policy:8000/v1"}]  # as the gateway's container sees it
    headers = {"Authorization": f"Bearer {project.env['AGL_V1_KEY']}"}
    httpx.post(
        f"{project.url('GATEWAY_PUBLISH_PORT')}/api/models", json=register, headers=headers, timeout=30
    ).raise_for_status()
    return project


def purchases(project: Project) -> list[dict[str, object]]:
    return list(httpx.get(f"{project.url('WEBSHOP_PUBLISH_PORT')}/purchases", timeout=30).json()["items"])


def run_v1_batch(
    project: Project, size: int, during: Callable[[GatewayRollouts, list[str]], None] | None = None
) -> float:
    """Create ``size`` WebShop rollouts on the gateway, call ``during`` while they run, wait (bounded) until all
    finished, and check the audit: every one succeeded, each rollout's reward is the one purchase the WebShop server
    recorded meanwhile for its task (a program run twice in effect buys twice), none changed after it finished.
    Returns the batch's wall seconds."""
    before = len(purchases(project))
    rollouts = GatewayRollouts(project.url("GATEWAY_PUBLISH_PORT"), project.env["AGL_V1_KEY"], timeout_s=150)
    started = time.monotonic()
    tasks = load_tasks("test", limit=size)
    assert len({task["task_id"] for task in tasks}) == size  # one purchase per task tells the rollouts apart
    ids = rollouts.enqueue(tasks, "test")
    if during is not None:
        during(rollouts, ids)
    poll = rollouts.poll()
    states = poll(ids)
    while len(states) < len(ids):
        assert time.monotonic() - started < DEADLINE_S, f"unfinished: {collections.Counter(states.values())}"
        time.sleep(2.0)
        states = poll(ids)
    seconds = round(time.monotonic() - started, 1)
    ended = rollouts.ended(ids)
    assert [e.status for e in ended] == ["succeeded"] * size, (ended, project.logs())
    time.sleep(3.0)  # a late report would land now
    assert poll(ids) == states, "a finished rollout changed"
    bought: dict[str, list[float]] = collections.defaultdict(list)
    for item in purchases(project)[before:]:
        bought[str(item["task_id"])].append(float(str(item["reward"])))
    for task, rid, end in zip(tasks, ids, ended, strict=True):
        assert end.reward is not None and bought[task["task_id"]] == [end.reward], (rid, task, end, dict(bought))
    assert sum(map(len, bought.values())) == size, dict(bought)
    rollouts.close(ids)
    return seconds


def test_each_1_0_container_runs_each_process_as_the_files_say(lines: Project) -> None:
    """From the host's process table: in worker-agl-v1 only the inits are root's (docker-init, tini: they hold the
    environment no program may read), the worker and its program server are agl's (1000) and anything else is a
    program's box uid; dispatcher-v1 and agl-gateway run everything as 1000."""
    seen = set()
    for cid, service in services(lines).items():
        if service not in ("worker-agl-v1", "dispatcher-v1", "agl-gateway"):
            continue
        seen.add(service)
        processes = process_uids(cid)
        if service != "worker-agl-v1":
            assert processes and {uid for uid, _ in processes} == {1000}, (service, processes)
            continue
        roots = [args for uid, args in processes if uid == 0]
        assert roots and all("docker-init" in args or "tini" in args for args in roots), processes
        assert any(uid == 1000 and "celery" in args for uid, args in processes), processes
        assert all(uid in (0, 1000) or uid >= 2_000_000_000 for uid, _ in processes), processes
    assert seen == {"worker-agl-v1", "dispatcher-v1", "agl-gateway"}, seen


def test_each_secret_of_the_1_0_line_reaches_exactly_the_containers_that_read_it(lines: Project) -> None:
    """AGL_V1_KEY (the gateway's one key), the Redis password and the WebShop token, in every running container of
    the four profiles, against SECRETS (tests/unit/test_compose_environment.py)."""
    names = ("AGL_V1_KEY", "REDIS_PASSWORD", "WEBSHOP_TOKEN")
    assert_secrets_placed(lines, {name: lines.env[name] for name in names}, SECRETS)


PEAK_IN_FLIGHT: dict[str, int] = {}
"""Worker service -> the most episodes (0.3: attempts leased) or programs (1.0: boxes) seen running at once."""
BOX_UIDS = Settings.model_fields["agl_v1_program_uid_base"].default


@contextlib.contextmanager
def peak_in_flight(service: str, count: Callable[[], int]) -> Iterator[None]:
    """Sample ``count()`` every 0.5 s while the block runs; keep its maximum in ``PEAK_IN_FLIGHT[service]``."""
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            with contextlib.suppress(redis.RedisError, subprocess.SubprocessError):  # a miss lowers the peak only
                PEAK_IN_FLIGHT[service] = max(PEAK_IN_FLIGHT.get(service, 0), count())
            stop.wait(0.5)

    thread = threading.Thread(target=sample, name=f"in-flight-{service}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def test_both_lines_run_their_rollouts_side_by_side(lines: Project) -> None:
    client = redis.Redis.from_url(lines.redis_url)
    container = lines.container("worker-agl-v1")

    def leased() -> int:  # the one 0.3 worker container's episodes: no 1.0 attempt runs yet
        return sum(1 for _ in client.scan_iter(match=keys.lease("*"), count=1000))

    def boxes() -> int:  # the one 1.0 worker container's programs, each in a box of its own uid
        return len({uid for uid, _ in process_uids(container) if uid >= BOX_UIDS})

    with client, peak_in_flight("worker", leased):
        v03 = run_batch(lines, *SERVICES)
    with peak_in_flight("worker-agl-v1", boxes):
        v1 = run_v1_batch(lines, BATCH)
    print(f"\n[deployed] 0.3 batch {v03}; 1.0 batch of {BATCH}: {v1} s; most running at once {PEAK_IN_FLIGHT}")


def cgroup_memory(container_id: str) -> tuple[int, int]:
    """The container's peak memory and its limit, in bytes, from its cgroup (v2, else v1)."""
    script = (
        "cat /sys/fs/cgroup/memory.peak /sys/fs/cgroup/memory.max 2>/dev/null || "
        "cat /sys/fs/cgroup/memory/memory.max_usage_in_bytes /sys/fs/cgroup/memory/memory.limit_in_bytes"
    )
    peak, limit = docker_here.docker("exec", container_id, "sh", "-c", script).stdout.split()
    return int(peak), int(limit)


@pytest.mark.parametrize("service", ["worker-agl-v1", "worker"])
def test_the_workers_held_their_memory_limit(lines: Project, service: str) -> None:
    """After the batches above (tests run in file order), each worker having run 8 episodes or programs at once
    (compose's `-c 8` for both), its cgroup's peak stayed under compose's `mem_limit`."""
    assert PEAK_IN_FLIGHT.get(service, 0) >= 8, f"not 8 at once, so the peak proves nothing: {PEAK_IN_FLIGHT}"
    container = lines.container(service)
    peak, limit = cgroup_memory(container)
    killed, restarts = docker_here.docker(
        "inspect", "--format", "{{.State.OOMKilled}} {{.RestartCount}}", container
    ).stdout.split()
    kills = "cat /sys/fs/cgroup/memory.events || cat /sys/fs/cgroup/memory/memory.oom_control"  # v2, else v1
    events = docker_here.docker("exec", container, "sh", "-c", kills).stdout  # both count them as "oom_kill N"
    oom_kills = int(dict(line.split() for line in events.splitlines()).get("oom_kill", "0"))
    print(f"\n[deployed] {service} -c 8, {PEAK_IN_FLIGHT[service]} at once: peak {peak / MIB:.0f} MiB", end="")
    print(f" of its {limit / MIB:.0f} MiB limit; OOMKilled {killed}, restarts {restarts}, oom_kill {oom_kills}")
    # A cgroup never goes past its limit: what shows a limit too small is a kill, of the worker or of a process in it
    # (with `restart: unless-stopped` an OOM-killed worker would come back with a fresh, low peak).
    assert (killed, restarts, oom_kills) == ("false", "0", 0), (killed, restarts, events)
    stated = {"worker-agl-v1": 1664, "worker": 1024}[service]  # compose's mem_limit: 1664m and 1g
    assert limit == stated * MIB, f"compose's mem_limit ({stated} MiB) is not the container's: {limit}"


def test_prometheus_returns_both_lines_backlog_series(lines: Project) -> None:
    """Prometheus scrapes the 0.3 bridge and the 1.0 dispatcher (deploy/prometheus.yml); its query API answers."""
    wanted = {
        ("agl_bridge_store_waiting_rollouts", "agl-bridge", "rollouts"),
        ("agl_bridge_gateway_waiting_rollouts", "agl-dispatcher-v1", "rollouts-v1"),
        ("agl_bridge_desired_slots", "agl-bridge", "rollouts"),
        ("agl_bridge_desired_slots", "agl-dispatcher-v1", "rollouts-v1"),
    }
    # One selector: `or` would drop a series whose labels (its name aside) another one already has.
    query = '{__name__=~"agl_bridge_(store_waiting_rollouts|gateway_waiting_rollouts|desired_slots)"}'
    found: set[tuple[str, str, str]] = set()
    deadline = time.monotonic() + 120  # a scrape every 15 s
    while not wanted <= found and time.monotonic() < deadline:
        answer = httpx.get(f"{lines.url('PROMETHEUS_PORT')}/api/v1/query", params={"query": query}, timeout=10)
        answer.raise_for_status()
        for series in answer.json()["data"]["result"]:
            labels = series["metric"]
            found.add((labels["__name__"], labels.get("job", ""), labels.get("queue", "")))
        time.sleep(3.0)
    assert wanted <= found, f"missing {wanted - found}; Prometheus has {sorted(found)}"


# Run in the 1.0 worker container as the programs' uid: every process's uid, effective capabilities, command, and
# whether its environment was readable and named AGL_V1_KEY (None: refused), this process left out.
PROCESSES = """
import json, os
seen = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    if int(pid) == os.getpid():
        continue
    try:
        status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
        command = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode(errors="replace")
    except OSError:
        continue
    try:
        holds_key = b"AGL_V1_KEY=" in open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        holds_key = None
    seen[pid] = [int(status["Uid"].split()[1]), status["CapEff"].strip(), command[:120], holds_key]
print(json.dumps(seen))
"""


BOX_CAPABILITIES = 0x2000C0  # CAP_SETGID (6), CAP_SETUID (7) and CAP_SYS_ADMIN (21)
SITE = "/opt/agent/lib/python3.12/site-packages"


def test_a_process_of_the_programs_uid_reads_no_environment_that_holds_the_key(lines: Project) -> None:
    """docs/agl-v1.md, "Boxes" and "The container's inits": in worker-agl-v1 as compose runs it, the inits that hold
    the container's environment run as root, the worker as agl (uid 1000) with SETUID, SETGID and SYS_ADMIN only,
    non-dumpable: neither a process of the worker's uid nor one of a program's reads any of their environments."""
    for reader in ("1000:1000", "2000000999:2000000999"):  # the worker's uid, then a program's
        out = lines.run("exec", "-T", "--user", reader, "worker-agl-v1", "python", "-c", PROCESSES).stdout
        seen = {int(pid): row for pid, row in json.loads(out).items()}
        print(f"\n[deployed] worker-agl-v1 processes as {reader}: {seen}")
        assert seen[1][0] == 0 and seen[1][3] is None, seen[1]  # the init: root, its environment refused
        workers = [row for row in seen.values() if "celery" in row[2] and " worker " in f" {row[2]} "]
        assert workers, seen
        for uid, caps, command, holds_key in workers:
            assert uid == 1000 and int(caps, 16) == BOX_CAPABILITIES, (uid, caps, command)
            assert holds_key is None, f"{command}: its environment is readable"
        assert not [row for row in seen.values() if row[3]], f"a process of {reader} read AGL_V1_KEY"
        servers = [row[2] for row in seen.values() if "agl_program" in row[2]]
        assert servers and all(c.startswith("/opt/agent/bin/python ") for c in servers), servers  # the image's


def test_a_hostile_program_in_the_container_reaches_nothing_beyond_its_box(lines: Project) -> None:
    """The test suite's ``Inmate`` (tests/agl_v1_agents.py) as a 1.0 rollout on compose's gateway, run by
    worker-agl-v1 as compose runs it: its own uid without capabilities, in a PID namespace of its own (no other
    process exists for it: not the worker, not its program server, not the inits), the worker's files out of
    reach."""
    lines.run("cp", str(ROOT / "tests/agl_v1_agents.py"), f"worker-agl-v1:{SITE}/agl_test_agents.py")
    lines.run("exec", "-T", "--user", "0", "worker-agl-v1", "install", "-d", "-m", "1777", "/tmp/outbox")
    lines.run("exec", "-T", "--user", "1000", "worker-agl-v1", "sh", "-c", "umask 077 && echo KEY=x > /home/agl/secret")
    out = lines.run("exec", "-T", "--user", "1000:1000", "worker-agl-v1", "python", "-c", PROCESSES).stdout
    rows = json.loads(out).items()
    worker = min(int(pid) for pid, row in rows if "celery" in row[2] and " worker " in f" {row[2]} ")
    [server] = [int(pid) for pid, row in rows if "agl_program" in row[2] and row[0] == 1000]  # the bootstrap's
    task = {
        "facts": "/tmp/outbox/inmate.json",
        "targets": json.dumps({"worker": worker, "server": server}),
        "secret": "/home/agl/secret",
        "outside": "/home/agl",
    }
    env_map = {
        "FACTS_FILE": "input.facts",
        "TARGETS": "input.targets",
        "SECRET_FILE": "input.secret",
        "OUTSIDE_DIR": "input.outside",
    }
    config = {"local": {"agent_class": "agl_test_agents:Inmate", "env_map": env_map}, "timeout_seconds": 60}
    rollouts = GatewayRollouts(lines.url("GATEWAY_PUBLISH_PORT"), lines.env["AGL_V1_KEY"], timeout_s=60)
    [created] = rollouts.gateway.create_rollouts([{"input": task, "config": config}])
    deadline = time.monotonic() + 120
    while (current := rollouts.gateway.get_rollout(created.rollout_id)) is None or current.status.state not in (
        V1State.SUCCEEDED,
        V1State.FAILED,
    ):
        assert time.monotonic() < deadline, current
        time.sleep(1.0)
    if current.status.state != V1State.SUCCEEDED:
        pytest.fail(f"the inmate's rollout {current.status.state}: {current.status.error_message}")
    facts = json.loads(lines.run("exec", "-T", "worker-agl-v1", "cat", "/tmp/outbox/inmate.json").stdout)
    print(f"\n[deployed] the inmate's view: { {k: v for k, v in facts.items() if k != 'shown'} }")
    assert facts["uid"] >= 2_000_000_000 and facts["status"]["Uid"] == [str(facts["uid"])] * 4
    assert all(int(facts["status"][caps][0], 16) == 0 for caps in ("CapInh", "CapPrm", "CapEff", "CapAmb"))
    assert facts["status"]["NoNewPrivs"] == ["1"] and facts["read"] == []
    assert facts["seen"] == 0 and facts["shown"] == [], facts["shown"]  # not even a pid or a command line
    assert facts["signalled"] == {"worker": "gone", "server": "gone"}, facts["signalled"]
    assert facts["traced"] == {"worker": "ESRCH", "server": "ESRCH"}, facts["traced"]
    assert facts["secret"] == "EACCES" and facts["outside"] == "EACCES"
    assert facts["setuid_0"] == "EPERM" and facts["setuid_worker"] == "EPERM"


def running_programs(container: str) -> list[str]:
    """The boxed programs running in ``container`` (their uid is AGL_V1_PROGRAM_UID_BASE or above), as the host's
    process table shows them: their keepers and the programs in their PID namespaces."""
    return [args for uid, args in process_uids(container) if uid >= 2_000_000_000]


def test_a_1_0_worker_stopped_mid_program_hands_its_programs_over(lines: Project) -> None:
    lines.run("up", "-d", "--wait", "--wait-timeout", "480", "--scale", "worker-agl-v1=2", *SERVICES, timeout=600)
    victim = lines.container("worker-agl-v1")
    took: list[float] = []
    programs: list[int] = []

    def stop_when_both_run(rollouts: GatewayRollouts, ids: list[str]) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            running = rollouts.gateway.list_rollouts(V1State.RUNNING, limit=1000)
            if sum(r.rollout_id in ids for r in running) > 8:  # more than one container's slots
                break
            time.sleep(0.5)
        else:
            raise AssertionError("the batch never ran on both 1.0 workers")
        programs.append(len(running_programs(victim)))
        started = time.monotonic()
        docker_here.docker("stop", victim, timeout=120)  # the container's stop_grace_period (30 s) bounds it
        took.append(time.monotonic() - started)

    seconds = run_v1_batch(lines, BATCH, stop_when_both_run)
    state = docker_here.docker("inspect", "--format", "{{.State.ExitCode}} {{.State.OOMKilled}}", victim).stdout.split()
    print(f"\n[deployed] 1.0 worker stopped in {took[0]:.1f} s (grace {GRACE_S} s), exit {state}; batch {seconds} s")
    assert took[0] < GRACE_S + 4, f"docker stop took {took[0]:.1f} s: the drain did not bound the exit"
    logged = docker_here.docker("logs", victim)
    said = logged.stdout + logged.stderr
    assert "[FATAL tini" not in said, said[-3000:]  # its init could not pass SIGTERM on: no drain at all
    handed = said.count(" handed over: ")  # each running program's attempt, handed over rather than lost
    print(f"[deployed] programs running in it at the stop: {programs[0]}; attempts handed over: {handed}")
    assert programs[0] >= 1, "no program ran in the stopped container: the stop proved nothing"
    assert 1 <= handed <= 8, said[-3000:]
    assert state[0] in ("0", "1") and state[1] == "false", state  # 1: the drain's forced exit, by design
