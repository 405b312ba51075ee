"""The documentation stays true to the code: the generated configuration reference is current, every
setting is in .env.example, and every docs/ page that README.md links or the source cites exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bridge.tools import configdoc

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("bridge", "workers", "webshop_env", "tests")
DOC_REFERENCE = re.compile(r"\bdocs/([A-Za-z0-9_.-]+\.md)")


def test_configuration_reference_is_current() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == configdoc.generate(), (
        "docs/configuration.md is stale: run `python -m bridge.tools.configdoc --write`"
    )


def test_check_mode_agrees() -> None:
    assert configdoc.main(["--check"]) == 0


def test_every_setting_is_in_env_example() -> None:
    sections = configdoc.parse_env_example((ROOT / ".env.example").read_text(encoding="utf-8"))
    listed = {variable.name for section in sections for group in section.groups for variable in group}
    missing = sorted(set(configdoc.settings_by_env()) - listed)
    assert not missing, f".env.example lacks {missing} (under a '# --- Section ---' line)"


def test_every_setting_has_a_description() -> None:
    sections = configdoc.parse_env_example((ROOT / ".env.example").read_text(encoding="utf-8"))
    undescribed = [g[0].name for s in sections for g in s.groups if not g[0].description]
    assert not undescribed, f"no comment line above {undescribed} in .env.example"


def test_env_example_parsing() -> None:
    text = "# header\n# --- One (note) ---\n# Shared text\n# AA=1\nBB=2\n\n# Alone\n# CC=\n"
    (section,) = configdoc.parse_env_example(text)
    assert section.title == "One"
    assert [[v.name for v in g] for g in section.groups] == [["AA", "BB"], ["CC"]]
    assert section.groups[0][1].description == "Shared text"
    assert section.groups[1][0].example == ""


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
