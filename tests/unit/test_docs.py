"""The documentation stays true to the code: .env.example and the configuration reference are generated from
the current settings, every setting is described, and every docs/ page that README.md links or the source cites
exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bridge.core.settings import GROUPS, Settings, env_name
from bridge_lab import configdoc

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("bridge", "workers", "webshop_env", "tests")
DOC_REFERENCE = re.compile(r"\bdocs/([A-Za-z0-9_.-]+\.md)")


def test_generated_configuration_files_are_current() -> None:
    stale = [str(path.relative_to(ROOT)) for path in configdoc.stale()]
    assert not stale, f"{', '.join(stale)} differ from the settings: run `{configdoc.COMMAND}`"


def test_a_changed_setting_makes_both_files_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Settings.model_fields["store_timeout_s"], "description", "Changed.")
    assert configdoc.stale() == [configdoc.ENV_EXAMPLE, configdoc.OUTPUT]


def test_check_mode_agrees() -> None:
    assert configdoc.main(["--check"]) == 0


def test_every_setting_has_a_description_and_one_group() -> None:
    undescribed = [name for name, info in Settings.model_fields.items() if not (info.description or "").strip()]
    assert not undescribed, f"no description (a string below the field) for {undescribed}"
    grouped = [name for group in GROUPS for name in group.model_fields]
    assert sorted(grouped) == sorted(Settings.model_fields), "a setting is in no group of GROUPS, or in two"
    assert [section.title for section in configdoc.sections()][: len(GROUPS)] == [group.title for group in GROUPS]


def test_every_variable_is_listed_once() -> None:
    names = [variable.name for section in configdoc.sections() for variable in section.variables]
    assert sorted(names) == sorted(set(names)), "a variable is listed twice (a setting also in FOREIGN?)"
    assert {env_name(field) for field in Settings.model_fields} <= set(names)


def test_env_example_lines() -> None:
    text = configdoc.generated()[configdoc.ENV_EXAMPLE]
    assert "\nAGENT_LIGHTNING_STORE_URL=http://127.0.0.1:4747\n" in text  # set: examples[0], set_in_example
    assert "\n# STORE_TIMEOUT_S=30\n" in text  # commented out: the default
    assert "\n# AGENT_LIGHTNING_STORE_TOKEN=\n" in text  # unset by default


def test_readme_links_into_docs_exist() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = set(DOC_REFERENCE.findall(readme))
    assert linked, "README.md links no page under docs/"
    missing = sorted(name for name in linked if not (ROOT / "docs" / name).is_file())
    assert not missing, f"README.md links missing pages: {missing}"


def _cited() -> dict[str, list[str]]:
    cited: dict[str, list[str]] = {}
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name in DOC_REFERENCE.findall(path.read_text(encoding="utf-8")):
                cited.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return cited


@pytest.mark.parametrize("name", sorted(_cited()))
def test_cited_docs_exist(name: str) -> None:
    assert (ROOT / "docs" / name).is_file(), f"docs/{name} is cited by {_cited()[name]} but does not exist"


def test_cited_sections_exist() -> None:
    """A citation of a page under docs/ with a section number ("section N", or just "N.M") names a heading of it."""
    citation = re.compile(r"docs/([a-z-]+\.md),? (?:sections? )?(\d+(?:\.\d+)?)")
    problems = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name, number in citation.findall(path.read_text(encoding="utf-8")):
                page = ROOT / "docs" / name
                headings = page.read_text(encoding="utf-8") if page.is_file() else ""
                if not re.search(rf"^#+ {re.escape(number)}\.? ", headings, flags=re.M):
                    problems.append(f"{path.relative_to(ROOT)}: docs/{name} section {number}")
    assert not problems, "cited sections without a heading: " + "; ".join(problems)
