"""status: Store and 1.0 gateway counts, broker queues, workers and their active rollouts, in-flight work, last errors.

Reads only: the Store's REST API, the broker's queues (Redis lists, or RabbitMQ depths by passive declare;
bridge.dispatch.broker), the coordination Redis (in-flight sets and the slots the workers advertise, see
bridge.core.coordination.capacity; only this deployment's, scoped by its Store: bridge.core.coordination.keys) and one
Celery ``inspect active`` request, sent to those workers only, for the rollouts each is running. A part that does
not answer is reported as such instead of failing the command, so the command is most useful exactly when
something is broken. ``--json`` prints one object per refresh. With AGL_V1_SERVER_URL, two listings of the 1.0
gateway's rollouts (queuing, running) are read too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import redis

from bridge.core.coordination import (
    capacity,
    coordination_redis,
    deployment_endpoint,
    deployment_scope,
    keys,
    scope_check,
)
from bridge.core.gateway import GatewayClient, GatewayError
from bridge.core.infra import StoreError, redact_error, redact_url
from bridge.core.settings import Settings, load_settings
from bridge.core.store import API, RolloutStatus, StoreClient
from bridge.dispatch import broker
from bridge.dispatch.v03 import read_backlog
from bridge.dispatch.v1 import read_gateway_counts

LAST_ERRORS = 5
INSPECT_TIMEOUT_S = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.add_argument("--json", action="store_true", help="print one JSON object (per refresh with --watch)")
    parser.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes with --watch")
    parser.add_argument(
        "--no-inspect", action="store_true", help="skip the Celery broadcast that lists each worker's active rollouts"
    )


def main(args: argparse.Namespace) -> int:
    settings = load_settings()
    deployment_scope(settings)  # which workers are this deployment's: exit 2 at once when nothing names it
    store = None
    if settings.store_url is not None:  # a 1.0-only deployment has none; the rest is shown all the same
        store = StoreClient(settings.store_base, token=settings.store_token, timeout_s=5.0, retries=0)
    client = coordination_redis(settings, timeout_s=3, connect_timeout_s=3)
    try:
        while True:
            report = collect(settings, store, client, inspect=not args.no_inspect)
            if args.json:
                print(json.dumps(report), flush=True)
            else:
                if args.watch and sys.stdout.isatty():
                    sys.stdout.write("\x1b[H\x1b[2J")
                print(render(report), flush=True)
            if not args.watch:
                store_ok = report["store"]["ok"] or store is None
                gateway_ok = report["gateway"] is None or report["gateway"]["ok"]
                return 0 if store_ok and gateway_ok and report["broker"]["ok"] else 1
            time.sleep(max(0.2, args.interval))
    except KeyboardInterrupt:
        return 0
    finally:
        if store is not None:
            store.close()


# --- collecting ---------------------------------------------------------------------------------


def collect(
    settings: Settings, store: StoreClient | None, client: redis.Redis, *, inspect: bool = True
) -> dict[str, Any]:
    """Everything ``status`` shows, as plain JSON-able data; ``store`` None: no Store configured (1.0 only)."""
    report: dict[str, Any] = {"time": round(time.time(), 3)}
    report["store"] = store_part(settings, store)
    report["gateway"] = gateway_part(settings)
    report["broker"], workers = _broker_part(settings, client)
    _add_backlog(report, settings, store)
    if inspect and report["broker"]["ok"]:
        _add_active(workers, settings)
    report["workers"] = sorted(workers.values(), key=lambda w: w["name"])
    queues = report["broker"]["queues"].values()
    report["in_flight"] = sum(q["in_flight"] for q in queues)
    ages = [q["oldest_queued_s"] for q in queues if q["oldest_queued_s"] is not None]
    report["oldest_queued_s"] = max(ages) if ages else None
    report["last_errors"] = report["store"].pop("last_errors", [])
    return report


def store_part(settings: Settings, store: StoreClient | None) -> dict[str, Any]:
    """The Store's rollout counts by status and its last errors; a part that says why where there is no Store or it
    does not answer."""
    if store is None:
        why = "AGENT_LIGHTNING_STORE_URL is not set (Agent Lightning 1.0 only: no Store)"
        return {"url": None, "ok": False, "counts": {}, "error": why}
    part: dict[str, Any] = {"url": redact_url(settings.store_base), "ok": False, "counts": {}, "error": None}
    try:
        part["counts"] = {str(s): store.count_rollouts(s) for s in RolloutStatus}
        part["last_errors"] = _last_errors(store)
        part["ok"] = True
    except StoreError as exc:
        part["error"] = str(exc)
    return part


def gateway_part(settings: Settings) -> dict[str, Any] | None:
    """The 1.0 gateway's queuing and running rollouts and the oldest queuing one's age; None without a gateway."""
    if not settings.agl_v1_url:
        return None
    part: dict[str, Any] = {"url": redact_url(settings.agl_v1_url), "ok": False, "error": None}
    gateway = GatewayClient(settings.agl_v1_url, key=settings.agl_v1_key, timeout_s=5.0, retries=0)
    try:
        counts = read_gateway_counts(gateway, settings.default_queue, settings.backlog_list_limit)
    except GatewayError as exc:
        part["error"] = str(exc)
        return part
    finally:
        gateway.close()
    oldest = time.time() - counts.oldest_queuing if counts.oldest_queuing is not None else None
    part.update(ok=True, queuing=counts.queuing, running=counts.running)
    part.update(queuing_capped=counts.queuing_capped, running_capped=counts.running_capped)
    part["oldest_queuing_s"] = _round(max(0.0, oldest) if oldest is not None else None)
    return part


def _add_backlog(report: dict[str, Any], settings: Settings, store: StoreClient | None) -> None:
    """Each queue's rollouts waiting in the Store, as the leading bridge exports them (bridge.dispatch.backlog);
    nothing without a Store."""
    if store is None:
        return
    try:
        backlog = read_backlog(store, settings)
    except StoreError:
        return  # the Store part says why
    report["waiting_exact"] = backlog.exact
    now = time.time()
    for queue, entry in report["broker"]["queues"].items():
        entry["waiting"] = backlog.waiting.get(queue, 0)
        entry["oldest_waiting_s"] = _round(backlog.oldest_age(queue, now) if queue in backlog.oldest else None)


def _last_errors(store: StoreClient) -> list[dict[str, Any]]:
    """The latest failed rollouts with the class and message their worker reported."""
    params: list[tuple[str, str | int]] = [
        ("status_in", RolloutStatus.FAILED),
        ("sort_by", "end_time"),
        ("sort_order", "desc"),
        ("limit", LAST_ERRORS),
    ]
    items = store.request("GET", f"{API}/rollouts", params=params).json().get("items", [])
    errors = []
    for item in items:
        attempt = item.get("attempt") or {}
        meta = attempt.get("metadata") or {}
        errors.append(
            {
                "rollout_id": item.get("rollout_id"),
                "attempt_id": attempt.get("attempt_id"),
                "end_time": item.get("end_time"),
                "failure_class": meta.get("failure_class") or attempt.get("status"),
                "error": str(meta.get("error") or "")[:300],
            }
        )
    return errors


def _broker_part(settings: Settings, client: redis.Redis) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    part: dict[str, Any] = {"url": redact_url(settings.broker_url), "ok": False, "queues": {}, "error": None}
    workers: dict[str, dict[str, Any]] = {}
    probe = broker.queues_for(settings, client)
    part["kind"] = "rabbitmq" if settings.broker_is_amqp else "redis"
    if settings.redis_url:
        part["coordination_url"] = redact_url(settings.redis_url)
    scope = deployment_scope(settings)
    part["scope"] = scope
    try:
        prefix = keys.capacity(scope, "", "").rstrip(":")
        for name in client.scan_iter(match=f"{prefix}*", count=500):
            queue, _, worker = name[len(prefix) :].strip(":").rpartition(":")
            slots = client.get(name)
            entry = workers.setdefault(worker, {"name": worker, "queues": [], "slots": 0, "active": []})
            entry["queues"].append(queue)
            entry["slots"] += int(slots or 0)
        names = list(workers)
        stuck = client.mget([keys.worker_stuck(scope, name) for name in names]) if names else []
        isolation = client.mget([keys.worker_isolation(scope, name) for name in names]) if names else []
        for name, count, boxed in zip(names, stuck, isolation, strict=True):
            workers[name]["stuck_threads"] = int(count or 0)
            workers[name]["program_isolation"] = boxed  # None: a node that runs no 1.0 programs
        held, unserved = capacity.read_held(client, scope)
        part["unserved"] = unserved
        if (
            not workers
        ):  # this deployment's workers under another spelling of its URL (bridge.core.coordination.scope_check)
            endpoint = deployment_endpoint(settings)
            others = scope_check.other_scopes(client, scope, settings.all_queues())
            suspects = [other for other in others if other.looks_like(endpoint)]
            if suspects:
                part["scope_mismatch"] = scope_check.mismatch_message("status", endpoint, scope, suspects)
        queues = sorted(set(settings.all_queues()) | {q for w in workers.values() for q in w["queues"]} | set(held))
        view = capacity.read_slots(client, scope, queues)  # the dispatcher's accounting: a shared node once
        totals, rooms = view.totals(), view.rooms()
        for queue in queues:
            inflight = view.inflight[queue]
            oldest_queued = probe.oldest_age(queue)
            oldest_inflight = capacity.oldest_inflight_age(client, scope, queue)
            part["queues"][queue] = {
                "depth": probe.depth(queue),
                "oldest_queued_s": _round(oldest_queued),
                "in_flight": inflight,
                "oldest_in_flight_s": _round(oldest_inflight),
                "slots": totals[queue],
                "free_slots": rooms[queue],
                "held": held.get(queue, 0),
            }
        part["ok"] = True
    except (redis.RedisError, broker.BrokerReadError) as exc:
        part["error"] = redact_error(exc)
    finally:
        probe.close()
    return part, workers


def _add_active(workers: dict[str, dict[str, Any]], settings: Settings) -> None:
    """Ask this deployment's workers what they run; the description is the task's kwargsrepr (ids, instruction
    start). Only the nodes that advertise slots for this Store are asked: another deployment's workers on the
    same broker answer a broadcast too."""
    if not workers:
        return
    try:
        from bridge.core.task import base_app

        app = base_app(settings, "bridge-status")
        inspect = app.control.inspect(destination=sorted(workers), timeout=INSPECT_TIMEOUT_S)
        replies = inspect.active(safe=True) or {}
    except Exception as exc:  # a broadcast is best effort: never let it hide the rest of the report
        for entry in workers.values():
            entry["active_error"] = repr(exc)
        return
    for node, tasks in replies.items():
        entry = workers.setdefault(node, {"name": node, "queues": [], "slots": 0, "active": []})
        for task in tasks or []:
            entry["active"].append({"attempt_id": task.get("id"), "task": str(task.get("kwargs") or "")[:200]})


def _round(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None


def _seconds(value: float | None) -> str:
    return f"{value:.1f}s" if value is not None else "-"


# --- rendering ----------------------------------------------------------------------------------


def render(report: dict[str, Any]) -> str:
    """A terminal view of ``collect``'s report."""
    lines: list[str] = []
    store = report["store"]
    if store["url"] is None:
        lines.append(f"Store   {store['error']}")
    else:
        lines.append(f"Store   {store['url']}  {'ok' if store['ok'] else 'DOWN: ' + str(store['error'])}")
    if store["ok"]:
        counts = store["counts"]
        lines.append("  " + "  ".join(f"{name} {counts.get(name, 0)}" for name in counts))
    gateway = report.get("gateway")
    if gateway is not None:
        answer = "ok" if gateway["ok"] else f"DOES NOT ANSWER: {gateway['error']}"
        lines.append(f"Gateway {gateway['url']}  {answer} (Agent Lightning 1.0)")
    if gateway is not None and gateway["ok"]:
        counts = {name: f"{gateway[name]}{'+' if gateway[name + '_capped'] else ''}" for name in ("queuing", "running")}
        lines.append(  # a count with + reached BRIDGE_BACKLOG_LIST_LIMIT: at least that many
            f"  queuing {counts['queuing']}  running {counts['running']}"
            f"  oldest queuing {_seconds(gateway['oldest_queuing_s'])}"
        )
    brk = report["broker"]
    lines.append(f"Broker  {brk['url']}  {'ok' if brk['ok'] else 'DOWN: ' + str(brk['error'])}")
    if brk.get("coordination_url"):
        lines.append(f"  coordination Redis {brk['coordination_url']}")
    if brk.get("scope"):
        lines.append(f"  Redis key scope {brk['scope']} (this Store's workers, slots and leader lock)")
    if brk.get("scope_mismatch"):
        lines.append(f"  ! {brk['scope_mismatch']}")
    if brk["queues"]:
        header = (
            f"  {'queue':<20} {'depth':>6} {'oldest':>8} {'in flight':>9} {'slots':>6} {'free':>5} {'held':>5}"
            f" {'waiting in Store':>16} {'oldest':>8}"
        )
        lines.append(header)
        estimated = "~" if report.get("waiting_exact") is False else ""
        for name, q in brk["queues"].items():
            waiting = f"{estimated}{q['waiting']}" if q.get("waiting") is not None else "?"
            lines.append(
                f"  {name:<20} {q['depth']:>6} {_seconds(q['oldest_queued_s']):>8} {q['in_flight']:>9} {q['slots']:>6}"
                f" {q['free_slots']:>5} {q.get('held', 0):>5} {waiting:>16} {_seconds(q.get('oldest_waiting_s')):>8}"
            )
        for name in brk.get("unserved", []):
            held = brk["queues"].get(name, {}).get("held", 0)
            lines.append(f"  ! no worker consumes queue {name}: the bridge holds {held} rollouts (QUEUE_BY_MODE)")
    lines.append(f"Workers ({len(report['workers'])} online, {report['in_flight']} rollouts in flight)")
    for worker in report["workers"]:
        queues = ",".join(worker["queues"]) or "?"
        lines.append(f"  {worker['name']}  queues={queues} slots={worker['slots']} active={len(worker['active'])}")
        if worker.get("stuck_threads"):
            lines.append(
                f"    ! {worker['stuck_threads']} agent threads stuck past their deadline (slots withheld;"
                " MAX_STUCK_AGENT_THREADS restarts the worker)"
            )
        if worker.get("program_isolation"):
            lines.append(f"    1.0 programs: {worker['program_isolation']}")
        for task in worker["active"]:
            lines.append(f"    {task['task'] or task['attempt_id']}")
    if report["last_errors"]:
        lines.append("Last errors")
        for error in report["last_errors"]:
            lines.append(f"  {error['rollout_id']} [{error['failure_class']}] {error['error'][:100]}")
    return "\n".join(lines)
