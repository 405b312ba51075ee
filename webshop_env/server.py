"""HTTP API (docs/webshop-env.md section 1): POST /reset, POST /step, GET /health, DELETE /sessions/{id}.

The catalog, search index and goals are built once in ``create_app``, before
the server accepts connections; requests then only touch in-memory state.
Steps run inline on the event loop: a cached search is microseconds and an
uncached one a millisecond or two, less than a thread hand-off would cost.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from webshop_env.env import EnvSettings, build_env, free_form_goal
from webshop_env.nouns import warm_up
from webshop_env.session import DEFAULT_MAX_SESSIONS, DEFAULT_TTL_S, SessionLimitError, SessionStore
from webshop_env.state import EpisodeState

logger = logging.getLogger("webshop_env.server")

MAX_ACTION_CHARS = 2000
MAX_BODY_BYTES = 64 * 1024
MAX_SESSION_ID_CHARS = 200
PURGE_INTERVAL_S = 60.0


class ApiError(Exception):
    """An error answered as ``{"error": message}`` with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Start-up options of ``python -m webshop_env serve``."""

    max_sessions: int = DEFAULT_MAX_SESSIONS
    session_ttl_s: float = DEFAULT_TTL_S
    seed: int = 0  # seeds the draw of random goals (resets without task/goal/instruction)
    env: EnvSettings = field(default_factory=EnvSettings)
    latency_ms: float = 0.0  # added before answering /reset and /step (benchmarks)
    error_rate: float = 0.0  # share of /reset and /step answered 503 *before* acting (fault tests)
    timeout_rate: float = 0.0  # share of /reset and /step that stall for `stall_s` before acting
    stall_s: float = 60.0
    nan_reward_rate: float = 0.0  # share of purchases answered with reward NaN; the ledger keeps the real one
    ledger_size: int = 100_000  # purchases remembered for GET /purchases


class WebShopServer:
    """Holds the environment, the sessions and the random-goal generator for the app."""

    def __init__(self, config: ServerConfig) -> None:
        started = time.perf_counter()
        self.env = build_env(config.env)
        catalog = self.env.catalog
        self.noun_extractor = warm_up()
        self.human_tasks = sum(1 for g in self.env.goals.goals if g.task_id.startswith("ws_"))
        self.store = SessionStore(config.max_sessions, config.session_ttl_s)
        self.rng = random.Random(config.seed)
        self.config = config
        self.faults = random.Random(config.seed + 1)
        self.ledger: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self.startup_s = time.perf_counter() - started
        logger.info(
            "ready in %.2fs: %d products, %d goals, nouns by %s",
            self.startup_s,
            len(catalog),
            len(self.env.goals),
            self.noun_extractor,
        )

    # -- request helpers --------------------------------------------------------------
    @staticmethod
    async def read_json(request: Request) -> dict[str, Any]:
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")
        if not body.strip():
            return {}
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"malformed JSON body: {exc}") from exc
        if not isinstance(data, dict):
            raise ApiError(400, "JSON body must be an object")
        return data

    @staticmethod
    def session_id_of(data: dict[str, Any]) -> str | None:
        sid = data.get("session_id", data.get("sessionId"))
        if sid is None:
            return None
        if not isinstance(sid, str) or not sid or len(sid) > MAX_SESSION_ID_CHARS:
            raise ApiError(400, f"session_id must be a non-empty string of at most {MAX_SESSION_ID_CHARS} chars")
        return sid

    def resolve_goal(self, data: dict[str, Any]) -> Any:
        """Spec 1 goal resolution: task_id, then goal_id, then instruction, then a random goal."""
        goals = self.env.goals
        task_id = data.get("task_id")
        if task_id is not None:
            goal = goals.by_task_id.get(str(task_id))
            if goal is None:
                raise ApiError(404, f"unknown task_id {task_id!r}; list tasks with `python -m webshop_env tasks`")
            return goal
        goal_id = data.get("goal_id")
        if goal_id is not None:
            return goals.goals[self._goal_index(goal_id, len(goals))]
        instruction = data.get("instruction")
        if instruction is not None:
            if not isinstance(instruction, str) or not instruction.strip():
                raise ApiError(400, "instruction must be a non-empty string")
            return goals.match_instruction(instruction) or free_form_goal(instruction)
        return goals.random_goal(self.rng)

    @staticmethod
    def _goal_index(goal_id: Any, count: int) -> int:
        if isinstance(goal_id, bool) or not isinstance(goal_id, int | str):
            raise ApiError(400, "goal_id must be an integer or a numeric string")
        try:
            index = int(goal_id)
        except ValueError as exc:
            raise ApiError(400, f"goal_id {goal_id!r} is not an integer") from exc
        if not 0 <= index < count:
            raise ApiError(400, f"goal_id {index} out of range 0..{count - 1}")
        return index

    # -- endpoints --------------------------------------------------------------------
    async def reset(self, request: Request) -> JSONResponse:
        data = await self.read_json(request)
        sid = self.session_id_of(data)
        await self.inject_faults()
        state = EpisodeState(goal=self.resolve_goal(data))
        session = self.store.get(sid) if sid else None
        if session is None:
            try:
                session = self.store.create(sid, state)
            except SessionLimitError as exc:
                raise ApiError(503, f"{exc}; DELETE /sessions/{{id}} or wait for idle expiry") from exc
        else:
            async with session.lock:
                session.state = state
        session.touch()
        info = self.env.reset_info(state)
        return JSONResponse(
            {
                "session_id": session.session_id,
                "observation": self.env.observe(state),
                "done": False,
                "reward": 0.0,
                "info": info,
            }
        )

    async def step(self, request: Request) -> Response:
        data = await self.read_json(request)
        sid = self.session_id_of(data)
        action = data.get("action")
        if sid is None or action is None:
            raise ApiError(400, "fields 'session_id' and 'action' are required")
        if not isinstance(action, str):
            raise ApiError(400, "action must be a string like 'search[red shoes]' or 'click[Buy Now]'")
        if len(action) > MAX_ACTION_CHARS:
            raise ApiError(413, f"action longer than {MAX_ACTION_CHARS} characters")
        session = self.store.get(sid)
        if session is None:
            raise ApiError(404, f"unknown or expired session {sid!r}; POST /reset to start one")
        await self.inject_faults()
        async with session.lock:
            was_done = session.state.done
            result = self.env.step(session.state, action)
            session.touch()
            purchased = result.done and not was_done
            if purchased:
                self.record_purchase(sid, session.state, result.reward, result.info)
        answer = {
            "session_id": sid,
            "observation": result.observation,
            "done": result.done,
            "reward": result.reward,
            "info": result.info,
        }
        if purchased and self.config.nan_reward_rate > 0 and self.faults.random() < self.config.nan_reward_rate:
            # Fault test: JSON has no NaN, but Python's json (and so httpx) reads one; Starlette refuses to write it.
            answer["reward"] = math.nan
            return Response(json.dumps(answer), media_type="application/json")
        return JSONResponse(answer)

    async def inject_faults(self) -> None:
        """Optional latency and failures, decided before the request touches any state."""
        config = self.config
        if config.latency_ms > 0:
            await asyncio.sleep(config.latency_ms / 1000.0)
        if config.error_rate <= 0 and config.timeout_rate <= 0:
            return
        draw = self.faults.random()
        if draw < config.error_rate:
            raise ApiError(503, "injected fault (--error-rate): nothing was applied, retry")
        if draw < config.error_rate + config.timeout_rate:
            await asyncio.sleep(config.stall_s)
            raise ApiError(503, "injected stall (--timeout-rate): nothing was applied, retry")

    def record_purchase(self, sid: str, state: EpisodeState, reward: float, info: dict[str, Any]) -> None:
        """Remember what each episode earned, so a client's reported reward can be audited."""
        self.ledger[sid + ":" + str(len(self.ledger))] = {
            "session_id": sid,
            "task_id": state.goal.task_id,
            "reward": reward,
            "purchased_asin": info.get("purchased_asin"),
            "time": time.time(),
        }
        logger.info("purchase session=%s task=%s reward=%s", sid, state.goal.task_id, reward)
        while len(self.ledger) > self.config.ledger_size:
            self.ledger.popitem(last=False)

    async def purchases(self, request: Request) -> JSONResponse:
        """GET /purchases[?session_id=...]: the rewards the server computed, oldest first."""
        sid = request.query_params.get("session_id")
        items = [p for p in self.ledger.values() if sid is None or p["session_id"] == sid]
        return JSONResponse({"items": items, "total": len(items)})

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "status": "ok",
                "sessions": len(self.store),
                "products": len(self.env.catalog),
                "goals": len(self.env.goals),
                "tasks": self.human_tasks,
                "noun_extractor": self.noun_extractor,
                "startup_s": round(self.startup_s, 3),
            }
        )

    async def delete_session(self, request: Request) -> JSONResponse:
        sid = request.path_params["session_id"]
        if not self.store.delete(sid):
            raise ApiError(404, f"unknown session {sid!r}")
        return JSONResponse({"session_id": sid, "deleted": True})

    async def purge_loop(self) -> None:
        """Drop idle sessions periodically so memory does not wait for the cap."""
        while True:
            await asyncio.sleep(PURGE_INTERVAL_S)
            self.store.purge_expired()


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return JSONResponse({"error": exc.message}, status_code=exc.status)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return JSONResponse({"error": exc.detail}, status_code=exc.status_code)


def create_app(config: ServerConfig | None = None) -> Starlette:
    """Build the environment (seconds) and return the ASGI app."""
    server = WebShopServer(config or ServerConfig())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(server.purge_loop())
        try:
            yield
        finally:
            task.cancel()

    routes = [
        Route("/reset", server.reset, methods=["POST"]),
        Route("/step", server.step, methods=["POST"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/purchases", server.purchases, methods=["GET"]),
        Route("/sessions/{session_id}", server.delete_session, methods=["DELETE"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={ApiError: _api_error, HTTPException: _http_error},
    )
    app.state.server = server
    return app
