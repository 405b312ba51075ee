"""What a 1.0 agent program is given, and what a rollout may not ask for (docs/agl-v1.md, "Trust model").

Workers hold the operators' keys; a rollout's program gets only what it is owed:

* ``program_environment`` builds its environment from nothing: the names of ``BASE_NAMES`` / ``BASE_PREFIXES``
  and of ``AGL_V1_PASS_ENV`` that the worker has, then the ``AGL_*`` variables 1.0's ``local`` runner gives
  (``AGL_KEY``, ``AGL_OPENAI_BASE_URL``, ``AGL_EVENT_URL``: the attempt relay's, with a token of the attempt's
  own, ``workers.v1.relay``), then the rollout's ``env_map`` entries. Nothing else of the worker's environment
  (broker and Redis URLs, OPENAI_API_KEY, the Store token, AGL_V1_KEY).
* Before that it refuses, with ``ProgramRefused`` (failure class ``input``), a rollout whose ``env_map`` names a
  variable ``denied_reason`` denies, or whose ``agent_class`` is not an import path or lies outside
  ``AGL_V1_AGENT_MODULES``: the program never starts.
* ``output_redactor`` masks the worker's secrets (known secret values, URL passwords, tokens) in what the
  program writes, before any of it is logged or reported.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from urllib.parse import unquote, urlsplit

from bridge.core.gateway import V1LocalConfig, V1Rollout
from bridge.core.infra import InvalidInputError, redact_text
from bridge.core.settings import WorkerSettings

BASE_NAMES = frozenset({"PATH", "HOME", "LANG", "TZ", "TMPDIR", "VIRTUAL_ENV"})
"""The worker's variables every program gets (with ``LC_*``): what a process and a virtualenv need to run."""
BASE_PREFIXES = ("LC_",)

AGL_NAMES = frozenset({"AGL_KEY", "AGL_OPENAI_BASE_URL", "AGL_EVENT_URL"})
"""The variables 1.0's ``local`` runner gives every program, set by the worker for the attempt."""

# The deny rule of env_map, applied to the upper-cased name; the first that matches is the reason.
_DENIED_PREFIXES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("AGL_",), "Agent Lightning variables are the worker's to set"),
    (("LD_", "DYLD_", "GCONV_", "MALLOC_", "GLIBC_"), "a loader variable"),
    (
        ("PYTHON", "PERL", "RUBY", "NODE_", "NPM_CONFIG_", "JAVA_", "_JAVA_", "JDK_", "LUA_", "BASH_FUNC_"),
        "an interpreter variable",
    ),
    (("LC_", "SSL_", "OPENSSL_", "GIT_"), "a system variable the worker sets"),
)
_DENIED_SUFFIXES = (("_PROXY", "a proxy variable (it would route the program's requests, key included)"),)
_DENIED_NAMES: dict[str, str] = {
    **dict.fromkeys(("PATH", "HOME", "LANG", "TZ", "TMPDIR", "TMP", "TEMP", "VIRTUAL_ENV"), "the worker sets it"),
    **dict.fromkeys(
        ("BROWSER", "EDITOR", "VISUAL", "PAGER", "SHELL", "ENV", "BASH_ENV", "IFS", "CDPATH", "PS4"),
        "it names a program to run",
    ),
    **dict.fromkeys(
        ("PROMPT_COMMAND", "NLSPATH", "LOCPATH", "HOSTALIASES", "RES_OPTIONS", "LOCALDOMAIN"), "a system variable"
    ),
    **dict.fromkeys(("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NETRC"), "it decides whom the program's requests trust"),
    **dict.fromkeys(
        ("CLASSPATH", "RUBYLIB", "RUBYOPT", "GEM_HOME", "GEM_PATH", "PERL5LIB", "PERL5OPT"), "an interpreter variable"
    ),
}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_IDENT = r"[A-Za-z_]\w*"
_AGENT_CLASS = re.compile(
    rf"^(?P<colon>{_IDENT}(\.{_IDENT})*):{_IDENT}(\.{_IDENT})*$|^(?P<dotted>{_IDENT}(\.{_IDENT})+)$"
)
_SECRET_NAME = re.compile(r"(?i)(^|_)(KEY|APIKEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?)(_|$)")
MIN_SECRET_CHARS = 4  # shorter values are masked by the text rules only: "1" or "on" would blank the output


class ProgramRefused(InvalidInputError, ValueError):
    """The rollout asks for what a program may not have (an env_map name, an agent module): failure class
    ``input``, the message says which and why."""


