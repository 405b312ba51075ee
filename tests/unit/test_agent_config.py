"""Which agent a worker runs: AGENT/AGENT_HOOKS/AGENT_TRACER settings, the message's expected agent, the
loader's start-up errors and the identity check. No process is started and ``agentlightning`` is not
imported here (the loader's paths that need it run in tests/integration/test_litagent*.py)."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from bridge.core.coordination import keys
from bridge.core.infra import ConfigError
from bridge.core.settings import load_settings
from bridge.core.store import AttemptedRollout
from bridge.core.task import DEFAULT_AGENT, task_kwargs
from workers.agents import loading
from workers.protocol.failures import AgentError, FailureClass, classify

STORE = "http://127.0.0.1:4747"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    for name in list(os.environ):
        if name.startswith(("AGENT", "CELERY_", "BRIDGE_", "WEBSHOP_", "OPENAI_")):
            monkeypatch.delenv(name)
    monkeypatch.chdir(str(tmp_path))  # no stray .env
    monkeypatch.setenv("AGENT_LIGHTNING_STORE_URL", STORE)


def test_defaults_are_the_builtin_agent_with_otel_capture(clean_env: None) -> None:
    settings = load_settings()
    assert settings.agent == "webshop" and settings.agent_hooks == [] and settings.agent_tracer == "otel"


def test_agent_hooks_and_tracer_are_read_from_the_environment(clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT", " my_pkg.agents:CalcAgent ")
    monkeypatch.setenv("AGENT_HOOKS", "my_pkg.hooks:A, my_pkg.hooks:Outer.Inner,")
    monkeypatch.setenv("AGENT_TRACER", "none")
    settings = load_settings()
    assert settings.agent == "my_pkg.agents:CalcAgent"
    assert settings.agent_hooks == ["my_pkg.hooks:A", "my_pkg.hooks:Outer.Inner"]
    assert settings.agent_tracer == "none"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("AGENT", "my_pkg.agents.CalcAgent"),
        ("AGENT", "webshop2"),
        ("AGENT_HOOKS", "ok:A,not a path"),
        ("AGENT_TRACER", "weave"),
    ],
)
def test_bad_agent_settings_name_their_variable(
    clean_env: None, monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert info.value.setting == variable and variable in info.value.message


def _rollout() -> AttemptedRollout:
    return AttemptedRollout.model_validate(
        {
            "rollout_id": "ro-1",
            "input": {"question": "q"},
            "status": "preparing",
            "attempt": {"rollout_id": "ro-1", "attempt_id": "at-1", "sequence_id": 1, "status": "preparing"},
        }
    )


def test_the_message_names_the_expected_agent_and_defaults_to_webshop() -> None:
    assert task_kwargs(_rollout(), "rollouts")["agent"] == DEFAULT_AGENT == "webshop"
    kwargs = task_kwargs(_rollout(), "rollouts", "pkg.mod:Agent")
    assert kwargs["agent"] == "pkg.mod:Agent" and kwargs["queue"] == "rollouts"
    assert kwargs["rollout"]["attempt"]["attempt_id"] == "at-1"


def test_worker_agent_key_is_per_node_and_deployment_under_the_prefix() -> None:
    assert keys.worker_agent("0123abcd", "worker1@host") == "agl:agent:0123abcd:worker1@host"


def test_missing_agentlightning_is_a_start_up_error_naming_the_extra(
    clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "agentlightning", None)  # `import agentlightning` now raises ImportError
    monkeypatch.setenv("AGENT", "tests.agents_for_tests:FloatAgent")
    with pytest.raises(ConfigError) as info:
        loading.build(load_settings())
    assert "pip install -e '.[agl]'" in info.value.message and "agentlightning" in info.value.message


def test_the_builtin_agent_needs_no_agentlightning(clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "agentlightning", None)
    settings = load_settings()
    assert loading.configured_agent(settings) is None
    assert loading.advertised_agent(settings) == "webshop"


def test_import_path_errors_say_what_failed() -> None:
    with pytest.raises(ConfigError, match="cannot import 'no_such_module_x'"):
        loading.import_path("no_such_module_x:A")
    with pytest.raises(ConfigError, match="has no attribute 'Missing'"):
        loading.import_path("bridge.core.coordination.keys:Missing")
    assert loading.import_path("bridge.core.coordination.keys:worker_agent") is keys.worker_agent


class _Agent:
    """Stands in for a built LitAgent: identity checks compare strings only."""


def test_a_worker_accepts_its_configured_path_or_the_class_path_and_nothing_else() -> None:
    configured = loading.ConfiguredAgent("pkg.agents:make_agent", _Agent())
    assert configured.class_path == f"{__name__}:_Agent"
    assert configured.accepts("pkg.agents:make_agent")
    assert configured.accepts(f"{__name__}:_Agent")
    assert not configured.accepts("webshop")
    assert not configured.accepts(None)  # an old message expects the built-in agent
    assert not configured.accepts("pkg.agents:Other")


def test_agent_errors_have_their_own_failure_class() -> None:
    assert FailureClass.AGENT == "agent"
    assert classify(AgentError("the agent raised ValueError: boom")) is FailureClass.AGENT


def test_a_decorated_function_agent_is_named_by_its_function_on_both_sides() -> None:
    """CeleryRunner and the worker compute the same identity, and it is the function's, not the wrapper's."""
    from bridge.runner_support.fleet import agent_path
    from tests import agents_for_tests
    from workers.agents.loading import class_path

    expected = "tests.agents_for_tests:decorated_agent"
    assert agent_path(agents_for_tests.decorated_agent) == expected
    assert class_path(agents_for_tests.decorated_agent) == expected
    assert agent_path(agents_for_tests.FloatAgent()) == "tests.agents_for_tests:FloatAgent"


@pytest.mark.parametrize(
    ("pool", "concurrency", "refused"),
    [("prefork", 8, False), ("solo", 1, False), ("threads", 1, False), ("threads", 16, True), ("gevent", 4, True)],
)
def test_agentops_tracer_needs_one_attempt_per_process(pool: str, concurrency: int, refused: bool) -> None:
    """AgentOps holds one trace per process: several attempts in one process would swap spans."""
    settings = load_settings(store_url=STORE, agent="pkg.mod:Agent", agent_tracer="agentops")
    if refused:
        with pytest.raises(ConfigError, match=f"the {pool} pool runs {concurrency} attempts in one process"):
            loading.check_tracer_pool(settings, pool, concurrency)
    else:
        loading.check_tracer_pool(settings, pool, concurrency)
    for other in (load_settings(store_url=STORE, agent="pkg.mod:Agent"), load_settings(store_url=STORE)):
        loading.check_tracer_pool(other, pool, concurrency)  # otel, or the built-in agent: any pool


def test_the_pool_name_is_read_before_celery_resolves_it() -> None:
    from celery.concurrency import prefork, solo, thread

    from workers.lifecycle.steps.startup import pool_name

    class Worker:
        def __init__(self, pool: object) -> None:
            self.pool_cls = pool

    names = [pool_name(Worker(p)) for p in ("threads", "processes", prefork.TaskPool, solo.TaskPool, thread.TaskPool)]
    assert names == ["threads", "prefork", "prefork", "solo", "threads"]


def test_a_config_error_at_worker_start_exits_with_code_2_and_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Celery logs and ignores an ordinary exception from a signal handler: worker_init turns it into an exit."""
    from workers.lifecycle.steps import startup

    settings = load_settings(store_url=STORE, agent="pkg.mod:Agent", agent_tracer="agentops")
    with pytest.raises(SystemExit) as exited:
        startup.start_node(SimpleNamespace(pool_cls="threads", concurrency=4), settings)
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith("error: AGENT_TRACER=agentops traces one attempt per process")
