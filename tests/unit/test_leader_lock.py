"""The dispatch lock (``bridge.dispatch.leader``): one leader per deployment, renewed while held, taken over
once it lapses, and never dropped or extended by a bridge that lost it. Real Redis (tests/redis_for_tests.py)."""

from __future__ import annotations

import uuid

import redis

from bridge.core import keys
from bridge.dispatch.leader import LEADER_TTL_S, LeaderLock, dispatching


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
