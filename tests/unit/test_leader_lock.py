"""The dispatch lock (``bridge.dispatch.leader``): one leader per deployment, renewed while held, taken over
once it lapses, and never dropped or extended by a bridge that lost it. Real Redis (tests/redis_for_tests.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from bridge.core.coordination import coordination_client, keys
from bridge.dispatch.leader import LEADER_TTL_S, RENEW_EVERY_S, STANDBY_RETRY_S, LeaderLock, dispatching
from tests.helpers import TEST_REDIS_URL, wait_for

ROOT = Path(__file__).resolve().parents[2]


def test_a_lapsed_leader_is_replaced_and_never_touches_the_new_leaders_lock(redis_client: redis.Redis) -> None:
    scope = f"leader-{uuid.uuid4().hex[:8]}"
    key = keys.bridge_leader(scope)
    old, new = LeaderLock(redis_client, "bridge-old", scope=scope), LeaderLock(redis_client, "bridge-new", scope=scope)
    try:
        assert old.ensure() == (True, True)
        assert redis_client.get(key) == old.token  # the token names the bridge, for standbys' logs
        redis_client.pexpire(key, 50)
        assert old.ensure() == (True, False)  # renewed on its next tick
        assert redis_client.pttl(key) > (LEADER_TTL_S - 1) * 1000
        assert new.ensure() == (False, False)

        redis_client.delete(key)  # the old leader stalled past its TTL
        assert new.ensure() == (True, True)
        assert old.ensure() == (False, False) and not old.held  # it notices, and stands by
        old.release()  # a no-op: not ours any more
        assert redis_client.get(key) == new.token and dispatching(redis_client, scope)
    finally:
        new.release()
        old.release()
    assert not dispatching(redis_client, scope)


def test_a_sigkilled_leader_is_replaced_within_its_short_ttl(redis_client: redis.Redis) -> None:
    """A leader process killed with SIGKILL (no release) is replaced once its lock lapses: within LEADER_TTL_S plus
    a standby's retry, well under 5 s (it was 15 s)."""
    scope = f"leader-{uuid.uuid4().hex[:8]}"
    program = (
        "import sys, time\n"
        "from bridge.core.coordination.connection import coordination_client\n"
        "from bridge.dispatch.leader import LeaderLock\n"
        f"lock = LeaderLock(coordination_client({TEST_REDIS_URL!r}), 'bridge-killed', scope={scope!r})\n"
        "assert lock.ensure() == (True, True)\n"
        "print('leading', flush=True)\n"
        "time.sleep(60)\n"
    )
    leader = subprocess.Popen(
        [sys.executable, "-c", program], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    standby = LeaderLock(redis_client, "bridge-standby", scope=scope)
    try:
        assert leader.stdout is not None and leader.stdout.readline().strip() == "leading"
        time.sleep(2 * RENEW_EVERY_S + LEADER_TTL_S)  # alive, it keeps the lock past its TTL (its renewal thread)
        assert standby.ensure() == (False, False)
        leader.send_signal(signal.SIGKILL)
        leader.wait(10)
        killed = time.monotonic()
        while not standby.ensure()[0]:
            assert time.monotonic() - killed < 5.0, "the standby did not take over within 5 s"
            time.sleep(STANDBY_RETRY_S)
        assert time.monotonic() - killed <= LEADER_TTL_S + STANDBY_RETRY_S + 0.5
    finally:
        leader.kill()
        standby.release()


def test_a_leader_whose_loop_blocks_past_the_ttl_keeps_the_lock(redis_client: redis.Redis) -> None:
    scope = f"leader-{uuid.uuid4().hex[:8]}"
    leader, standby = LeaderLock(redis_client, "bridge-slow", scope=scope), LeaderLock(redis_client, "b", scope=scope)
    try:
        assert leader.ensure() == (True, True)
        time.sleep(2 * LEADER_TTL_S)  # the dispatch loop blocked on a slow Store: no tick renews
        assert leader.valid() and redis_client.get(keys.bridge_leader(scope)) == leader.token
        assert standby.ensure() == (False, False)
        assert leader.ensure() == (True, False)
    finally:
        leader.release()
        standby.release()


def test_a_leader_cut_off_from_redis_stops_publishing_before_its_lock_can_lapse(redis_client: redis.Redis) -> None:
    """The fence: ``valid()`` ends before the key can expire in Redis, so no standby leads while it still publishes."""
    leader, key, link = _leader_and_a_dead_redis(redis_client, "bridge-cut-off")
    try:
        assert leader.ensure() == (True, True)
        link.cut()  # its renewals fail from now on; Redis keeps the last one's expiry
        while redis_client.exists(key):
            if not leader.valid():
                break
            time.sleep(0.02)
        else:
            pytest.fail("the lock lapsed in Redis while the leader still counted itself valid")
        assert redis_client.pttl(key) > 0  # the fence closed first
        assert leader.held  # it only knows it may not publish; the next tick's ensure decides the rest
    finally:
        leader.release()
        redis_client.delete(key)


def test_a_leader_whose_lock_was_taken_notices_without_a_tick(redis_client: redis.Redis) -> None:
    scope = f"leader-{uuid.uuid4().hex[:8]}"
    key = keys.bridge_leader(scope)
    leader = LeaderLock(redis_client, "bridge-a", scope=scope)
    try:
        assert leader.ensure() == (True, True)
        redis_client.set(key, "someone-else", px=int(LEADER_TTL_S * 1000))
        wait_for(lambda: not leader.valid() and not leader.held, 2 * RENEW_EVERY_S + 1, "the renewal thread noticed")
        assert redis_client.get(key) == "someone-else"  # never extended nor dropped by the old leader
    finally:
        leader.release()
        redis_client.delete(key)


class _SeveredRedis:
    """A Redis client whose calls go to ``client`` until ``cut()``, then to a Redis that nothing serves, until
    ``mend()``: a network partition between one process and Redis, the others still reaching it."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.unreachable = coordination_client(f"redis://127.0.0.1:{_closed_port()}/0", socket_connect_timeout=0.2)
        self.target = client

    def cut(self) -> None:
        self.target = self.unreachable

    def mend(self) -> None:
        self.target = self.client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)


def _leader_and_a_dead_redis(client: redis.Redis, name: str) -> tuple[LeaderLock, str, _SeveredRedis]:
    """A leader of a fresh scope on a severable link to ``client``, its lock's key, and the link."""
    scope = f"leader-{uuid.uuid4().hex[:8]}"
    link = _SeveredRedis(client)
    return LeaderLock(cast(redis.Redis, link), name, scope=scope), keys.bridge_leader(scope), link


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_leader_that_lost_redis_for_good_ends_its_term_once_the_lock_expired(redis_client: redis.Redis) -> None:
    """Its renewal thread retried every second for as long as the process lived (the suite's logs showed threads of
    finished tests still retrying against Redis servers long gone). Once the key must have expired in Redis the
    lock is nobody's: the term ends, the thread with it, and the next ``ensure`` competes for the lock anew."""
    leader, key, link = _leader_and_a_dead_redis(redis_client, "bridge-lost-redis")
    try:
        before = set(threading.enumerate())
        assert leader.ensure() == (True, True)
        [renewer] = [t for t in threading.enumerate() if t.name == "leader-renewal" and t not in before]
        assert renewer.is_alive()
        link.cut()
        wait_for(lambda: not leader.held, LEADER_TTL_S + 2 * RENEW_EVERY_S + 1, "the term ended")
        renewer.join(timeout=RENEW_EVERY_S + 1)
        assert not renewer.is_alive()
        assert not redis_client.exists(key)  # it ended only once the key had expired
        link.mend()  # Redis is back: the next tick takes the free lock like any bridge
        assert leader.ensure() == (True, True)
    finally:
        leader.release()
        redis_client.delete(key)
