"""The fence board: one Store read per round for the attempts of every worker process, through a real Redis.

Each ``HeartbeatMonitor`` here stands for one worker process (as under ``-P prefork``), each with its own
``FenceBoard`` on the same Redis. The Store is a recorder that answers rollout reads from a table the test
edits (cancel, supersede) and counts every read with the ids it asked for; leases look freshly renewed so
that only the fence logic decides. Rounds are driven by calling ``beat_due`` as the Store thread would.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import cast

import pytest
import redis

from bridge.core.coordination import keys
from bridge.core.infra import StoreError
from bridge.core.store import Attempt, AttemptedRollout, Rollout, StoreClient
from workers.protocol import fence_board
from workers.protocol.fence_board import FenceBoard
from workers.protocol.heartbeat import AttemptWatch, HeartbeatMonitor
from workers.protocol.lease import Lease

INTERVAL_S = 1.0


class RecordingStore:
    """Answers ``get_rollouts`` from ``rollouts``; ``reads`` holds the ids of every read, in order."""

    def __init__(self) -> None:
        self.rollouts: dict[str, AttemptedRollout] = {}
        self.reads: list[list[str]] = []
        self.down = False
        self.answer_reads = 1_000_000  # reads after this many raise, as a Store that stops answering

    def add(self, rollout_id: str) -> str:
        attempt_id = f"at-{uuid.uuid4().hex[:8]}"
        self.rollouts[rollout_id] = AttemptedRollout(
            rollout_id=rollout_id,
            status="running",
            attempt=Attempt(rollout_id=rollout_id, attempt_id=attempt_id, status="running"),
        )
        return attempt_id

    def get_rollouts(
        self, rollout_ids: Sequence[str], *, retries: int | None = None, timeout: float | None = None
    ) -> dict[str, Rollout | AttemptedRollout]:
        if self.down or len(self.reads) >= self.answer_reads:
            raise StoreError("the Store is down (test)")
        self.reads.append(list(dict.fromkeys(rollout_ids)))
        return {rid: self.rollouts[rid] for rid in rollout_ids if rid in self.rollouts}


@pytest.fixture
def store_url() -> str:
    return f"http://store-{uuid.uuid4().hex[:8]}.test:4747"  # a scope of its own for every test


@pytest.fixture
def store() -> RecordingStore:
    return RecordingStore()


@pytest.fixture
def processes(redis_client: redis.Redis, store: RecordingStore, store_url: str) -> Iterator[list[HeartbeatMonitor]]:
    monitors = [
        HeartbeatMonitor(cast(StoreClient, store), redis_client, FenceBoard(redis_client, keys.store_scope(store_url)))
        for _ in range(3)
    ]
    yield monitors
    _clear_boards(redis_client)


def _clear_boards(client: redis.Redis) -> None:
    board_keys = list(client.scan_iter("agl:fence:*"))
    if board_keys:
        client.delete(*board_keys)


def _watch(monitor: HeartbeatMonitor, store: RecordingStore, rollout_id: str) -> AttemptWatch:
    attempt_id = store.add(rollout_id)
    lease = Lease(monitor.redis, attempt_id, 30.0)
    lease.valid_until = time.monotonic() + 3600  # freshly renewed, for the whole test
    return AttemptWatch(
        rollout_id, attempt_id, lease, None, interval_s=INTERVAL_S, flush_interval_s=float("inf"), viewed_at=time.time()
    )


def _run_rounds(
    monitors: list[HeartbeatMonitor], watches: dict[HeartbeatMonitor, list[AttemptWatch]], seconds: float
) -> None:
    """What each process's Store thread does, every tick, for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for monitor in monitors:
            monitor.beat_due(watches[monitor])
        time.sleep(0.05)


def test_one_read_per_round_covers_every_process_and_each_sees_it(
    processes: list[HeartbeatMonitor], store: RecordingStore
) -> None:
    watches = {m: [_watch(m, store, f"ro-{i}-{j}") for j in range(2)] for i, m in enumerate(processes)}
    every = {w.rollout_id for ws in watches.values() for w in ws}
    _run_rounds(processes, watches, 1.2)  # listed, first beats due, the first rounds read
    started, viewed = len(store.reads), {w: w.viewed_at for ws in watches.values() for w in ws}

    _run_rounds(processes, watches, 4 * INTERVAL_S)
    reads = store.reads[started:]
    # About one read per interval for all six attempts of the three processes (three a round without the board),
    # and each read covered every attempt.
    assert 3 <= len(reads) <= 6, f"{len(reads)} reads in 4 intervals: {reads}"
    assert all(set(ids) == every for ids in reads), reads
    for ws in watches.values():
        for watch in ws:
            assert watch.stop_reason is None
            assert watch.viewed_at > viewed[watch] + 2 * INTERVAL_S, "a process never took the board's reads"


