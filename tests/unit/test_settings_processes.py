"""Settings per process: each process validates the groups it reads, so a bad value of another process's
group does not stop it, one of a group both read stops both; and every variable is read under its name, by the
processes whose groups hold it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bridge import cli
from bridge.core.infra import ConfigError, process_state
from bridge.core.settings import (
    GROUPS,
    DispatcherSettings,
    Settings,
    SettingsGroup,
    WorkerSettings,
    env_name,
    get_settings,
    load_settings,
)
from workers.lifecycle import health

VARIABLES = (
    "AGENT", "AGENT_HOOKS", "AGENT_LIGHTNING_OTLP_ENDPOINT", "AGENT_LIGHTNING_SERVICE_NAME",
    "AGENT_LIGHTNING_STORE_TOKEN", "AGENT_LIGHTNING_STORE_URL", "AGENT_TRACER", "AGL_V1_AGENT_MODULES",
    "AGL_V1_AGENT_PYTHON", "AGL_V1_ISOLATION", "AGL_V1_KEY", "AGL_V1_MAX_RERUNS", "AGL_V1_PASS_ENV",
    "AGL_V1_PRELOAD", "AGL_V1_PRELOAD_AGENTS", "AGL_V1_PROGRAM_CPU_S", "AGL_V1_PROGRAM_DISK_MB",
    "AGL_V1_PROGRAM_MAX_FILE_MB", "AGL_V1_PROGRAM_MAX_OPEN_FILES", "AGL_V1_PROGRAM_MAX_PROCESSES",
    "AGL_V1_PROGRAM_MEMORY_MB", "AGL_V1_PROGRAM_PID_NAMESPACE", "AGL_V1_PROGRAM_UID_BASE",
    "AGL_V1_PUBLISH_GIVE_UP_S", "AGL_V1_SERVER_URL", "AGL_V1_WARM_START", "BRIDGE_BACKLOG_INTERVAL_S",
    "BRIDGE_BACKLOG_LIST_LIMIT", "BRIDGE_COALESCE_MAX_S", "BRIDGE_DISPATCHER_ID", "BRIDGE_MAX_BATCH",
    "BRIDGE_MAX_HELD", "BRIDGE_MAX_QUEUE_WAIT_S", "BRIDGE_METRICS_PORT", "BRIDGE_POLL_MAX_S", "BRIDGE_POLL_MIN_S",
    "BRIDGE_PUBLISH_RETRIES", "BRIDGE_RECONCILE_INTERVAL_S", "BROKER_CONSUMER_TIMEOUT_S", "BROKER_TLS_INSECURE",
    "BROKER_VISIBILITY_TIMEOUT_S", "CELERY_BROKER_URL", "CELERY_DEFAULT_QUEUE", "CELERY_TASK_EVENTS",
    "CLOCK_SKEW_TOLERANCE_S", "DONE_MARKER_TTL_S", "FENCE_BOARD", "FENCE_MAX_AGE_S", "HEARTBEAT_INTERVAL_S",
    "LEASE_TTL_S", "LLM_KEY_HOSTS", "LLM_MAX_BACKOFF_S", "LLM_RATE_BURST_S", "LLM_RATE_LIMITS", "LLM_RETRIES",
    "LLM_RETURN_TOKEN_IDS", "LLM_RPM", "LLM_TIMEOUT_S", "LLM_TPM", "LOG_JSON", "LOG_LEVEL", "MAX_INSTRUCTION_CHARS",
    "MAX_REPROMPTS", "MAX_STEPS", "MAX_STUCK_AGENT_THREADS", "METRICS_HOST", "OPENAI_API_BASE", "OPENAI_API_KEY",
    "QUEUE_BY_MODE", "QUEUE_TYPE", "REDIS_KEY_SCOPE", "REDIS_URL", "ROLLOUT_DEFAULT_TIMEOUT_S", "SLOT_SHARE_WEIGHTS",
    "SPAN_BUFFER_MAX_SPANS", "SPAN_FLUSH_INTERVAL_S", "SPAN_GATHER_MAX_S", "STORE_RETRIES", "STORE_TIMEOUT_S",
    "TRACE_CONTENT", "WEBSHOP_MODEL", "WEBSHOP_RETRIES", "WEBSHOP_TIMEOUT_S", "WEBSHOP_TOKEN", "WEBSHOP_URL",
    "WORKER_METRICS_PORT", "WORKER_SHUTDOWN_GRACE_S",
)  # fmt: skip
"""Every variable of the settings, by the name users set: none may be renamed or dropped."""

PROCESS_CLASSES: tuple[type[SettingsGroup], ...] = (DispatcherSettings, WorkerSettings, Settings)

WORKER_ONLY = [
    ("MAX_STEPS", "0"),
    ("AGENT_HOOKS", "not an import path"),
    ("AGL_V1_PROGRAM_MEMORY_MB", "1"),
    ("LLM_RATE_LIMITS", "gpt-4o-mini=fast"),
    ("WORKER_SHUTDOWN_GRACE_S", "1"),
    ("WEBSHOP_URL", "not a url"),
    ("SPAN_GATHER_MAX_S", "60"),
]
DISPATCHER_ONLY = [
    ("BRIDGE_MAX_BATCH", "0"),
    ("SLOT_SHARE_WEIGHTS", "v2:1"),
    ("BRIDGE_METRICS_PORT", "70000"),
    ("AGL_V1_MAX_RERUNS", "99"),
]
SHARED = [
    ("CELERY_BROKER_URL", "http://broker:1234"),
    ("LOG_LEVEL", "LOUD"),
    ("AGENT", "not an import path"),
    ("AGENT_LIGHTNING_STORE_URL", "not a url"),
]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in list(os.environ):
        if name in VARIABLES:
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)  # no stray .env


def _refused(settings_class: type[SettingsGroup], name: str) -> bool:
    """Whether loading ``settings_class`` fails on the variable ``name``."""
    try:
        load_settings(settings_class)
    except ConfigError as error:
        assert name in error.message, error.message
        return True
    return False


@pytest.mark.parametrize(("name", "value"), WORKER_ONLY)
def test_a_bad_worker_setting_does_not_stop_the_dispatchers(
    clean_env: None, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    load_settings(DispatcherSettings)
    assert _refused(WorkerSettings, name)
    assert _refused(Settings, name)


@pytest.mark.parametrize(("name", "value"), DISPATCHER_ONLY)
def test_a_bad_dispatcher_setting_does_not_stop_the_workers(
    clean_env: None, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    load_settings(WorkerSettings)
    assert _refused(DispatcherSettings, name)
    assert _refused(Settings, name)


@pytest.mark.parametrize(("name", "value"), SHARED)
def test_a_bad_shared_setting_stops_both(
    clean_env: None, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    assert _refused(DispatcherSettings, name)
    assert _refused(WorkerSettings, name)


def test_each_process_runs_the_cross_checks_of_its_own_groups(clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGL_V1_PRELOAD_AGENTS", "true")  # the workers': it needs AGL_V1_AGENT_MODULES
    monkeypatch.setenv("BRIDGE_POLL_MIN_S", "5")  # the dispatchers': above BRIDGE_POLL_MAX_S
    with pytest.raises(ConfigError, match="AGL_V1_PRELOAD_AGENTS needs AGL_V1_AGENT_MODULES"):
        load_settings(WorkerSettings)
    with pytest.raises(ConfigError, match="BRIDGE_POLL_MIN_S must not exceed BRIDGE_POLL_MAX_S"):
        load_settings(DispatcherSettings)
    monkeypatch.setenv("LEASE_TTL_S", "5")  # both: not more than twice HEARTBEAT_INTERVAL_S
    monkeypatch.delenv("AGL_V1_PRELOAD_AGENTS")
    monkeypatch.delenv("BRIDGE_POLL_MIN_S")
    for settings_class in (DispatcherSettings, WorkerSettings):
        with pytest.raises(ConfigError, match="LEASE_TTL_S must be more than twice HEARTBEAT_INTERVAL_S"):
            load_settings(settings_class)


def test_the_entry_points_load_their_own_groups(
    clean_env: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The worker's settings (``get_settings``) and its health probe start over a bad dispatcher setting; the
    1.0 dispatcher refuses one (exit code 2), and the probe a bad worker setting."""
    monkeypatch.setenv("BRIDGE_MAX_BATCH", "0")
    process_state.reset()
    try:
        assert isinstance(get_settings(), WorkerSettings)
        assert not isinstance(get_settings(), DispatcherSettings)
    finally:
        process_state.reset()
    assert cli.main(["v1", "--server", "http://127.0.0.1:1"]) == 2
    assert capsys.readouterr().err.startswith("error: invalid configuration: BRIDGE_MAX_BATCH: ")
    monkeypatch.setenv("MAX_STEPS", "0")
    assert health.main([]) == 2
    assert "MAX_STEPS" in capsys.readouterr().err


