"""Per-process state lives in two modules, ``workers.lifecycle.state`` and ``bridge.core.infra.process_state``, and one
``reset`` (``process_state.reset``, which the workers' state registers with) clears every piece: each test below
sets a piece through the code that owns it, resets, and sees the piece as a fresh process has it.
``state.start_child()``, the prefork child hook's, keeps what the node set up for every process. A scan of every
package's source keeps new module-level state from appearing anywhere else, but for what ``ALLOWED`` lists with the
reason no reset clears it."""

from __future__ import annotations

import ast
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from bridge.core.infra import process_state, setup_process_tracing
from bridge.core.infra.tls import warn_if_insecure
from bridge.core.settings import get_settings, load_settings
from workers.agents import llm, loading
from workers.agents.ratelimit import _outage_for
from workers.lifecycle import metrics, state, stuck
from workers.lifecycle.drain import DrainClock
from workers.lifecycle.steps import advertising, expired, startup
from workers.protocol import clock

ROOT = Path(__file__).resolve().parents[2]
STATE_MODULES = {ROOT / "workers/lifecycle/state.py", ROOT / "bridge/core/infra/process_state.py"}
STORE = "http://store.test:4747"


def test_the_store_clock_offset_is_reset() -> None:
    clock.adopt(12.5)
    assert clock.to_local(100.0) == 87.5
    state.start_child()  # a prefork child inherits the node's offset
    assert clock.store_offset_s() == 12.5
    process_state.reset()
    assert clock.store_offset_s() == 0.0 and clock.to_local(100.0) == 100.0


def test_the_process_clients_and_caches_are_reset_and_a_child_builds_its_own() -> None:
    client = llm.shared_http(5.0)
    assert llm.shared_http(5.0) is client
    llm.llm_api_key("http://elsewhere.test/v1", None, load_settings(store_url=STORE, openai_api_key="sk-x"))
    assert state.process.withheld_endpoints
    state.process.litagent_runners[1] = object()
    pool = type("Pool", (), {})()  # a connection pool: weakly referenced by the outage kept for it
    outage = _outage_for(SimpleNamespace(connection_pool=pool))
    assert _outage_for(SimpleNamespace(connection_pool=pool)) is outage and pool in state.process.llm_outages
    state.process.drain_clock.node = "worker@host"
    try:
        state.start_child()
        assert llm.shared_http(5.0) is not client
        fresh = state.process
        assert not fresh.withheld_endpoints and not fresh.litagent_runners and not fresh.llm_outages
        assert fresh.drain_clock == DrainClock() and fresh.resources is None and fresh.configured_agent is None
        assert fresh.coordination is None and fresh.monitor is None
        assert _outage_for(SimpleNamespace(connection_pool=pool)) is not outage
    finally:
        client.close()
        if state.process.llm_http is not None:
            state.process.llm_http.close()


def test_the_configured_agent_is_built_again_after_a_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[object] = []

    def build(settings: object) -> SimpleNamespace:
        agent = SimpleNamespace(pid=os.getpid(), class_path="pkg:Agent", hooks=[])
        built.append(agent)
        return agent

    monkeypatch.setattr(loading, "build", build)
    settings = load_settings(store_url=STORE, agent="pkg:Agent")
    first = loading.configured_agent(settings)
    assert loading.configured_agent(settings) is first
    state.start_child()
    assert loading.configured_agent(settings) is not first and len(built) == 2


