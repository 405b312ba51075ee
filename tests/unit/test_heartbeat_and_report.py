"""The final report never races a heartbeat (``AttemptWatch.begin_reporting``): it waits for one in flight, and
none starts once it is under way, so the report is the executor's last write (docs/architecture.md, "Heartbeats
and the report")."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any, cast

from bridge.core.store import StoreClient
from workers.protocol.heartbeat import AttemptWatch, HeartbeatMonitor
from workers.protocol.lease import Lease


class SlowStore:
    """A Store whose heartbeat call blocks until released, recording each call."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.entered, self.release = threading.Event(), threading.Event()

    def update_attempt(self, rollout_id: str, attempt_id: str, **fields: Any) -> Any:
        self.calls.append(fields)
        self.entered.set()
        assert self.release.wait(5)
        return SimpleNamespace(status="running")


def watch_and_monitor() -> tuple[AttemptWatch, HeartbeatMonitor, SlowStore]:
    store = SlowStore()
    lease = cast(Lease, SimpleNamespace(valid_until=time.monotonic() + 60))  # a lease renewed just now
    watch = AttemptWatch("ro-1", "at-1", lease, None, interval_s=1.0, flush_interval_s=1.0, unresponsive_s=30.0)
    return watch, HeartbeatMonitor(cast(StoreClient, store), cast(Any, None)), store


def test_the_report_waits_for_a_heartbeat_in_flight() -> None:
    watch, monitor, store = watch_and_monitor()
    beat = threading.Thread(target=monitor.send_heartbeat, args=(watch, 5.0))
    beat.start()
    assert store.entered.wait(5)
    reporting = threading.Thread(target=watch.begin_reporting)
    reporting.start()
    reporting.join(0.3)
    assert reporting.is_alive()  # the heartbeat has not returned: the report must not go out yet
    store.release.set()
    reporting.join(5)
    beat.join(5)
    assert not reporting.is_alive() and watch.reporting


def test_no_heartbeat_starts_once_the_report_is_under_way() -> None:
    watch, monitor, store = watch_and_monitor()
    store.release.set()
    monitor.send_heartbeat(watch, 5.0)
    assert len(store.calls) == 1 and "last_heartbeat_time" in store.calls[0]
    watch.begin_reporting()
    monitor.send_heartbeat(watch, 5.0)
    assert len(store.calls) == 1
