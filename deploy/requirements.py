"""Print the requirements pyproject.toml names for the project and the given extras, one per line.

The Dockerfile installs them before it copies the source, so a change to the source rebuilds only the layer that
installs the project itself (``pip install --no-deps``), and the dependency layers stay cached until pyproject.toml
changes. An extra that names the project (``agl-celery-bridge[flower]``) adds that extra's requirements.

    python requirements.py store,lab > /tmp/requirements.txt
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")


def requirements(pyproject: dict[str, object], extras: list[str]) -> list[str]:
    """The project's dependencies and those of ``extras``, in order, without duplicates or self-references."""
    project = pyproject["project"]
    assert isinstance(project, dict)
    name, optional = project["name"], project.get("optional-dependencies", {})
    found: list[str] = []
    todo, seen = [None, *extras], set()
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        seen.add(extra)
        if extra is not None and extra not in optional:
            raise SystemExit(f"pyproject.toml has no extra {extra!r} (it has: {', '.join(sorted(optional))})")
        for line in project["dependencies"] if extra is None else optional[extra]:
            match = NAME.match(line)
            if match and match[1] == name:
                todo.extend(part.strip() for part in (match[2] or "").split(",") if part.strip())
            elif line not in found:
                found.append(line)
    return found


def main(argv: list[str]) -> int:
    extras = [part for arg in argv for part in arg.split(",") if part]
    pyproject = tomllib.loads(Path("pyproject.toml").read_text(encoding="utf-8"))
    print("\n".join(requirements(pyproject, extras)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
