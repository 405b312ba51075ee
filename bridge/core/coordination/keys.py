"""Every Redis key this project uses, built from one prefix, so nothing collides with Celery's own keys.

Several deployments (each its own Store, bridge and workers) may share one Redis. Every key that holds one
deployment's state carries its *scope*, a digest of its Store's URL in canonical form (``store_scope``,
``canonical_endpoint``: ``http://localhost:4747/`` and ``http://127.0.0.1:4747`` are one scope; a 1.0-only
deployment's: of its gateway's, ``gateway_scope``; derived from settings in one place,
``bridge.core.coordination.connection.deployment_scope``): slot adverts and node listings, in-flight sets, slot-freed
wake-ups, the dispatch lines' demands, the leader lock, the held-rollouts record, worker agent adverts, the
fence board and shared resources. So each bridge leads its own deployment and counts only its own workers'
slots. Keys named by an attempt id (lease, owner, started, done, pending report) need no scope: attempt ids
are unique across Stores. The LLM rate limit (``ratelimit``) is shared on purpose: it budgets one model's
provider quota.
"""

from __future__ import annotations

import hashlib
import ipaddress
from urllib.parse import urlsplit

PREFIX = "agl"

LOOPBACK = "loopback"
"""The host of every canonical endpoint on this machine's loopback (``localhost``, ``127.0.0.0/8``, ``::1``)."""
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_API_SUFFIXES = ("/v1/agl",)  # the 0.3 Store's REST prefix: a URL given with it names the same Store


def canonical_endpoint(url: str) -> str:
    """One spelling of a Store's (or gateway's) URL, for the scope digest: ``scheme://host:port/path``.

    The scheme and host are lower-cased; every loopback alias (``localhost``, any ``127.x.y.z``, ``::1``,
    ``0.0.0.0``) is ``loopback``; the scheme's default port is written out; credentials, query, fragment,
    trailing slashes and the Store's ``/v1/agl`` suffix are dropped. Spellings it cannot prove equal
    (``store`` inside compose, ``localhost`` on the host) stay apart: ``bridge.core.coordination.scope_check`` tells
    the user about those at run time."""
    text = url.strip()
    parts = urlsplit(text if "://" in text else "http://" + text)
    scheme = parts.scheme.lower() or "http"
    host = (parts.hostname or "").lower().rstrip(".")
    if _is_loopback(host):
        host = LOOPBACK
    elif ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port or _DEFAULT_PORTS.get(scheme)
    except ValueError:  # not a number: keep the text, so the digest is still stable
        port = None
    path = parts.path.rstrip("/")
    for suffix in _API_SUFFIXES:
        if path.endswith(suffix):
            path = path[: -len(suffix)].rstrip("/")
    return f"{scheme}://{host}" + (f":{port}" if port else "") + path


def _is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def store_scope(store_url: str) -> str:
    """A short digest of a Store's URL in canonical form (``canonical_endpoint``): keys that hold one Store's
    data carry it, so clusters sharing a Redis never read each other's, and every spelling of one local
    Store is one scope."""
    return hashlib.sha256(canonical_endpoint(store_url).encode()).hexdigest()[:12]


def gateway_scope(gateway_url: str) -> str:
    """The scope of a 1.0-only deployment (no Store): ``v1-`` and a short digest of its gateway's URL."""
    return "v1-" + store_scope(gateway_url)


def capacity(scope: str, queue: str, worker: str) -> str:
    """Execution slots one worker offers on one queue of one deployment (expiring; refreshed while it lives)."""
    return f"{PREFIX}:capacity:{scope}:{queue}:{worker}"


def capacity_nodes(scope: str, queue: str) -> str:
    """Sorted set of the worker nodes that advertised slots on ``queue`` (score: when, on the node's clock).

    The bridge reads it every tick instead of scanning for ``capacity`` keys: a SCAN walks the whole
    keyspace, which long runs fill with per-attempt markers (docs/performance.md). The slot keys still
    decide which nodes are alive; this only says where to look."""
    return f"{PREFIX}:nodes:{scope}:{queue}"


