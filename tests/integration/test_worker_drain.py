"""A worker drained by SIGTERM with ``WORKER_SHUTDOWN_GRACE_S`` shorter than its episodes (``workers.lifecycle.drain``),
under ``-P prefork``: real worker nodes, Store, bridge and Redis.

The node's adverts go at once, its running attempts are stopped at the grace less the reporting margin and
handed over (``failed`` with class ``shutdown`` where the Store retries that, else the rollout handed back),
the process exits within the grace, and a second node runs every rollout to ``succeeded`` exactly once, with
nothing left in the bridge's in-flight accounting. Prefork is the pool of the first test: its attempts run in pool
children that only learn of the drain through Redis and are interrupted by SIGUSR1; under ``-P threads`` the
attempts run in the signalled process, and ``tests/unit/test_worker_drain.py`` covers what differs there. Agents that
never return (they swallow the stop and the interrupt) are handed over all the same, under both pools, by a worker
that is PID 1 of its own PID namespace (a container without an init) and by one that is not.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bridge.core.coordination import capacity, coordination_client, keys
from bridge_lab.stack import LocalStack
from tests.helpers import attempts, enqueue, rollout, stack_for, wait_finished, wait_for
from tests.prerequisites import require
from workers.lifecycle import drain

pytestmark = [pytest.mark.integration, pytest.mark.cost(60)]

ROOT = Path(__file__).resolve().parents[2]
QUEUE = "rollouts"
GRACE_S = 9.0
SLACK_S = 1.0


def test_a_drained_worker_hands_its_episodes_over_within_its_grace(clean_store: LocalStack, tmp_path: Path) -> None:
    env = {
        "AGENT": "tests.agents_for_tests:SlowFirstAgent",
        "WORKER_SHUTDOWN_GRACE_S": str(GRACE_S),
        "HEARTBEAT_INTERVAL_S": "1",
        "LEASE_TTL_S": "4",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    stack = stack_for(clean_store, tmp_path, workers=1, concurrency=3, pool="prefork", extra_env=env)
    client = coordination_client(clean_store.broker_url)
    with stack:
        url = stack.store_url
        retried = {"max_attempts": 2, "retry_condition": ["failed"]}
        inputs = [{"question": "What is 1 + 1?", "reward": r, "sleep": 60} for r in (0.25, 0.5)]
        ids = enqueue(url, inputs, config=retried)
        # No retry left for a failed attempt: handed back to the Store queue instead of ending failed.
        ids += enqueue(url, [{"question": "What is 2 + 2?", "reward": 0.75, "sleep": 60}], config={"max_attempts": 1})
        rewards = dict(zip(ids, (0.25, 0.5, 0.75), strict=True))
        wait_for(lambda: all(_leased(client, url, rid) for rid in ids), 30, "every first attempt started")
        first = {rid: rollout(url, rid)["attempt"]["attempt_id"] for rid in ids}

        drained = stack.workers[0]
        assert drained.proc is not None
        signalled = time.monotonic()
        drained.signal(signal.SIGTERM)  # the main process only, as Kubernetes does
        wait_for(lambda: capacity.total_slots(client, stack.scope, QUEUE) == 0, 1.5, "the adverts gone at once")
        adverts_gone = time.monotonic() - signalled
        drained.proc.wait(timeout=GRACE_S + 5)
        exited = time.monotonic() - signalled

        stack.add_worker()
        final = wait_finished(url, ids, timeout_s=60)
        rerun = time.monotonic() - signalled
        _ran_again_once(url, final, first, rewards, failed=set(ids[:2]), grace=GRACE_S)
        wait_for(lambda: capacity.inflight_count(client, stack.scope, QUEUE) == 0, 10, "nothing left in flight")
    print(f"adverts gone {adverts_gone:.2f} s, exited {exited:.2f} s, all succeeded again {rerun:.2f} s after SIGTERM")
    assert exited <= GRACE_S + SLACK_S


def _ran_again_once(
    store_url: str,
    final: dict[str, dict[str, Any]],
    first: dict[str, str],
    rewards: dict[str, float],
    *,
    failed: set[str],
    grace: float,
) -> None:
    """Each drained rollout succeeded with its exact reward in the attempt after the stopped one (``first``): two
    attempts, one succeeded. The stopped one was reported ``failed`` (``shutdown``) where the Store retries that
    (``failed``), else left as the Store had it (the rollout handed back), never reported."""
    for rid, reward in rewards.items():
        tried = attempts(store_url, rid)
        assert final[rid]["status"] == "succeeded", (final[rid], tried)
        assert final[rid]["attempt"]["metadata"]["reward"] == reward
        assert [a["status"] for a in tried].count("succeeded") == 1, tried
        assert len(tried) == 2, tried  # the stopped attempt and the one that ran it again: nothing in between
        assert final[rid]["attempt"]["attempt_id"] != first[rid]  # the trainer reads the second attempt
        stopped = next(a for a in tried if a["attempt_id"] == first[rid])
        if rid in failed:
            assert stopped["status"] == "failed", stopped
            assert stopped["metadata"]["failure_class"] == "shutdown", stopped
            assert f"grace {grace:g} s" in stopped["metadata"]["error"]
        else:
            assert stopped["status"] in ("preparing", "running"), stopped


def _leased(client: object, store_url: str, rollout_id: str) -> bool:
    attempt = rollout(store_url, rollout_id).get("attempt") or {}
    return bool(attempt.get("attempt_id")) and bool(client.exists(keys.lease(attempt["attempt_id"])))  # type: ignore[attr-defined]


# --- the worker as PID 1 of its container ----------------------------------------------------------------------

UNSHARE = ["unshare", "--fork", "--pid", "--mount-proc"]  # a new PID namespace: its first process is its init


def _pid_namespaces() -> str | None:
    """Why this machine cannot start a process as PID 1 of a new PID namespace, or None."""
    if shutil.which("unshare") is None:
        return "no unshare binary (util-linux)"
    probe = subprocess.run([*UNSHARE, "sh", "-c", "test $$ = 1"], capture_output=True, text=True, timeout=10)
    if probe.returncode != 0:
        return f"cannot create a PID namespace here (root needed): {probe.stderr.strip()[:200]}"
    return None


def _children(pid: int) -> list[int]:
    try:
        raw = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in raw.split()]


def _descendants(pid: int) -> list[int]:
    found, todo = [], _children(pid)
    while todo:
        child = todo.pop()
        found.append(child)
        todo += _children(child)
    return found


def _kill_namespace(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the namespace's init (from outside, the one signal it cannot refuse), which ends the namespace."""
    for pid in _children(proc.pid):
        os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.communicate(timeout=10)


