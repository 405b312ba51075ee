"""Where ``bridge_lab.docker_here`` finds the CPython 3.12 it copies into ``agl-local/python:3.12``: the way a
user's machine has one, never a path of the machine it was written on."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge_lab.docker_here import DockerHereError, python312_prefix


def interpreter(prefix: Path) -> Path:
    (prefix / "bin").mkdir(parents=True)
    (prefix / "lib/python3.12").mkdir(parents=True)
    (prefix / "bin/python3.12").write_text("")
    return prefix / "bin/python3.12"


def test_pyenvs_newest_3_12_is_found_under_pyenv_root(tmp_path: Path) -> None:
    for version in ("3.12.1", "3.12.10", "3.12.9", "3.11.7"):
        interpreter(tmp_path / "pyenv/versions" / version)
    env = {"PATH": str(tmp_path / "empty"), "PYENV_ROOT": str(tmp_path / "pyenv")}
    assert python312_prefix(env) == tmp_path / "pyenv/versions/3.12.10"


def test_python3_12_on_the_path_comes_first_and_the_setting_before_it(tmp_path: Path) -> None:
    on_path = interpreter(tmp_path / "opt/python")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/python3.12").symlink_to(on_path)
    (tmp_path / "bin/python3.12").chmod(0o755)
    on_path.chmod(0o755)
    interpreter(tmp_path / "pyenv/versions/3.12.1")
    env = {"PATH": str(tmp_path / "bin"), "PYENV_ROOT": str(tmp_path / "pyenv")}
    assert python312_prefix(env) == tmp_path / "opt/python"
    interpreter(tmp_path / "chosen")
    assert python312_prefix({**env, "AGL_PYTHON312_PREFIX": str(tmp_path / "chosen")}) == tmp_path / "chosen"


def test_none_found_says_what_to_install_and_a_wrong_setting_says_what_it_lacks(tmp_path: Path) -> None:
    with pytest.raises(DockerHereError, match=r"pyenv install 3\.12"):
        python312_prefix({"PATH": str(tmp_path), "HOME": str(tmp_path)})
    with pytest.raises(DockerHereError, match=r"holds no bin/python3\.12"):
        python312_prefix({"AGL_PYTHON312_PREFIX": str(tmp_path)})
