"""``CeleryRunner``: Agent Lightning's ``Runner`` contract with every rollout executed by the Celery workers.

An Agent Lightning user moves their trainer onto the cluster with one line::

    agl.Trainer(runner=CeleryRunner(), n_runners=1, ...).fit(MyAgent(), train_dataset=...)

while the workers run the same agent (``AGENT=my_package.agents:MyAgent celery -A workers worker``).
The runner never executes the agent itself; what each method means here:

* ``init(agent, hooks=)``: remembers the agent's import path (``module:Class``), which every message names so
  a worker running another agent refuses it, and fails at once when online workers advertise another one
  (``AgentMismatchError``, naming them). Hooks run on the workers (``AGENT_HOOKS``), not here.
* ``init_worker(worker_id, store)``: takes the Store's URL from the ``LightningStoreClient`` (or server) it is
  given, else ``AGENT_LIGHTNING_STORE_URL``; the workers must report to that same Store.
* ``iter(event=)``: the bridge's dispatch loop, the very code of ``python -m bridge``
  (``bridge.dispatch.v03.dispatch_until``), until the event is set; it then finishes the publish in
  hand and returns. With ``n_runners > 1`` (or a ``python -m bridge`` beside it) the bridge's leader lock
  lets one dispatch while the others stand by.
* ``step(input, resources=, mode=)``: publishes ``resources`` first when given, creates the rollout with its
  attempt started, publishes it at once (``bridge.runner_support.direct``), waits and returns the Store's
  ``Rollout``; a rollout that did not succeed raises ``RolloutFailedError`` with the worker's error and
  failure class. A rollout the Store puts back in its queue is waited for only while a dispatch loop runs to
  retry it; with none, ``step`` raises at once (status ``requeuing``), as Agent Lightning's one-attempt
  ``step`` does. ``run_context`` (inherited) makes it usable from scripts and notebooks.

Settings come from the environment like everywhere in the project: the groups a dispatcher reads
(``bridge.core.settings.DispatcherSettings``); keyword arguments to the constructor override them
(``CeleryRunner(broker_url=...)``). The constructor opens no socket and starts no thread: a Trainer forks (or
pickles) the runner into its runner processes, which create their clients lazily.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, overload

import redis
from agentlightning import LitAgent, Runner
from agentlightning.execution.events import ExecutionEvent
from agentlightning.types import Hook, NamedResources, Rollout, RolloutMode
from pydantic import TypeAdapter

from bridge.core.coordination import coordination_redis, deployment_scope
from bridge.core.settings import DispatcherSettings, load_settings
from bridge.core.store import API, RolloutStatus, StoreClient
from bridge.dispatch.leader import dispatching
from bridge.dispatch.publisher import Publisher
from bridge.dispatch.v03 import V03Dispatcher, dispatch_until
from bridge.runner_support import direct
from bridge.runner_support.direct import RolloutFailedError
from bridge.runner_support.fleet import AgentMismatchError, agent_path, check_fleet
from bridge.runner_support.stop import EitherEvent

__all__ = ["AgentMismatchError", "CeleryRunner", "RolloutFailedError"]

log = logging.getLogger("bridge.runner")

DEFAULT_STORE_URL = "http://localhost:4747"
"""Agent Lightning's default server address, used only until ``init_worker`` names the Store."""