def _state(pid: int) -> str | None:
    """The process's state letter (Z: a zombie), or None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return None


def test_the_drain_s_forced_exit_ends_the_first_process_of_a_pid_namespace() -> None:
    """The kernel drops a signal left at its default action for a PID namespace's init: a SIGALRM timer never ended a
    worker that is PID 1 of its container. Here a process whose exit never finishes (a non-daemon thread that never
    ends) is PID 1, and ``exit_by`` must end it at its deadline."""
    require(_pid_namespaces())
    code = (
        "import threading, time; from workers.lifecycle import drain; "
        "drain.exit_by(time.time() + 0.5); "
        "threading.Thread(target=threading.Event().wait, daemon=False).start()"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([*UNSHARE, sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        _kill_namespace(proc)
        pytest.fail("PID 1 outlived its drain's exit deadline: the forced exit never fired")
    assert proc.returncode == 1, err
    assert "still running at the end of WORKER_SHUTDOWN_GRACE_S" in err


# --- agents that never return, as PID 1 of a PID namespace and without -----------------------------------------


@pytest.mark.cost(40)
@pytest.mark.nightly(
    "the hand-over within the grace (the test above) and the forced exit as PID 1 run every time; agents that never "
    "return: test_stuck_agents.py (prefork), tests/unit/test_worker_drain.py and test_v1_worker_drain.py"
)
@pytest.mark.parametrize(
    ("pool", "pid_1"),
    [
        pytest.param("prefork", True, id="prefork-pid-1"),
        pytest.param("threads", False, id="threads-own-host"),
        pytest.param("prefork", False, id="prefork-own-host"),
        pytest.param("threads", True, id="threads-pid-1"),
    ],
)
def test_a_drained_worker_hands_over_what_its_agents_never_return(
    clean_store: LocalStack, tmp_path: Path, pool: str, pid_1: bool
) -> None:
    """Two agents in a tool loop that swallows everything (``StubbornFirstAgent``: the stop, the prefork interrupt)
    never return, and leave an orphan and a thread that never ends, so Celery's own exit never finishes either.
    SIGTERM to the worker's main process, grace ``MIN_GRACE_S``: both attempts are handed over before the worker's
    exit, within the grace (one ``failed`` with class ``shutdown``, where the Store retries it; one handed back, where
    it does not), their leases released, and a second node, started meanwhile, runs each rollout once more to
    ``succeeded`` with its exact reward: two attempts per rollout, one of them succeeded. Under both pools, as PID 1 of
    a new PID namespace (``pid_1``, as in a container started without an init: SIGTERM from outside it, and nothing of
    the namespace, zombies included, left after) and without."""
    if pid_1:
        require(_pid_namespaces())
    grace = drain.MIN_GRACE_S
    env = {
        "AGENT": "tests.agents_for_tests:StubbornFirstAgent",
        "WORKER_SHUTDOWN_GRACE_S": str(grace),
        "HEARTBEAT_INTERVAL_S": "1",
        "LEASE_TTL_S": "4",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    stack = stack_for(clean_store, tmp_path, workers=0, concurrency=2, pool=pool, extra_env=env)
    client = coordination_client(clean_store.broker_url)
    with stack:
        worker = stack.add_worker(prefix=UNSHARE if pid_1 else None, wait=False)
        worker.startup_timeout_s = 180  # importing agentlightning alone took 50 s on a loaded 2-core host
        worker.wait_healthy()
        assert worker.proc is not None
        url = stack.store_url
        retried = {"max_attempts": 2, "retry_condition": ["failed"], "timeout_seconds": 120}
        ids = enqueue(url, [{"question": "What is 1 + 1?", "reward": 0.25, "sleep": 300}], config=retried)
        once = {"timeout_seconds": 120}  # no retry for a failed attempt: handed back
        ids += enqueue(url, [{"question": "What is 2 + 2?", "reward": 0.5, "sleep": 300}], config=once)
        rewards = dict(zip(ids, (0.25, 0.5), strict=True))
        wait_for(lambda: all(_leased(client, url, rid) for rid in ids), 30, "every first attempt started")
        first = {rid: rollout(url, rid)["attempt"]["attempt_id"] for rid in ids}
        main, in_namespace = worker.proc.pid, []
        if pid_1:
            (main,) = _children(worker.proc.pid)  # unshare's only child: the worker, PID 1 inside
            status = Path(f"/proc/{main}/status").read_text().splitlines()
            nspid = next(line for line in status if line.startswith("NSpid:"))
            assert nspid.split()[-1] == "1", nspid
            in_namespace = [main, *_descendants(main)]

        signalled = time.monotonic()
        os.kill(main, signal.SIGTERM)  # the worker's main process only, as Kubernetes does
        second = stack.add_worker(wait=False)  # the node that takes over starts meanwhile, as a scaled-up pod would
        second.startup_timeout_s = 180
        handed: dict[str, float] = {}
        while worker.proc.poll() is None and time.monotonic() - signalled < grace + 10:
            for rid in ids:
                if rid not in handed and _handed_over(url, rid, first[rid]):
                    handed[rid] = time.monotonic() - signalled
            time.sleep(0.1)
        exited = time.monotonic() - signalled
        assert worker.proc.poll() is not None, f"the worker was still running {exited:.1f} s after SIGTERM"
        for rid in ids:  # handed over by the worker's exit: nothing is left for the slow path (reconcile, takeover)
            if rid not in handed and _handed_over(url, rid, first[rid]):
                handed[rid] = exited
        assert set(handed) == set(ids), f"not handed over at the worker's exit: {set(ids) - set(handed)}"
        assert not any(client.exists(keys.lease(first[rid])) for rid in ids), "a lease outlived the worker"
        left = {pid: _state(pid) for pid in in_namespace if _state(pid) is not None}
        assert left == {}, f"processes of the worker's namespace left (Z: zombie): {left}"

        second.wait_healthy()
        final = wait_finished(url, ids, timeout_s=60)
        rerun = time.monotonic() - signalled
        _ran_again_once(url, final, first, rewards, failed={ids[0]}, grace=grace)
        wait_for(lambda: capacity.inflight_count(client, stack.scope, QUEUE) == 0, 10, "nothing left in flight")
    print(
        f"{pool}{' as PID 1' if pid_1 else ''}: handed over "
        + ", ".join(f"{handed[rid]:.2f}" for rid in ids)
        + f" s, exited {exited:.2f} s, both succeeded again {rerun:.2f} s after SIGTERM"
    )
    assert max(handed.values()) <= grace and exited <= grace + SLACK_S


def _handed_over(store_url: str, rollout_id: str, attempt_id: str) -> bool:
    """The drained attempt went back to the Store: reported ``failed``, or its rollout handed back (not latest)."""
    current = rollout(store_url, rollout_id)
    latest = current.get("attempt") or {}
    if latest.get("attempt_id") != attempt_id:
        return True
    return latest.get("status") == "failed" or current.get("status") in ("requeuing", "queuing")
