"""The multi-host scenarios: scale-out, host loss, partition, broker and Store outages across the network.

Each is a function of a ``TestBed`` that runs one or more bounded runs (``TestBed.run``) and returns their
``ClusterResult``: the chaos suite's audit (lost, executed twice, flipped, bad reward: all 0) plus the
figures the scenario measures. Faults aim by facts: which attempts a node runs (Celery's own ``inspect
active``, keyed by node name, whose host part is the namespace's host name), which leases exist in Redis,
what the Store says.
"""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

from bridge.core.store import FINISHED_ROLLOUT
from bridge_lab.chaos.scenarios import pause_store, restart_redis
from bridge_lab.chaos.state import ChaosRun
from bridge_lab.cluster.bed import CLUSTER_ROLLOUT_CONFIG, ClusterResult, TestBed
from bridge_lab.cluster.netns import Host
from bridge_lab.procs import PYTHON
from bridge_lab.stack import LocalStack

RECOVERY_WAIT_S = 150.0


def scale_out(
    bed: TestBed, tasks: list[dict[str, Any]], host_counts: list[int], deadline_s: float
) -> list[ClusterResult]:
    """The same workload on 1, 2, 3... worker hosts: throughput, its ratio to one host's, and node names."""
    results: list[ClusterResult] = []
    for count in host_counts:
        result = bed.run(f"scale-out-{count}", count, tasks, check_names, deadline_s)
        base = results[0].figures.get("throughput_per_s") if results else result.figures.get("throughput_per_s")
        if base and result.figures.get("throughput_per_s"):
            result.figures["ratio_to_first"] = round(result.figures["throughput_per_s"] / base, 2)
        result.figures["slots"] = count * bed.config.concurrency
        hosts = {h.hostname for h in bed.worker_hosts[:count]}
        if set(result.figures["worker_ids"]) != hosts:
            result.figures["errors"].append(f"Store worker ids name hosts {result.figures['worker_ids']}, not {hosts}")
        results.append(result)
    return results