def test_every_variable_keeps_its_name() -> None:
    assert sorted(env_name(field) for field in Settings.model_fields) == sorted(VARIABLES)


@pytest.mark.parametrize("name", VARIABLES)
def test_every_variable_is_read_by_the_processes_of_its_group_and_no_other(
    clean_env: None, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """A probe value either arrives (a free-form string) or is refused naming the variable, in each process class
    whose groups hold it; the others do not read it."""
    field = next(f for f, info in Settings.model_fields.items() if info.validation_alias == name)
    (group,) = [group for group in GROUPS if field in group.model_fields]
    probe = "probe-value"
    monkeypatch.setenv(name, probe)
    for settings_class in PROCESS_CLASSES:
        if not issubclass(settings_class, group):
            assert field not in settings_class.model_fields
            load_settings(settings_class)
            continue
        try:
            value = getattr(load_settings(settings_class), field)
        except ConfigError as error:
            assert f"{name}:" in error.message, error.message
        else:
            assert value in (probe, [probe]), (settings_class.__name__, value)
    assert any(issubclass(process, group) for process in (DispatcherSettings, WorkerSettings)), "read by no process"


def test_an_override_another_process_reads_is_refused_naming_who_reads_it() -> None:
    """A keyword override (``CeleryRunner(max_steps=...)``) that the loading process does not read is an error that
    says where to set it, never silently dropped; one that names no setting at all says so."""
    with pytest.raises(ConfigError) as refused:
        load_settings(DispatcherSettings, store_url="http://127.0.0.1:1", max_steps=3)
    assert refused.value.setting == "MAX_STEPS" and "read by the workers" in refused.value.message
    with pytest.raises(ConfigError) as unknown:
        load_settings(DispatcherSettings, store_url="http://127.0.0.1:1", max_stepz=3)
    assert unknown.value.message == "max_stepz: no such setting"
    loaded = load_settings(DispatcherSettings, AGENT_LIGHTNING_STORE_URL="http://127.0.0.1:1", BRIDGE_MAX_BATCH=3)
    assert loaded.max_batch == 3