def worker_capacity_pattern(scope: str, worker: str) -> str:
    """Every queue's slot key of one worker node: it has started once one exists (``bridge_lab.stack``)."""
    return f"{PREFIX}:capacity:{scope}:*:{worker}"


def worker_drain(scope: str, worker: str) -> str:
    """When a shutting-down worker node's running episodes must stop (epoch s; ``workers.lifecycle.drain``): its pool
    children, which never see the main process's signal, read it."""
    return f"{PREFIX}:drain:{scope}:{worker}"


def inflight(scope: str, queue: str) -> str:
    """Sorted set of attempt ids published to ``queue`` and not yet finished (score: publish time)."""
    return f"{PREFIX}:inflight:{scope}:{queue}"


def slot_freed(scope: str, queue: str, line: str = "v03") -> str:
    """Wake-up list of one dispatch line (``bridge.core.coordination.slot_share``): a worker pushes to every line's when
    a task frees a slot, and that line's full dispatcher blocks on its own (BLPOP), so each line hears every freed
    slot."""
    base = f"{PREFIX}:slot-freed:{scope}:{queue}"
    return base if line == "v03" else f"{base}:{line}"


def lease(attempt_id: str) -> str:
    """Who is executing an attempt right now (expiring, renewed by the heartbeat)."""
    return f"{PREFIX}:lease:{attempt_id}"


def owner(attempt_id: str) -> str:
    """The token of the executor that claimed an attempt last (epoch-prefixed; outlives the lease).

    A renewal succeeds only for this owner, so an executor whose lease lapsed and was taken over can
    never take the attempt back (``workers.protocol.lease``).
    """
    return f"{PREFIX}:owner:{attempt_id}"


def started(attempt_id: str) -> str:
    """Set by the first executor to start an attempt: a later one is a takeover and reads the Store first."""
    return f"{PREFIX}:started:{attempt_id}"


def ran(attempt_id: str) -> str:
    """Set by an executor, under its live lease, right before its agent begins: from then on the agent's writes may
    reach the Store or the gateway at any time, so a later claim fails the attempt instead of running it again."""
    return f"{PREFIX}:ran:{attempt_id}"


def done(attempt_id: str) -> str:
    """Set once an attempt's final status was reported, so a redelivery never runs it again."""
    return f"{PREFIX}:done:{attempt_id}"


def pending_report(attempt_id: str) -> str:
    """The final report of an attempt whose episode has run, kept until the Store accepted it.

    A retry or redelivery of the task delivers exactly this report instead of judging the attempt again
    (``workers.protocol.reporting``); it expires some minutes after the attempt's deadline.
    """
    return f"{PREFIX}:report:{attempt_id}"


def bridge_held(scope: str) -> str:
    """Hash: queue -> rollouts the leading bridge holds for it, and ``unserved`` (queues nobody consumes)."""
    return f"{PREFIX}:bridge:{scope}:held"


def bridge_leader(scope: str) -> str:
    """Held by the one bridge of a deployment that dispatches; its others wait, so two never double-publish.

    Scoped: the bridges of two deployments sharing a Redis each lead their own."""
    return f"{PREFIX}:bridge:{scope}:leader"


def ratelimit(model: str) -> str:
    """Token bucket for one LLM model, shared by every worker on every host.

    Deliberately not scoped by deployment: the budget it enforces is the model endpoint's quota (``LLM_RPM``,
    ``LLM_TPM``, ``LLM_RATE_LIMITS``), which every deployment calling that model through this Redis spends
    together; a bucket per deployment would let each of them use the whole quota. Deployments sharing it should
    configure the same limits for the model."""
    return f"{PREFIX}:ratelimit:{model}"


