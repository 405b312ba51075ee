"""In-memory sessions: one episode each, one asyncio lock each, idle expiry, bounded count.

Celery workers may send concurrent requests for one session; the per-session
lock makes each reset/step atomic without serialising different sessions.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field

from webshop_env.state import EpisodeState

logger = logging.getLogger("webshop_env.session")

DEFAULT_TTL_S = 30 * 60.0
DEFAULT_MAX_SESSIONS = 10_000


class SessionLimitError(Exception):
    """Every slot holds a live session; the client should retry later or delete sessions."""


@dataclass(slots=True)
class Session:
    """An id, its episode, a lock and the last time it was used."""

    session_id: str
    state: EpisodeState
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)

    def touch(self) -> None:
        """Mark as used now (postpones idle expiry)."""
        self.last_used = time.monotonic()


def new_session_id() -> str:
    """``session_`` + 12 hex digits."""
    return f"session_{secrets.token_hex(6)}"


class SessionStore:
    """Sessions by id, expiring after ``ttl_s`` idle seconds, at most ``max_sessions`` at once."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Session | None:
        """A live session, or None if unknown or expired (expired ones are dropped)."""
        session = self._sessions.get(session_id)
        if session is None:
            return None
        if self._expired(session, time.monotonic()):
            del self._sessions[session_id]
            logger.info("session %s expired", session_id)
            return None
        return session

    def create(self, session_id: str | None, state: EpisodeState) -> Session:
        """Add a session; frees expired ones first and raises SessionLimitError when still full."""
        if len(self._sessions) >= self.max_sessions:
            self.purge_expired()
        if len(self._sessions) >= self.max_sessions:
            raise SessionLimitError(f"session limit reached ({self.max_sessions} open sessions)")
        sid = session_id or new_session_id()
        while sid in self._sessions:
            sid = new_session_id()
        session = Session(sid, state)
        self._sessions[sid] = session
        return session

    def delete(self, session_id: str) -> bool:
        """Remove a session; False when it did not exist."""
        return self._sessions.pop(session_id, None) is not None

    def purge_expired(self) -> int:
        """Drop every session idle for longer than the TTL; returns how many went."""
        now = time.monotonic()
        stale = [sid for sid, s in self._sessions.items() if self._expired(s, now) and not s.lock.locked()]
        for sid in stale:
            del self._sessions[sid]
        if stale:
            logger.info("expired %d idle sessions", len(stale))
        return len(stale)

    def _expired(self, session: Session, now: float) -> bool:
        return now - session.last_used > self.ttl_s