class CeleryRunner(Runner[Any]):
    """A ``agentlightning.Runner`` whose rollouts the Celery workers execute (see the module docstring)."""

    def __init__(self, **settings_overrides: Any) -> None:
        super().__init__()
        self.worker_id: int | None = None
        self._overrides = dict(settings_overrides)
        self._agent: str | None = None
        self._settings: DispatcherSettings | None = None
        self._lock = threading.Lock()
        # Created on first use in the process that uses them, closed by teardown_worker.
        self._store: StoreClient | None = None
        self._redis: redis.Redis | None = None
        self._dispatcher: V03Dispatcher | None = None

    @property
    def settings(self) -> DispatcherSettings | None:
        """The settings ``init_worker`` loaded for the Store it was given (None before)."""
        return self._settings

    @property
    def agent(self) -> str | None:
        """The import path of the agent ``init`` was given, which the workers must run (None before and after
        ``teardown``)."""
        return self._agent

    # --- pickling: a Trainer under the spawn start method sends the runner to its processes ---------

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_lock=None, _store=None, _redis=None, _dispatcher=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # --- lifecycle ---------------------------------------------------------------------------------

    def init(self, agent: LitAgent[Any], *, hooks: Any = None, **kwargs: Any) -> None:
        """Remember the agent's path and check that the online workers run the same agent."""
        self._agent = agent_path(agent)
        given: list[Hook] = list(hooks or [])
        if given:
            paths = ",".join(f"{type(h).__module__}:{type(h).__qualname__}" for h in given)
            log.warning(
                "hooks run on the workers, not in CeleryRunner: configure them there with AGENT_HOOKS=%s", paths
            )
        known = self._settings or self._load(None, fallback=False)
        settings = known or self._load(None)
        client = coordination_redis(settings)
        try:
            # Until init_worker names the Store (or AGENT_LIGHTNING_STORE_URL does), its workers' key scope is
            # unknown: then the workers of every Store on these queues are checked.
            scope = deployment_scope(known) if known is not None else None
            check_fleet(client, scope, settings.all_queues(), self._agent)
        except redis.RedisError as exc:
            log.warning("could not read the workers' agents from the broker (%r); not checked", exc)
        finally:
            client.close()

    def init_worker(self, worker_id: int, store: Any = None, **kwargs: Any) -> None:
        """Bind this runner process to the Store the Trainer gives (its URL) and the broker of the settings."""
        self.worker_id = worker_id
        url = store_url_of(store)
        if url is None and store is not None:
            configured = self._load(None, fallback=False)
            if configured is None:
                raise TypeError(
                    f"CeleryRunner needs a Store the workers reach over HTTP, got {type(store).__name__}: run "
                    "`agl store` (or let the Trainer serve its Store) and give a LightningStoreClient, or set "
                    "AGENT_LIGHTNING_STORE_URL"
                )
            log.warning(
                "the %s given cannot be reached by the workers; using AGENT_LIGHTNING_STORE_URL=%s",
                type(store).__name__,
                configured.store_base,
            )
        self._settings = self._load(url)
        log.info(
            "CeleryRunner %s: Store %s, broker queues %s, agent %s",
            worker_id,
            self._settings.store_base,
            ", ".join(self._settings.all_queues()),
            self._agent,
        )

    def teardown_worker(self, worker_id: int, *args: Any, **kwargs: Any) -> None:
        """Close the clients this process opened."""
        with self._lock:
            if self._store is not None:
                self._store.close()
            if self._redis is not None:
                self._redis.close()
            if self._dispatcher is not None:
                self._dispatcher.publisher.close()
            self._store, self._redis, self._dispatcher = None, None, None
        self.worker_id = None

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        self._agent = None

    # --- work --------------------------------------------------------------------------------------

    async def iter(self, *, event: ExecutionEvent | None = None) -> None:
        """The bridge's dispatch loop until ``event`` is set (or this coroutine is cancelled)."""
        settings, agent = self._ready()
        stop = EitherEvent(event)
        try:
            await asyncio.to_thread(dispatch_until, settings, stop, agent=agent, strict_scope=True)
        finally:
            stop.set()  # a cancelled await leaves the thread running: this ends it

    async def step(
        self,
        input: Any,
        *,
        resources: NamedResources | None = None,
        mode: RolloutMode | None = None,
        event: ExecutionEvent | None = None,
    ) -> Rollout:
        """Execute one task on the cluster now and return the completed rollout; raise when it did not succeed.

        ``event`` is accepted for the contract's sake: the rollout in hand is always waited for.
        """
        return await asyncio.to_thread(self._step, input, resources, mode)

    def _step(self, task: Any, resources: NamedResources | None, mode: RolloutMode | None) -> Rollout:
        settings, _ = self._ready()
        store, coordination, dispatcher = self._direct()
        direct.wait_for_room(dispatcher, mode)
        resources_id = None
        if resources is not None:
            resources_id = direct.add_resources(store, TypeAdapter(NamedResources).dump_python(resources, mode="json"))
        started = direct.start_rollout(store, settings, task, mode=mode, resources_id=resources_id)
        log.info(
            "[rollout=%s attempt=%s] step: executing on the cluster", started.rollout_id, started.attempt.attempt_id
        )
        direct.publish(dispatcher, started)
        alive = dispatcher.scope
        final = direct.wait_finished(store, settings, started, dispatching=lambda: _loop_alive(coordination, alive))
        if final.status != RolloutStatus.SUCCEEDED:
            raise direct.failure(store, final)
        return Rollout.model_validate(final.model_dump(mode="json"))

    # --- helpers -----------------------------------------------------------------------------------

    def _ready(self) -> tuple[DispatcherSettings, str]:
        if self._agent is None:
            raise RuntimeError("CeleryRunner.init(agent) must be called first (a Trainer or run_context does)")
        if self._settings is None:
            raise RuntimeError("CeleryRunner.init_worker(worker_id, store) must be called first")
        return self._settings, self._agent

    def _direct(self) -> tuple[StoreClient, redis.Redis, V03Dispatcher]:
        """This process's Store client, coordination Redis and a V03Dispatcher for direct publishing (created
        once, thread-safe)."""
        settings, agent = self._ready()
        with self._lock:
            if self._store is None or self._redis is None or self._dispatcher is None:
                self._store = StoreClient.from_settings(settings)
                self._redis = coordination_redis(settings)
                publisher = Publisher(settings, agent=agent)
                self._dispatcher = V03Dispatcher(settings, self._store, self._redis, publisher, strict_scope=True)
            return self._store, self._redis, self._dispatcher

    @overload
    def _load(self, store_url: str | None) -> DispatcherSettings: ...
    @overload
    def _load(self, store_url: str | None, *, fallback: bool) -> DispatcherSettings | None: ...

    def _load(self, store_url: str | None, *, fallback: bool = True) -> DispatcherSettings | None:
        """A dispatcher's settings from the environment and the constructor's overrides; the Store's URL from the caller
        when known, else the environment, else (``fallback``) Agent Lightning's default address, else None."""
        overrides = dict(self._overrides)
        if store_url is not None:
            overrides["store_url"] = store_url
        settings = load_settings(DispatcherSettings, **overrides)
        if settings.store_url is not None:
            return settings
        return load_settings(DispatcherSettings, **overrides, store_url=DEFAULT_STORE_URL) if fallback else None


def _loop_alive(coordination: redis.Redis, scope: str) -> bool:
    """Whether a dispatch loop of this deployment (``scope``) will retry a requeued rollout; an unreachable
    Redis counts as yes, so step keeps waiting (bounded by the rollout's budget) rather than failing on a
    coordination hiccup."""
    try:
        return dispatching(coordination, scope)
    except redis.RedisError as exc:
        log.warning("could not read the dispatch lock (%r); waiting for the rollout as if a loop ran", exc)
        return True


def store_url_of(store: Any) -> str | None:
    """The HTTP root of an Agent Lightning Store object: a ``LightningStoreClient``'s server address, a
    ``LightningStoreServer``'s endpoint; None for a store the workers cannot reach (in-memory, ...)."""
    root = getattr(store, "server_address_root", None)
    if isinstance(root, str) and root:
        return root.rstrip("/")
    address = getattr(store, "server_address", None)
    if isinstance(address, str) and address:
        return address.rstrip("/").removesuffix(API)
    endpoint = getattr(store, "endpoint", None)
    if isinstance(endpoint, str) and endpoint.startswith("http"):
        return endpoint.rstrip("/")
    return None