def test_a_change_read_by_another_process_stops_the_attempt_within_an_interval(
    processes: list[HeartbeatMonitor], store: RecordingStore
) -> None:
    watches = {m: [_watch(m, store, f"ro-{i}")] for i, m in enumerate(processes)}
    _run_rounds(processes, watches, 1.5)
    cancelled, superseded, untouched = (watches[m][0] for m in processes)
    store.rollouts[cancelled.rollout_id] = store.rollouts[cancelled.rollout_id].model_copy(
        update={"status": "cancelled"}
    )
    current = store.rollouts[superseded.rollout_id]
    store.rollouts[superseded.rollout_id] = current.model_copy(
        update={"attempt": current.attempt.model_copy(update={"attempt_id": "at-newer", "sequence_id": 2})}
    )
    changed = time.monotonic()
    seen: dict[str, float] = {}
    while time.monotonic() - changed < 3 * INTERVAL_S and len(seen) < 2:
        _run_rounds(processes, watches, 0.05)
        for watch in (cancelled, superseded):
            if watch.stop_reason is not None and watch.rollout_id not in seen:
                seen[watch.rollout_id] = time.monotonic() - changed
    assert cancelled.stop_reason == "rollout is cancelled"
    assert superseded.stop_reason == "superseded by attempt at-newer"
    assert max(seen.values()) <= INTERVAL_S + fence_board.CHECK_EVERY_S + 0.3, seen
    assert untouched.stop_reason is None


def test_attempts_the_board_has_no_verdicts_for_are_still_read_every_interval(
    processes: list[HeartbeatMonitor], store: RecordingStore, redis_client: redis.Redis
) -> None:
    first, second, _ = processes
    watches = {first: [_watch(first, store, "ro-a")], second: [_watch(second, store, "ro-b")], processes[2]: []}
    _run_rounds([first, second], watches, 1.5)
    # From now on no verdict reaches the board (a reader that dies after its read, Redis emptied): every
    # attempt must still be read each interval, by its own process.
    _clear_boards(redis_client)
    original_post = FenceBoard.post
    FenceBoard.post = lambda self, *args, **kwargs: None  # type: ignore[method-assign]
    try:
        before = {w: w.viewed_at for ws in watches.values() for w in ws}
        _run_rounds([first, second], watches, 3 * INTERVAL_S)
    finally:
        FenceBoard.post = original_post  # type: ignore[method-assign]
    for ws in watches.values():
        for watch in ws:
            assert watch.stop_reason is None
            assert watch.viewed_at > before[watch] + INTERVAL_S, f"{watch.rollout_id} was not read for 3 intervals"


def test_without_redis_each_process_reads_its_own(store: RecordingStore, store_url: str) -> None:
    dead = redis.Redis(port=1, socket_connect_timeout=0.2, socket_timeout=0.2)
    monitors = [
        HeartbeatMonitor(cast(StoreClient, store), dead, FenceBoard(dead, keys.store_scope(store_url)))
        for _ in range(2)
    ]
    watches = {m: [_watch(m, store, f"ro-{i}")] for i, m in enumerate(monitors)}
    for ws in watches.values():
        ws[0].lease_unknown = True  # Redis unreachable: renewals cannot prove the lease, nobody can take it over
    _run_rounds(monitors, watches, 2.5 * INTERVAL_S)
    assert {tuple(ids) for ids in store.reads} == {("ro-0",), ("ro-1",)}, store.reads  # each its own, as before
    assert all(ws[0].stop_reason is None for ws in watches.values())


