"""What a 1.0 agent program gets (``workers.v1.environment``): the clean environment, the env_map deny rule,
AGL_V1_PASS_ENV, the agent module allowlist, the redaction of its output, and the dispatcher's key kept off
the command line (docs/agl-v1.md, "Trust model")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bridge import cli
from bridge.core.gateway import V1Rollout, agent_environment
from bridge.core.infra import ConfigError, InvalidInputError
from bridge.core.settings import Settings, load_settings
from workers.protocol.failures import FailureClass, classify
from workers.v1.environment import (
    ProgramRefused,
    denied_reason,
    output_redactor,
    program_environment,
)

GATEWAY = "http://gateway.test:8080"
WORKER_ENV = {
    "PATH": "/venv/bin:/usr/bin",
    "HOME": "/home/worker",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "TZ": "UTC",
    "TMPDIR": "/scratch",
    "VIRTUAL_ENV": "/venv",
    "CELERY_BROKER_URL": "redis://:broker-pass@redis.internal:6379/0",
    "REDIS_URL": "redis://:redis-pass@redis.internal:6379/1",
    "OPENAI_API_KEY": "sk-worker-openai",
    "AGENT_LIGHTNING_STORE_TOKEN": "store-token-123",
    "AGL_V1_KEY": "gateway-key-456",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-789",
    "WEBSHOP_URL": "http://webshop.internal:3000",
    "PYTHONPATH": "/srv/agents",
    "LD_LIBRARY_PATH": "/opt/cuda/lib64",
}


def _settings(**overrides: Any) -> Settings:
    base: dict[str, Any] = {
        "agl_v1_url": GATEWAY,
        "agl_v1_key": WORKER_ENV["AGL_V1_KEY"],
        "broker_url": WORKER_ENV["CELERY_BROKER_URL"],
        "redis_url": WORKER_ENV["REDIS_URL"],
        "openai_api_key": WORKER_ENV["OPENAI_API_KEY"],
        "store_token": WORKER_ENV["AGENT_LIGHTNING_STORE_TOKEN"],
    }
    return load_settings(**{**base, **overrides})


RELAY, TOKEN = "http://127.0.0.1:40123", "attempt-token"  # what workers.v1.relay gives the attempt


def _env(rollout: V1Rollout, settings: Settings) -> dict[str, str]:
    attempt = agent_environment(rollout, "0", agent_url=RELAY, key=TOKEN)
    return program_environment(rollout, settings, attempt=attempt, worker_env=WORKER_ENV)


def _rollout(env_map: dict[str, str] | None = None, agent_class: str = "myagents.qa:Agent") -> V1Rollout:
    local = {"agent_class": agent_class, "env_map": env_map or {"TASK": "input.question"}}
    return V1Rollout.model_validate({"rollout_id": "ro-1", "input": {"question": "2+2?"}, "config": {"local": local}})


def test_a_program_gets_the_base_names_its_attempt_and_its_env_map_and_nothing_else() -> None:
    env = _env(_rollout(), _settings())
    assert env == {
        "PATH": "/venv/bin:/usr/bin",
        "HOME": "/home/worker",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TZ": "UTC",
        "TMPDIR": "/scratch",
        "VIRTUAL_ENV": "/venv",
        "AGL_KEY": TOKEN,
        "AGL_OPENAI_BASE_URL": f"{RELAY}/proxy/rollout/ro-1/attempt/0/mode/train/openai/v1",
        "AGL_EVENT_URL": f"{RELAY}/api/rollouts/ro-1/attempt/0/events",
        "TASK": "2+2?",
    }


def test_the_operator_passes_more_names_with_agl_v1_pass_env() -> None:
    settings = _settings(agl_v1_pass_env="WEBSHOP_URL, PYTHONPATH,LD_LIBRARY_PATH,NOT_SET_HERE")
    env = _env(_rollout(), settings)
    assert env["WEBSHOP_URL"] == "http://webshop.internal:3000" and env["PYTHONPATH"] == "/srv/agents"
    assert env["LD_LIBRARY_PATH"] == "/opt/cuda/lib64" and "NOT_SET_HERE" not in env
    assert "REDIS_URL" not in env and "OPENAI_API_KEY" not in env


@pytest.mark.parametrize("value", ["AGL_V1_KEY", "agl_anything", "NOT A NAME", "A=B"])
def test_agl_v1_pass_env_refuses_the_workers_own_agl_names_and_non_names(value: str) -> None:
    with pytest.raises(ConfigError, match="AGL_V1_PASS_ENV"):
        _settings(agl_v1_pass_env=value)


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("AGL_EVENT_URL", "Agent Lightning"),
        ("AGL_KEY", "Agent Lightning"),
        ("agl_openai_base_url", "Agent Lightning"),
        ("LD_PRELOAD", "loader"),
        ("LD_LIBRARY_PATH", "loader"),
        ("DYLD_INSERT_LIBRARIES", "loader"),
        ("GCONV_PATH", "loader"),
        ("PYTHONPATH", "interpreter"),
        ("PYTHONSTARTUP", "interpreter"),
        ("PYTHONHOME", "interpreter"),
        ("NODE_OPTIONS", "interpreter"),
        ("PERL5OPT", "interpreter"),
        ("BASH_FUNC_ls%%", "not a variable name"),
        ("PATH", "the worker sets it"),
        ("HOME", "the worker sets it"),
        ("BROWSER", "program to run"),
        ("BASH_ENV", "program to run"),
        ("HTTPS_PROXY", "proxy"),
        ("http_proxy", "proxy"),
        ("NO_PROXY", "proxy"),
        ("SSL_CERT_FILE", "system variable"),
        ("REQUESTS_CA_BUNDLE", "trust"),
        ("LC_ALL", "system variable"),
        ("", "not a variable name"),
    ],
)
def test_env_map_may_not_name_what_the_deny_rule_names(name: str, why: str) -> None:
    reason = denied_reason(name)
    assert reason is not None and why in reason


@pytest.mark.parametrize("name", ["TASK", "WEBSHOP_TASK", "TASK_REWARD", "PID_FILE", "MY_PATH_HINT"])
def test_env_map_may_name_a_programs_own_variables(name: str) -> None:
    assert denied_reason(name) is None


def test_env_map_may_not_replace_what_the_operator_passes() -> None:
    assert "AGL_V1_PASS_ENV" in (denied_reason("WEBSHOP_URL", passed=frozenset({"WEBSHOP_URL"})) or "")


def test_a_denied_env_map_name_refuses_the_rollout_as_input_naming_the_variable() -> None:
    rollout = _rollout({"TASK": "input.question", "AGL_EVENT_URL": "http://attacker.example/steal"})
    with pytest.raises(ProgramRefused) as refused:
        _env(rollout, _settings())
    assert "AGL_EVENT_URL" in str(refused.value) and "env_map" in str(refused.value)
    assert classify(refused.value) == FailureClass.INPUT and isinstance(refused.value, InvalidInputError)
    assert isinstance(refused.value, ValueError)  # the attempt reports it failed without starting anything


def test_agent_modules_allow_their_modules_and_submodules_only() -> None:
    settings = _settings(agl_v1_agent_modules="myagents, workers.agents.")
    assert settings.agl_v1_agent_modules == ["myagents", "workers.agents"]
    for allowed in ("myagents:A", "myagents.qa:Agent", "myagents.qa.Agent", "workers.agents.webshop_program:P"):
        _env(_rollout(agent_class=allowed), settings)
    for refused in ("myagents_evil:A", "os:system", "workers:app", "subprocess.Popen"):
        with pytest.raises(ProgramRefused, match="AGL_V1_AGENT_MODULES"):
            _env(_rollout(agent_class=refused), settings)


def test_without_agent_modules_any_importable_class_runs_but_not_a_malformed_path() -> None:
    _env(_rollout(agent_class="anything.at:All"), _settings())
    for bad in ("", "NoModule", "os:system; rm", ".relative:A", "a:b:c"):
        with pytest.raises(ProgramRefused, match="not module:Class"):
            _env(_rollout(agent_class=bad), _settings())


def test_the_programs_output_loses_the_workers_secrets() -> None:
    redact = output_redactor(_settings(), worker_env=WORKER_ENV)
    leaked = (
        "broker redis://:broker-pass@redis.internal:6379/0 redis-pass sk-worker-openai store-token-123 "
        "gateway-key-456 aws-secret-789 Authorization: Bearer abc.def password=hunter22"
    )
    masked = redact(leaked)
    for secret in ("broker-pass", "redis-pass", "sk-worker-openai", "store-token-123", "gateway-key-456"):
        assert secret not in masked
    assert "aws-secret-789" not in masked and "abc.def" not in masked and "hunter22" not in masked
    assert "redis.internal:6379" in masked  # the rest stays readable
    assert redact('Traceback: File "/srv/agents/qa.py", line 3') == 'Traceback: File "/srv/agents/qa.py", line 3'


def test_the_dispatcher_refuses_a_key_on_its_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["v1", "--server", GATEWAY, "--key", "visible-in-ps"]) == 2
    err = capsys.readouterr().err
    assert "ps" in err and "AGL_V1_KEY" in err and "--key-file" in err


def test_the_dispatcher_reads_its_key_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Settings] = []

    def run_v1(settings: Settings, stop: object, **_: object) -> int:
        seen.append(settings)
        return 0

    monkeypatch.setattr("bridge.dispatch.v1.run_v1", run_v1)
    monkeypatch.setattr("bridge.dispatch.dispatcher.install_signal_handlers", lambda stop: None)
    key_file = tmp_path / "key"
    key_file.write_text("from-the-file\n")
    assert cli.main(["v1", "--server", GATEWAY, "--key-file", str(key_file)]) == 0
    assert seen[0].agl_v1_key == "from-the-file" and seen[0].agl_v1_url == GATEWAY
    assert cli.main(["v1", "--server", GATEWAY, "--key-file", str(tmp_path / "missing")]) == 2
