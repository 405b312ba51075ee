"""One OTLP request for the final span batches that a process's attempts flush at the same time (a group commit).

A flush that finds no request in flight goes at once, or after a short wait for others (``gather_s``:
``SHARE`` of the mean episode, at most ``SPAN_GATHER_MAX_S``, taken only when another attempt of the process
is expected to end meanwhile); flushes that arrive while one is in flight go together in the next request.
Serialized ``ExportTraceServiceRequest`` messages concatenate and the Store files each resource's spans under
its attempt (docs/store-protocol.md 7.2), so only the number of requests changes. A shared request is one try
bounded by the shortest time any member has left; if it fails, every member sends alone with the usual
retries, and a member short of time never waits. Under prefork (one attempt per process) every flush goes
alone at once. Figures: docs/performance.md, "Store requests per rollout".
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field

import httpx

from bridge.core.infra import StoreError, StoreUnavailable
from bridge.core.store import TRACES, StoreClient

log = logging.getLogger("workers.telemetry.courier")

MAX_BYTES = 4 * 1024 * 1024  # a shared request's body (~40 KB per WebShop rollout, mostly token ids)
MAX_PARCELS = 64
MIN_TRY_S = 0.2  # a member with less time left than this goes alone (and its caller retries the round)
SHARE = 0.01  # of the mean episode: the longest a flush waits for others
MIN_JOINERS = 1.0  # expected flushes of other attempts within the wait; fewer: no wait
EPISODE_WEIGHT = 0.1  # of each new episode in the running mean


@dataclass(eq=False)
class _Parcel:
    payload: bytes
    deadline: float | None  # epoch seconds
    timeout: float | None  # per try, from when the parcel was handed in
    handed_in: float = field(default_factory=time.monotonic)
    state: str = "queued"  # queued -> taken (in a request) -> done
    alone: bool = False  # done, but not delivered: the caller sends it alone
    error: Exception | None = None  # done, and its lone send failed

    def time_left(self) -> float | None:
        left = None if self.timeout is None else self.timeout - (time.monotonic() - self.handed_in)
        if self.deadline is not None:
            until_deadline = self.deadline - time.time()
            left = until_deadline if left is None else min(left, until_deadline)
        return left

    def try_timeout(self) -> float | None:
        return None if self.timeout is None else self.timeout - (time.monotonic() - self.handed_in)


class TraceCourier:
    """Group commit of span payloads to one OTLP endpoint, for every attempt of a process."""

    def __init__(self, store: StoreClient, url: str | None = None, *, gather_max_s: float = 0.0) -> None:
        self._store = store
        self._url = url
        self._gather_max_s = gather_max_s
        self._cond = threading.Condition()
        self._queue: collections.deque[_Parcel] = collections.deque()
        self._busy = False
        self._running = 0  # attempts of this process between ``opened`` and ``closed``
        self._episode_s: float | None = None  # running mean of the attempts' time at their final flush
        self.requests = 0  # shared or lone, sent by the courier (for tests and logs)

    def opened(self) -> None:
        with self._cond:
            self._running += 1

    def closed(self) -> None:
        with self._cond:
            self._running = max(0, self._running - 1)

    @property
    def running(self) -> int:
        with self._cond:
            return self._running

    def gather_s(self) -> float:
        """How long a flush that finds no request in flight waits for others (0: it goes at once)."""
        with self._cond:
            return self._gather_s()

    def _gather_s(self) -> float:
        episode = self._episode_s
        if self._gather_max_s <= 0 or not episode:
            return 0.0
        wait = min(self._gather_max_s, SHARE * episode)
        return wait if (self._running - 1) * wait / episode >= MIN_JOINERS else 0.0

    def send(
        self, payload: bytes, *, deadline: float | None, timeout: float | None, running_s: float | None = None
    ) -> None:
        """Deliver ``payload`` (a serialized ``ExportTraceServiceRequest``); raise what a lone send raises.

        ``running_s``: how long the attempt has run, for the mean episode the wait for others is a share of.
        """
        parcel = _Parcel(payload, deadline, timeout)
        with self._cond:
            if running_s is not None:
                mean = self._episode_s
                self._episode_s = running_s if mean is None else mean + EPISODE_WEIGHT * (running_s - mean)
            self._queue.append(parcel)
            self._cond.notify_all()  # a leader gathering others counts them
            batch = self._wait_or_lead(parcel)
        if batch:
            self._deliver(batch)
        if parcel.error is not None:
            raise parcel.error
        if parcel.alone:
            self._send_alone(parcel)

    def _wait_or_lead(self, parcel: _Parcel) -> list[_Parcel]:
        """Under the lock: the batch to send when this caller leads, else [] once another caller settled it."""
        while parcel.state != "done":
            if parcel.state == "taken":
                self._cond.wait()
                continue
            left = parcel.time_left()
            if left is not None and left <= 0:  # out of time before it could lead: the lone send says why
                self._queue.remove(parcel)
                parcel.state, parcel.alone = "done", True
                return []
            if not self._busy:
                self._busy = True
                self._gather(parcel)
                return self._take(parcel)
            if left is not None and left <= MIN_TRY_S:  # the request in flight is taking too long: go alone
                self._queue.remove(parcel)
                parcel.state, parcel.alone = "done", True
                return []
            self._cond.wait(None if left is None else left - MIN_TRY_S)
        return []

    def _gather(self, own: _Parcel) -> None:
        """Under the lock, as the leader: wait for others' flushes while the wait lasts, the request has room
        and ``own`` keeps time for its try (the others' own bounds are checked when the batch is taken)."""
        until = time.monotonic() + self._gather_s()
        while len(self._queue) < MAX_PARCELS:
            wait = until - time.monotonic()
            left = own.time_left()
            if left is not None:
                wait = min(wait, left - 2 * MIN_TRY_S)
            if wait <= 0:
                return
            self._cond.wait(wait)

    def _take(self, own: _Parcel) -> list[_Parcel]:
        self._queue.remove(own)
        batch, size, waiting = [own], len(own.payload), collections.deque[_Parcel]()
        for parcel in self._queue:
            left = parcel.time_left()
            fits = len(batch) < MAX_PARCELS and size + len(parcel.payload) <= MAX_BYTES
            if fits and (left is None or left > MIN_TRY_S):
                batch.append(parcel)
                size += len(parcel.payload)
            else:
                waiting.append(parcel)
        self._queue = waiting
        for parcel in batch:
            parcel.state = "taken"
        return batch

    def _deliver(self, batch: list[_Parcel]) -> None:
        try:
            if len(batch) == 1:
                self._deliver_one(batch[0])
            else:
                self._deliver_together(batch)
        finally:
            with self._cond:
                for parcel in batch:
                    parcel.state = "done"
                self._busy = False
                self._cond.notify_all()

    def _deliver_one(self, parcel: _Parcel) -> None:
        try:
            self._post(parcel.payload, parcel.deadline, parcel.try_timeout(), once=False)
        except Exception as exc:  # raised in the caller's thread, whose flush turns it into its error
            parcel.error = exc

    def _deliver_together(self, batch: list[_Parcel]) -> None:
        lefts = [left for left in (parcel.time_left() for parcel in batch) if left is not None]
        try:
            self._post(b"".join(parcel.payload for parcel in batch), None, min(lefts, default=None), once=True)
        except Exception as exc:
            log.info("a shared span request for %d attempts failed (%s); each sends alone", len(batch), exc)
            for parcel in batch:
                parcel.alone = True
            if not isinstance(exc, (StoreError, httpx.HTTPError)):  # not the Store's answer (a time limit): raise it
                batch[0].alone, batch[0].error = False, exc

    def _send_alone(self, parcel: _Parcel) -> None:
        left = parcel.time_left()
        if left is not None and left <= 0:
            raise StoreUnavailable("the span batch waited its whole time bound for a shared request", path=TRACES)
        self._post(parcel.payload, parcel.deadline, parcel.try_timeout(), once=False)

    def _post(self, payload: bytes, deadline: float | None, timeout: float | None, *, once: bool) -> None:
        with self._cond:
            self.requests += 1
        self._store.post_traces(payload, url=self._url, deadline=deadline, timeout=timeout, once=once)