def worker_agent(scope: str, worker: str) -> str:
    """The agent a worker node runs (its class path, or ``webshop``), refreshed with its slot advertisement.

    ``CeleryRunner.init`` reads it to tell which online workers run another agent than the trainer's.
    """
    return f"{PREFIX}:agent:{scope}:{worker}"


def worker_isolation(scope: str, worker: str) -> str:
    """How a worker node contains its 1.0 agent programs (``workers.v1.box.node_isolation``), refreshed with its slot
    advertisement; absent for a node that runs no 1.0 programs. ``python -m bridge status`` shows it."""
    return f"{PREFIX}:isolation:{scope}:{worker}"


def scope_endpoint(scope: str) -> str:
    """The URL (redacted) whose digest a deployment's workers use as their scope, refreshed with their slot
    adverts: a process of another scope reads it to name both URLs when it suspects one Store under two
    spellings (``bridge.core.coordination.scope_check``)."""
    return f"{PREFIX}:endpoint:{scope}"


def worker_stuck(scope: str, worker: str) -> str:
    """How many abandoned agent threads a worker node holds (``workers.lifecycle.stuck``), refreshed with its slot
    advertisement and absent while it holds none; ``python -m bridge status`` shows it."""
    return f"{PREFIX}:stuck:{scope}:{worker}"


def v1_result(attempt_key: str) -> str:
    """An Agent Lightning 1.0 attempt's outcome, kept by its worker until the gateway has it; the 1.0 dispatcher
    applies what a worker could not send (``bridge.dispatch.v1``)."""
    return f"{PREFIX}:v1:result:{attempt_key}"


def v1_handovers(scope: str, rollout_id: str) -> str:
    """Set: the attempt ids of a 1.0 rollout that draining workers handed over, which count against no re-run
    limit (``bridge.dispatch.v1``); it expires with the done markers."""
    return f"{PREFIX}:v1:handovers:{scope}:{rollout_id}"


def fence_listing(scope: str) -> str:
    """Sorted set of the attempts running on any worker of one Store (``rollout_id attempt_id``; score: lapse time).

    ``scope`` is a digest of the Store's URL, so two clusters sharing a Redis never fence each other's attempts
    (``workers.protocol.fence_board``)."""
    return f"{PREFIX}:fence:{scope}:listing"


def fence_round(scope: str) -> str:
    """Held by the worker process reading every listed attempt's rollout this round (expires within an interval)."""
    return f"{PREFIX}:fence:{scope}:round"


def fence_verdict(scope: str, attempt_id: str) -> str:
    """What the latest round's read said of one attempt: ``<read time on the Store's clock> <stop reason>``."""
    return f"{PREFIX}:fence:{scope}:verdict:{attempt_id}"


def shared_resources(scope: str, resources_id: str) -> str:
    """A resources update as one worker fetched it from the Store, for the other processes until its TTL ends."""
    return f"{PREFIX}:resources:{scope}:{resources_id}"


def slot_demand(scope: str, queue: str, line: str) -> str:
    """One dispatch line's demand on ``queue`` (``<waiting> <weight>``), written by its leader every tick and
    expiring soon after it stops (``bridge.core.coordination.slot_share``): the other line reads it to leave that line
    its share."""
    return f"{PREFIX}:share:{scope}:{queue}:{line}"


def slot_usage(scope: str, queue: str) -> str:
    """The dispatch lines' decayed slot-seconds on ``queue`` while both had rollouts waiting, the queue's work and
    starts, and when they were last advanced (a hash, ``bridge.core.coordination.slot_share``)."""
    return f"{PREFIX}:share-usage:{scope}:{queue}"


def line_backlog(scope: str, queue: str, line: str) -> str:
    """One dispatch line's backlog on ``queue`` (rollouts waiting at its source and held by its dispatcher), written
    by its leader about every second and expiring soon after it stops (``bridge.core.coordination.line_demand``): the
    other line's leader adds it to the queue's desired slots."""
    return f"{PREFIX}:backlog:{scope}:{queue}:{line}"