def test_the_node_state_is_kept_for_a_child_and_reset_for_a_test(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = load_settings(agl_v1_url="http://gateway.test:8080", agl_v1_warm_start=False)
    startup.start_node(SimpleNamespace(pool_cls="threads", concurrency=4), settings)
    node = state.node
    assert node.pool.threads and len(node.stuck_threads.on_change) == 1
    node.advertising = advertising.Advertising()
    node.exporter = metrics.Exporter(server="s", directory=Path("."))
    node.program_server_failed = "no interpreter"
    node.restarting.set()
    expired.expired_hand_back()
    state.start_child()
    assert state.node is node and node.hand_back is not None  # what the node set up for every process stays
    process_state.reset()
    fresh = state.node
    assert not fresh.pool.threads and fresh.pool == stuck.Pool() and fresh.stuck_threads.on_change == []
    assert fresh.advertising is None and fresh.exporter is None and fresh.program_server_failed is None
    assert not fresh.restarting.is_set() and fresh.hand_back is None


def test_the_metrics_exporter_is_held_in_the_node_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(metrics, "start_http_server", lambda *args, **kwargs: ("server", None))
    monkeypatch.setattr(metrics, "_export_zeros", lambda: None)
    monkeypatch.setattr(metrics.values, "ValueClass", metrics.values.ValueClass)
    assert metrics.serve(9, "127.0.0.1") == "http://127.0.0.1:9/metrics"
    assert state.node.exporter is not None and state.node.exporter.server == "server"
    process_state.reset()
    assert state.node.exporter is None


def test_the_core_state_is_reset(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    settings = load_settings(store_url=STORE, broker_url="rediss://broker.test:6380/0", broker_tls_insecure=True)
    with caplog.at_level(logging.WARNING, logger="bridge.tls"):
        warn_if_insecure(settings)
        warn_if_insecure(settings)
        assert caplog.text.count("WITHOUT TLS certificate") == 1
        process_state.reset()
        warn_if_insecure(settings)
        assert caplog.text.count("WITHOUT TLS certificate") == 2
    setup_process_tracing("unit")
    assert process_state.core.tracing_installed
    monkeypatch.setenv("BRIDGE_MAX_QUEUE_WAIT_S", "123")
    monkeypatch.setenv("AGENT_LIGHTNING_STORE_URL", STORE)
    process_state.reset()
    assert not process_state.core.tracing_installed and get_settings().max_queue_wait_s == 123
    monkeypatch.setenv("BRIDGE_MAX_QUEUE_WAIT_S", "124")
    process_state.reset()
    assert get_settings().max_queue_wait_s == 124


# Module-level state the scan finds and no reset may clear: the module and name, and why.
ALLOWED = {
    ("bridge/dispatch/metrics.py", "_exported"): "which lines' collectors the process-wide Prometheus registry "
    "holds: it lives as long as that registry, and cleared alone it would register them twice",
    ("webshop_env/nouns.py", "global _nlp, _backend"): "the WebShop server's tagger, loaded once (seconds) and "
    "the same for every caller: a cache, chosen at first use by WEBSHOP_NOUNS, that no test needs afresh",
}
PACKAGES = ("bridge", "workers", "bridge_lab", "webshop_env")


def _module_state(path: Path) -> list[tuple[str, int, str]]:
    """``global`` statements, and module-level lower-case names bound to a mutable container or an event: the
    module's path, the line and what was found."""
    found: list[tuple[str, int, str]] = []
    where = str(path.relative_to(ROOT))
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append((where, node.lineno, f"global {', '.join(node.names)}"))
    mutable_calls = {"dict", "set", "list", "defaultdict", "WeakKeyDictionary", "WeakValueDictionary", "Event"}
    for node in tree.body:
        target, value = None, None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        if not isinstance(target, ast.Name) or target.id.isupper() or target.id.startswith("__") or value is None:
            continue
        func = value.func if isinstance(value, ast.Call) else None
        called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if isinstance(value, (ast.Dict, ast.Set, ast.List)) or called in mutable_calls:
            found.append((where, node.lineno, target.id))
    return found


def test_no_module_of_any_package_keeps_state_of_its_own() -> None:
    paths = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    found = [entry for path in paths if path not in STATE_MODULES for entry in _module_state(path)]
    unexpected = [f"{where}:{line}: {what}" for where, line, what in found if (where, what) not in ALLOWED]
    assert unexpected == [], (
        "per-process state belongs in workers/lifecycle/state.py or bridge/core/infra/process_state.py"
    )
    assert {(where, what) for where, _, what in found} == set(ALLOWED), "an allowed entry is gone: drop it"
    assert _module_state(ROOT / "workers/lifecycle/state.py")  # the scan does see state where it is


def test_the_one_reset_starts_the_workers_state_afresh_too() -> None:
    """``bridge.core`` never imports the workers: their state registers its reset with the core's on import."""
    process, node = state.process, state.node
    process_state.reset()
    assert state.process is not process and state.node is not node
    assert process_state.resets.count(state.reset_all) == 1
