"""The chaos audit: what the Store, Redis and the WebShop ledger say after a scenario.

Four counts per scenario, each of which must be 0 (``bridge_lab.chaos.run`` prints them): *lost*, rollouts
not finished by the deadline; *twice*, attempts executed twice in effect: two distinct ``webshop.episode`` roots
in one attempt, a final report that changed after the observer first saw it, or a ``done`` marker in Redis
naming another status than the Store holds; *flipped*, rollouts whose status changed after they were first
seen finished; *bad reward*, succeeded attempts whose reward differs from the WebShop purchase ledger.
Nothing here reads worker logs or the inside of a lease token: both are free to change.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import httpx
from rich.table import Table

from bridge.core.coordination import markers
from bridge.core.store import ACTIVE_ATTEMPT, Attempt, AttemptStatus
from bridge_lab.chaos.state import REPORTED, ChaosRun, FinalReport, ScenarioResult
from bridge_lab.render import cell, to_text

LOST_DESCRIBED = 5  # unfinished rollouts described in the notes (where each got stuck), the first ones


def conclude(run: ChaosRun, fault: threading.Thread, observer: threading.Thread) -> ScenarioResult:
    """End a run whose rollouts finished (or whose deadline passed): wait for late reports, stop, audit."""
    time.sleep(3.0)  # a late report would land now: give it the chance to flip something
    run.observe_once()
    run.stop.set()
    fault.join(timeout=30)
    observer.join(timeout=10)
    return audit(run)


def audit(run: ChaosRun) -> ScenarioResult:
    """Count the four zeros from ground truth the workers cannot fake: Store, Redis, WebShop ledger."""
    result = ScenarioResult(name="", enqueued=len(run.rollout_ids), notes=run.notes)
    ledger = _ledger(run.stack.webshop_url)
    attempts = {rid: run.store.list_attempts(rid) for rid in run.rollout_ids}
    facts = markers.read_markers(run.redis, [a.attempt_id for items in attempts.values() for a in items])
    for rid in run.rollout_ids:
        final = run.latest.get(rid)
        status = run.first_final.get(rid)
        if status is None or final is None:
            result.lost += 1
            if result.lost <= LOST_DESCRIBED:
                run.note(_describe_lost(rid, final, attempts[rid], facts))
            continue
        meta = final.attempt.metadata or {}
        if status == "succeeded":
            result.succeeded += 1
        else:
            result.failed[str(meta.get("failure_class") or status)] += 1
        for attempt in attempts[rid]:
            if attempt.status in {AttemptStatus.FAILED, AttemptStatus.TIMEOUT, AttemptStatus.UNRESPONSIVE}:
                result.attempts_failed[str((attempt.metadata or {}).get("failure_class") or attempt.status)] += 1
            reason = _second_execution(run, attempt, facts[attempt.attempt_id])
            if reason is not None:
                result.executed_twice += 1
                run.note(f"{reason} in {rid}/{attempt.attempt_id}")
        if final.status == "succeeded" and meta.get("done"):
            bought = ledger.get(str(meta.get("env_session_id")), [])
            if len(bought) != 1 or bought[0] != meta.get("reward"):
                result.bad_reward += 1
    result.flipped = len(run.flipped)
    return result


def _describe_lost(
    rollout_id: str, latest: Any, attempts: list[Attempt], facts: dict[str, markers.LeaseMarkers]
) -> str:
    """What the Store and Redis show for a rollout that did not finish in time: where it got stuck."""
    now = time.time()
    status = getattr(latest, "status", "never seen")
    steps = [
        f"{a.attempt_id} {a.status} by {a.worker_id}, started {now - (a.start_time or now):.0f}s ago, "
        f"heartbeat {now - (a.last_heartbeat_time or now):.0f}s ago, Redis {facts[a.attempt_id]}"
        for a in attempts
    ]
    return f"unfinished {rollout_id} ({status}): " + ("; ".join(steps) or "no attempt")


def _second_execution(run: ChaosRun, attempt: Attempt, fact: markers.LeaseMarkers) -> str | None:
    """Why ``attempt`` counts as executed twice, or None. Notes a finished attempt that is still leased."""
    if _episode_roots(run.store.spans(attempt.rollout_id, attempt.attempt_id)) > 1:
        return "two executions"
    report, first = FinalReport.of(attempt), run.first_report.get(attempt.attempt_id)
    if report is not None and first is not None and report != first:
        return (
            f"a second final report ({first.status} by {first.worker_id}, then {report.status} by {report.worker_id})"
        )
    done = fact.reported
    if done in REPORTED and attempt.status in REPORTED and done != attempt.status:
        return f"two final reports (Redis says {done}, the Store {attempt.status})"
    if fact.leased and attempt.status not in ACTIVE_ATTEMPT:
        run.note(f"{attempt.attempt_id} is {attempt.status} and still leased by an executor")
    return None


def _episode_roots(spans: list[dict[str, Any]]) -> int:
    """Distinct episode executions that wrote into one attempt: root span ids, seen directly or as parents."""
    roots = {s["span_id"] for s in spans if s.get("name") == "webshop.episode"}
    roots |= {
        s["parent_id"] for s in spans if s.get("name") in ("webshop.step", "webshop.env.reset") and s.get("parent_id")
    }
    return len(roots)


def _ledger(webshop_url: str) -> dict[str, list[float]]:
    """Rewards the WebShop server computed, by session (the audit's ground truth)."""
    response = httpx.get(f"{webshop_url}/purchases", timeout=30)
    response.raise_for_status()
    by_session: dict[str, list[float]] = collections.defaultdict(list)
    for item in response.json()["items"]:
        by_session[item["session_id"]].append(item["reward"])
    return by_session


def format_table(results: list[ScenarioResult]) -> str:
    """The scenarios as a plain-text table (printed by the CLI and by the test suite), then their notes."""
    table = Table(box=None, pad_edge=False, show_edge=False)
    table.add_column("scenario")
    for name in ("enq", "ok"):
        table.add_column(name, justify="right")
    table.add_column("failed by class")
    for name in ("lost", "twice", "flip", "badrw", "secs"):
        table.add_column(name, justify="right")
    for r in results:
        failed = ",".join(f"{k}={v}" for k, v in sorted(r.failed.items())) or "-"
        table.add_row(
            *map(cell, (r.name, r.enqueued, r.succeeded, failed, r.lost, r.executed_twice, r.flipped, r.bad_reward)),
            cell(f"{r.seconds:.0f}"),
        )
    notes = [f"  {r.name} note: {note}" for r in results for note in r.notes]  # below: a column would be too wide
    return "\n".join([to_text(table), *notes])