def check_names(run: ChaosRun, bed: TestBed, stack: LocalStack, figures: dict[str, Any]) -> None:
    """Mid-run: Celery's ping and ``python -m bridge status`` list one node per host, no two alike."""
    run.wait_progress(1, 60)
    hosts = {h.hostname for h in bed.worker_hosts[: len(stack.workers)]}
    replies = run.celery().control.ping(timeout=2.0) or []
    pinged = sorted(name for reply in replies for name in reply)
    figures["celery_nodes"] = pinged
    if len(pinged) != len(hosts) or {n.split("@", 1)[1] for n in pinged} != hosts:
        figures["errors"].append(f"ping answered {pinged}, expected one node on each of {sorted(hosts)}")
    status = subprocess.run(
        [PYTHON, "-m", "bridge", "status", "--json"],
        env=stack.component_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    try:
        names = sorted(w["name"] for w in json.loads(status.stdout.splitlines()[-1])["workers"])
    except (ValueError, IndexError, KeyError, TypeError):
        figures["errors"].append(f"status --json gave no report: {status.stderr.strip()[-300:]}")
        return
    figures["status_workers"] = names
    if len(set(names)) != len(hosts) or {n.split("@", 1)[-1] for n in names} != hosts:
        figures["errors"].append(f"status lists workers {names}, expected one on each of {sorted(hosts)}")


def held_by(run: ChaosRun, host: Host, minimum: int = 1, timeout_s: float = 60.0) -> dict[str, str]:
    """Rollout id -> attempt id of what ``host``'s node runs right now (as its node answers), once it runs some."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            replies = run.celery().control.inspect(timeout=1.0).active() or {}
        except Exception:  # a broadcast that fails is asked again
            replies = {}
        attempts = {
            str(task["id"])
            for node, tasks in replies.items()
            if node.endswith(f"@{host.hostname}")
            for task in tasks or []
        }
        rollouts = {r.attempt.attempt_id: r.rollout_id for r in run.latest.values()}
        held = {rollouts[a]: a for a in attempts if a in rollouts and run.leased(a)}
        if len(held) >= minimum:
            return held
        time.sleep(0.3)
    return {}


def wait_recovered(run: ChaosRun, held: dict[str, str], since: float, timeout_s: float) -> float | None:
    """Seconds from ``since`` until every held rollout runs again elsewhere (or finished); None on timeout.

    Running again: its latest attempt is another one and leased, or the same one leased again after its
    lease was seen gone (a takeover of an attempt still ``preparing``).
    """
    pending, lapsed = dict(held), set()
    deadline = since + timeout_s
    while pending and time.monotonic() < deadline:
        run.observe_once()
        for rid, aid in list(pending.items()):
            now = run.latest.get(rid)
            if now is None:
                continue
            current = now.attempt.attempt_id
            leased = run.leased(current)
            if current == aid and not leased:
                lapsed.add(rid)
            if now.status in FINISHED_ROLLOUT or (leased and (current != aid or rid in lapsed)):
                del pending[rid]
        time.sleep(0.25)
    return None if pending else round(time.monotonic() - since, 1)


def recovery_bound(bed: TestBed) -> float:
    """The documented bound: the lease lapses, a reconcile scan finds the attempt, a second scan confirms."""
    heartbeat = bed.config.interval("HEARTBEAT_INTERVAL_S")
    lease = bed.config.interval("LEASE_TTL_S")
    reconcile = bed.config.interval("BRIDGE_RECONCILE_INTERVAL_S")
    return lease + reconcile + 2 * heartbeat + 5.0 + 2.0  # + a dequeue and a task start


def _recovery_wait(bed: TestBed) -> float:
    """How long a scenario waits for recovery: well past the bound, so an overrun is measured, not cut off."""
    return max(RECOVERY_WAIT_S, recovery_bound(bed) + 60.0)


def host_loss(run: ChaosRun, bed: TestBed, stack: LocalStack, figures: dict[str, Any]) -> None:
    """SIGKILL every process of the last worker host while it runs episodes; time until they run elsewhere."""
    victim = bed.worker_hosts[len(stack.workers) - 1]
    run.wait_progress(run.share(0.15), 90)
    held = held_by(run, victim)
    killed_at = time.monotonic()
    pids = victim.kill_all()
    for process in list(stack.workers):
        if not process.alive() or process.pid in pids:
            stack.workers.remove(process)
    figures.update(lost_host=victim.hostname, killed_pids=len(pids), held=len(held), bound_s=recovery_bound(bed))
    recovered = wait_recovered(run, held, killed_at, _recovery_wait(bed))
    figures["recovery_s"] = recovered
    if not held:
        figures["errors"].append(f"{victim.hostname} ran nothing when killed")
    elif recovered is None:
        figures["errors"].append(f"{victim.hostname}'s rollouts did not run again within {_recovery_wait(bed):.0f}s")


def partition(run: ChaosRun, bed: TestBed, stack: LocalStack, figures: dict[str, Any]) -> None:
    """Cut the last worker host's link for longer than the lease, restore it; then it must take new work."""
    victim = bed.worker_hosts[len(stack.workers) - 1]
    run.wait_progress(run.share(0.15), 90)
    held = held_by(run, victim)
    cut_at = time.monotonic()
    victim.link(up=False)
    try:
        recovered = wait_recovered(run, held, cut_at, _recovery_wait(bed))
        lease = bed.config.interval("LEASE_TTL_S")
        while time.monotonic() < cut_at + 2 * lease:  # longer than the lease whatever the recovery took
            time.sleep(0.5)
    finally:
        victim.link(up=True)
    figures.update(cut_host=victim.hostname, held=len(held), recovery_s=recovered, bound_s=recovery_bound(bed))
    figures["partition_s"] = round(time.monotonic() - cut_at, 1)
    if not held or recovered is None:
        figures["errors"].append(f"held {len(held)} attempts; taken over elsewhere: {recovered is not None}")
    healed = time.monotonic()
    run.wait_for(lambda: run.complete, 180)
    _new_work_on(run, victim, figures, healed, len(stack.workers) * bed.config.concurrency)


def _new_work_on(run: ChaosRun, host: Host, figures: dict[str, Any], healed: float, slots: int) -> None:
    """After the heal: ``host``'s node answers over the broker again with its stale tasks ended (it reconnected
    by itself), and then takes part of a second batch of twice the cluster's slots."""
    idle = run.wait_for(lambda: _node_idle(run, host), 120)
    figures["node_back_after_s"] = round(time.monotonic() - healed, 1) if idle else None
    tasks = [r.input for r in run.latest.values()]
    tasks = (tasks * (1 + 2 * slots // max(1, len(tasks))))[: 2 * slots]
    batch = run.store.enqueue([{"input": t, "mode": "test", "config": CLUSTER_ROLLOUT_CONFIG} for t in tasks])
    run.rollout_ids.extend(r.rollout_id for r in batch)
    ids = {r.rollout_id for r in batch}
    run.wait_for(lambda: ids <= set(run.first_final), 180)
    mine = sum(
        1
        for rid in ids
        for a in run.store.list_attempts(rid)
        if str((a.metadata or {}).get("worker_id") or "").startswith(f"{host.hostname}:")
    )
    figures.update(second_batch=len(ids), second_batch_on_returned_host=mine)
    if mine == 0:
        figures["errors"].append(f"{host.hostname} took none of {len(ids)} new rollouts after the link came back")


def _node_idle(run: ChaosRun, host: Host) -> bool:
    """``host``'s node answers Celery's broadcast (so its broker connection works) and runs nothing."""
    try:
        replies = run.celery().control.inspect(timeout=1.0).active() or {}
    except Exception:  # a broadcast that fails is asked again
        return False
    mine = [tasks for node, tasks in replies.items() if node.endswith(f"@{host.hostname}")]
    return bool(mine) and not any(mine)


def broker_restart(run: ChaosRun, bed: TestBed, stack: LocalStack, figures: dict[str, Any]) -> None:
    """The chaos suite's Redis restart (append-only file kept), its clients now across the network."""
    restart_redis(run)


def store_outage(run: ChaosRun, bed: TestBed, stack: LocalStack, figures: dict[str, Any]) -> None:
    """The chaos suite's Store outage (15 s without an answer), its clients now across the network."""
    pause_store(run)