def test_clusters_sharing_a_redis_never_fence_each_others_attempts(
    redis_client: redis.Redis, store: RecordingStore
) -> None:
    ours, theirs = RecordingStore(), store
    a = HeartbeatMonitor(
        cast(StoreClient, ours), redis_client, FenceBoard(redis_client, keys.store_scope("http://store-a.test:1"))
    )
    b = HeartbeatMonitor(
        cast(StoreClient, theirs), redis_client, FenceBoard(redis_client, keys.store_scope("http://store-b.test:1"))
    )
    try:
        watches = {a: [_watch(a, ours, "ro-a")], b: [_watch(b, theirs, "ro-b")]}
        _run_rounds([a, b], watches, 2.5 * INTERVAL_S)
        assert all(ids == ["ro-a"] for ids in ours.reads) and ours.reads
        assert all(ids == ["ro-b"] for ids in theirs.reads) and theirs.reads
        assert watches[a][0].stop_reason is None and watches[b][0].stop_reason is None
    finally:
        _clear_boards(redis_client)


def test_a_round_too_big_for_one_request_reads_its_own_first_and_gives_up_the_rest_when_the_store_fails(
    processes: list[HeartbeatMonitor], store: RecordingStore, redis_client: redis.Redis, store_url: str
) -> None:
    reader = processes[0]
    mine = _watch(reader, store, "ro-mine")
    others = [(f"ro-other-{i:03d}", store.add(f"ro-other-{i:03d}")) for i in range(250)]
    FenceBoard(redis_client, keys.store_scope(store_url)).exchange(
        others, INTERVAL_S
    )  # another process lists 250 attempts
    store.answer_reads = 1  # the Store answers the first request of the round, then fails
    mine.next_beat = 0.0
    reader.beat_due([mine])

    assert [len(ids) for ids in store.reads] == [100], store.reads  # own attempt and the 99 others that fit
    assert store.reads[0][0] == "ro-mine"
    assert mine.stop_reason is None and mine.beats == 1, "a failure reading for others counted against its own"
    posted = redis_client.mget([keys.fence_verdict(keys.store_scope(store_url), aid) for _, aid in others])
    assert sum(value is not None for value in posted) == 99  # the rest get no verdict: their process reads them


def test_an_attempt_with_a_shorter_interval_than_the_round_holders_is_still_read_every_interval(
    processes: list[HeartbeatMonitor], store: RecordingStore
) -> None:
    # A rollout with unresponsive_seconds gets a shorter interval than the others: its process must not wait
    # out a round held for a longer interval.
    slow_process, fast_process, _ = processes
    slow = _watch(slow_process, store, "ro-slow")
    slow.interval_s = 3 * INTERVAL_S
    fast = _watch(fast_process, store, "ro-fast")
    watches = {slow_process: [slow], fast_process: [fast]}
    slow.next_beat = 0.0  # the slow process takes the first round, held as long as the board allows

    views: list[tuple[float, float]] = []  # (monotonic time, the fast attempt's view) at each change
    end = time.monotonic() + 4 * INTERVAL_S
    while time.monotonic() < end:
        for monitor in (slow_process, fast_process):
            monitor.beat_due(watches[monitor])
        if not views or fast.viewed_at > views[-1][1]:
            views.append((time.monotonic(), fast.viewed_at))
        time.sleep(0.05)
    gaps = [later[0] - earlier[0] for earlier, later in itertools.pairwise(views)]
    assert gaps and max(gaps) <= INTERVAL_S + fence_board.CHECK_EVERY_S + 0.3, gaps
    assert fast.stop_reason is None and slow.stop_reason is None


def test_a_verdict_older_than_one_read_never_counts_as_a_read(
    redis_client: redis.Redis,
    store: RecordingStore,
    store_url: str,
    processes: list[HeartbeatMonitor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A verdict posted by a round whose reader then died lives on for a few intervals: it must not stand in for
    the read a heartbeat needs."""
    monkeypatch.setattr(fence_board, "CHECK_EVERY_S", 0.0)  # each beat_due exchanges with the board
    monitor = processes[0]
    watch = _watch(monitor, store, "ro-stale")
    watch.viewed_at = 0.0
    watch.next_beat = time.monotonic() + 3600  # no beat of its own is due: only the board's verdicts count
    stale = time.time() - 3 * INTERVAL_S
    redis_client.set(keys.fence_verdict(keys.store_scope(store_url), watch.attempt_id), f"{stale:.3f}")
    monitor.beat_due([watch])
    assert watch.viewed_at == 0.0 and watch.beats == 0 and watch.stop_reason is None
    fresh = time.time() - 0.1
    redis_client.set(keys.fence_verdict(keys.store_scope(store_url), watch.attempt_id), f"{fresh:.3f}")
    monitor.beat_due([watch])
    assert watch.viewed_at == pytest.approx(fresh, abs=0.01) and watch.beats == 1
