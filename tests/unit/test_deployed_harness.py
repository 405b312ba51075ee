"""The deployed tests' compose projects are hermetic (tests/deployed/conftest.py, ``Project.run``): neither the
repository's `.env` nor a variable of the developer's shell reaches a project, only what the test sets."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deployed.conftest import Engine, Project


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