def denied_reason(name: str, *, passed: frozenset[str] = frozenset()) -> str | None:
    """Why ``env_map`` may not set ``name``, or None when it may. ``passed``: the operator's AGL_V1_PASS_ENV,
    which a rollout may not replace either."""
    if not _ENV_NAME.match(name):
        return "not a variable name"
    upper = name.upper()
    if upper in {p.upper() for p in passed}:
        return "the operator passes it to programs (AGL_V1_PASS_ENV)"
    if upper in _DENIED_NAMES:
        return _DENIED_NAMES[upper]
    for prefixes, why in _DENIED_PREFIXES:
        if upper.startswith(prefixes):
            return why
    for suffix, why in _DENIED_SUFFIXES:
        if upper.endswith(suffix):
            return why
    return None


def check_agent_class(agent_class: str, allowed: list[str]) -> None:
    """ProgramRefused unless ``agent_class`` is ``module:Class`` or ``module.Class`` and, when ``allowed`` (module
    prefixes) is not empty, its module is one of them or inside one."""
    match = _AGENT_CLASS.match(agent_class)
    if match is None:
        raise ProgramRefused(f"invalid rollout config (input): agent_class {agent_class!r} is not module:Class")
    module = match.group("colon") or agent_class.rpartition(".")[0]
    if allowed and not any(module == p or module.startswith(f"{p}.") for p in allowed):
        raise ProgramRefused(
            f"invalid rollout config (input): agent_class {agent_class!r} is outside the modules this cluster runs "
            f"(AGL_V1_AGENT_MODULES={','.join(allowed)})"
        )


def program_environment(
    rollout: V1Rollout,
    settings: WorkerSettings,
    *,
    attempt: Mapping[str, str],
    worker_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The whole environment of ``rollout``'s program (``worker_env``: default os.environ): the base, then
    ``attempt``, its attempt's variables (``bridge.core.gateway.agent_environment``: the AGL_* ones, which
    ``workers.v1.relay`` points at the relay with the attempt's token, and its env_map). ProgramRefused when the
    rollout may not run here."""
    local = rollout.config.local or V1LocalConfig()
    check_agent_class(local.agent_class or "", settings.agl_v1_agent_modules)
    passed = frozenset(settings.agl_v1_pass_env)
    for name in local.env_map:
        why = denied_reason(name, passed=passed)
        if why is not None:
            raise ProgramRefused(f"invalid rollout config (input): config.local.env_map may not set {name}: {why}")
    env = base_environment(settings, worker_env)
    env.update(attempt)
    return env


def base_environment(settings: WorkerSettings, worker_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What every program gets of the worker's environment (``worker_env``: default os.environ): the names of
    ``BASE_NAMES`` / ``BASE_PREFIXES`` and of ``AGL_V1_PASS_ENV`` it has; the program server's whole environment."""
    source = os.environ if worker_env is None else worker_env
    passed = frozenset(settings.agl_v1_pass_env)
    return {
        name: value
        for name, value in source.items()
        if name in BASE_NAMES or name.startswith(BASE_PREFIXES) or name in passed
    }


def worker_secrets(settings: WorkerSettings, worker_env: Mapping[str, str] | None = None) -> set[str]:
    """The secret values this worker holds: its settings' keys and tokens, the passwords in its URLs, and the
    values of its environment variables whose names say key, token, secret, password or credential."""
    source = os.environ if worker_env is None else worker_env
    values = [settings.agl_v1_key, settings.openai_api_key, settings.store_token, settings.webshop_token]
    values += [value for name, value in source.items() if _SECRET_NAME.search(name)]
    urls = [settings.broker_url, settings.redis_url, *source.values()]
    for url in filter(None, urls):
        if "@" not in url:
            continue
        try:
            password = urlsplit(url).password
        except ValueError:
            continue
        if password:
            values += [password, unquote(password)]
    return {v for v in values if v and len(v) >= MIN_SECRET_CHARS}


def output_redactor(settings: WorkerSettings, worker_env: Mapping[str, str] | None = None) -> Callable[[str], str]:
    """A function that masks ``worker_secrets`` (longest first) and then what ``redact_text`` finds in a line of
    the program's output."""
    secrets = sorted(worker_secrets(settings, worker_env), key=len, reverse=True)

    def redact(line: str) -> str:
        for secret in secrets:
            line = line.replace(secret, "***")
        return redact_text(line)

    return redact
