"""The third-party corrections in ``bridge.core.patches`` run only on the library versions they were verified
against: a version outside a patch's range fails here, naming the module to drop or re-verify."""

from __future__ import annotations

import importlib
import re
from importlib.metadata import version
from pathlib import Path

import pytest

from bridge.core.patches import PATCHES, Patch

ROOT = Path(__file__).resolve().parents[2]


def release(text: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``5.6.3`` -> (5, 6, 3); ``1.0rc1`` -> (1, 0)."""
    match = re.match(r"\d+(?:\.\d+)*", text)
    assert match, f"not a version: {text!r}"
    return tuple(int(part) for part in match.group().split("."))


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.module)
def test_each_patch_runs_only_on_the_versions_it_was_verified_against(patch: Patch) -> None:
    installed = version(patch.distribution)
    assert release(patch.verified_from) <= release(installed) < release(patch.below), (
        f"{patch.distribution} {installed} is outside [{patch.verified_from}, {patch.below}) for "
        f"bridge/core/patches/{patch.module}.py: {patch.drop_when}"
    )


def test_every_module_in_the_package_is_registered_and_imports() -> None:
    modules = {path.stem for path in (ROOT / "bridge/core/patches").glob("*.py")} - {"__init__"}
    assert modules == {patch.module for patch in PATCHES}
    for patch in PATCHES:
        importlib.import_module(f"bridge.core.patches.{patch.module}")


def test_release_reads_the_numeric_part() -> None:
    assert release("5.6.3") == (5, 6, 3) and release("1.0rc1") == (1, 0) and release("5.7") > release("5.6.99")
