"""Expired messages' rollouts handed back to the Store (docs/store-protocol.md section 10, "Handing a rollout back").

A worker bootstep (``ExpiredHandBackStep``): Celery sends ``task_revoked`` from the node's main process, where its
consumer finds a message revoked or expired, and no step is called per message. Its ``start`` hooks ``on_revoked``
there; it requires ``SlotAdvertising``, whose advert names the Redis a revoked task's slot is freed in. A revoked
task frees its slot; an expired one's rollout is queued to ``ExpiredHandBack`` (its state, ``state.node.hand_back``),
whose thread does the Store calls off Celery's loop. Its ``stop`` unhooks it once the consumer stopped (Celery stops
the consumer first); a hand-back still queued then is lost with the process, and the Store's watchdog or the bridge's
reconcile hands the rollout back.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import redis
from celery import bootsteps, signals

from bridge.core.coordination import markers
from bridge.core.infra import StoreError
from bridge.core.settings import get_settings
from bridge.core.store import StoreClient, handback
from bridge.core.task import TASK_NAME
from workers.lifecycle import state
from workers.lifecycle.steps.advertising import SlotAdvertising, current_advert
from workers.protocol.lease import free_slot

log = logging.getLogger(__name__)


class ExpiredHandBackStep(bootsteps.StartStopStep):
    """Hooks ``on_revoked`` on ``task_revoked`` while the node takes messages."""

    label = "expired hand-back"
    requires = (SlotAdvertising,)

    def start(self, w: Any) -> None:
        signals.task_revoked.connect(on_revoked, weak=False, dispatch_uid=__name__)

    def stop(self, w: Any) -> None:
        signals.task_revoked.disconnect(dispatch_uid=__name__)

    terminate = stop


def on_revoked(sender: Any = None, request: Any = None, expired: bool = False, **_: Any) -> None:
    """``task_revoked`` of a 0.3 task: free its slot; if it expired in the broker, hand its rollout back."""
    if getattr(sender, "name", None) != TASK_NAME or request is None:
        return
    kwargs = getattr(request, "kwargs", None) or {}
    rollout = kwargs.get("rollout") if isinstance(kwargs, dict) else None
    queue_name = kwargs.get("queue") if isinstance(kwargs, dict) else None
    task_id = str(getattr(request, "id", ""))
    advert = current_advert()
    if advert is not None and queue_name:
        try:
            # Not while another executor holds the attempt: a revoked duplicate must not free the live one's slot.
            free_slot(advert.client, advert.scope, queue_name, task_id)
        except redis.RedisError:
            pass
    has_store = get_settings().store_url is not None  # else the rollout was never this worker's to run
    if expired and isinstance(rollout, dict) and has_store and not _started_elsewhere(task_id):
        expired_hand_back().submit(rollout)  # the Store calls run on a thread of their own, off the consumer loop


def _started_elsewhere(attempt_id: str) -> bool:
    """An expired duplicate of an attempt another executor runs (a Celery retry keeps the first ``expires``):
    handing it back would fence the live execution out and waste its episode."""
    advert = current_advert()
    if advert is None:
        return False
    try:
        fact = markers.read_markers(advert.client, [attempt_id])[attempt_id]
    except redis.RedisError:
        return False  # the hand-back re-checks the Store: only a still-unstarted latest attempt is requeued
    return fact.leased or fact.started


class ExpiredHandBack:
    """Hands expired messages' rollouts back to the Store from a thread of its own, never Celery's loop.

    ``task_revoked`` runs inside the consumer's event loop (the only thread taking messages for every slot of the
    node), where Store calls with retries would stop the node taking messages while the Store is slow, exactly
    when a burst of expiries arrives. The handler only queues the rollout; one lazily started daemon thread per
    process does the Store calls. A hand-back lost when the process exits leaves the attempt ``preparing`` until
    the Store's watchdog or the bridge's reconcile hands it back.
    """

    MAX_QUEUED = 10_000

    def __init__(self) -> None:
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=self.MAX_QUEUED)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, rollout: dict[str, Any]) -> None:
        """Queue a hand-back and return at once (called in the consumer loop)."""
        try:
            self._queue.put_nowait(rollout)
        except queue.Full:
            log.error("too many expired messages waiting to be handed back; dropping one (the watchdog will)")
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="expired-hand-back", daemon=True)
                self._thread.start()

    def join(self, timeout_s: float) -> bool:
        """Wait until every queued hand-back was tried (tests); True if the queue drained in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.05)
        return False

    def _run(self) -> None:
        settings = get_settings()
        with StoreClient.from_settings(settings, retries=2) as store:
            while True:  # a daemon thread: it ends with its process
                rollout = self._queue.get()
                try:
                    hand_back_expired(rollout, store)
                except Exception:  # the thread must survive anything one rollout throws
                    log.exception("handing back an expired rollout failed")
                finally:
                    self._queue.task_done()


def expired_hand_back() -> ExpiredHandBack:
    """The node's hand-back of expired messages (``state.node.hand_back``), made on first use."""
    node = state.node
    if node.hand_back is None:
        node.hand_back = ExpiredHandBack()
    return node.hand_back


def hand_back_expired(rollout: dict[str, Any], store: StoreClient) -> None:
    """Requeue an expired message's rollout in the Store if it is live and its attempt the unstarted latest one."""
    rid = rollout.get("rollout_id")
    aid = (rollout.get("attempt") or {}).get("attempt_id")
    if not isinstance(rid, str) or not isinstance(aid, str):
        return
    try:
        why_not = handback.hand_back(store, rid, aid)
    except StoreError as exc:
        log.error("[rollout=%s attempt=%s] expired message could not be handed back: %s", rid, aid, exc)
        return
    if why_not is None:
        log.warning("[rollout=%s attempt=%s] message expired in the broker; handed back", rid, aid)
    else:
        log.info("[rollout=%s attempt=%s] message expired in the broker; not handed back: %s", rid, aid, why_not)
