"""Which image a container needs, read from the Dockerfile, for the compose and Kubernetes tests (no Docker).

``stages()`` reads the Dockerfile's stages: each one's parent, the sources it copies and the extras its
``pip install`` lines name, inherited from its parent. ``extras_needed(argv)`` is what a container's command
needs installed beyond the runtime dependencies (``store`` for ``agl store``, ``flower`` for Flower, ``lab`` for the
WebShop server, the LLM stand-in and the lab's commands). ``IMAGES`` maps the image names the deployment files
use to the target each is built from.
"""

from __future__ import annotations

import itertools
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.cli import LAB_PACKAGE, TOOLS

IMAGES = {"agl-celery-bridge": "runtime", "agl-celery-bridge-flower": "flower", "agl-celery-bridge-lab": "lab"}
# Images chosen for their interpreter rather than their extras: the 1.0 workers (and 1.0's gateway) whose agent
# programs need Python >= 3.12 with agentlightning 1.0. The leanest-image rule does not apply to them.
INTERPRETER_IMAGES = {"agl-celery-bridge-worker-agl-v1": "worker-agl-v1"}
LAB_SOURCES = {LAB_PACKAGE, "webshop_env"}  # the repository's packages that are not the product
PIP_INSTALL = re.compile(r"pip install (?:-\S+ )*[\"']?\.(?:\[(?P<extras>[^\]]*)\])?[\"']?(?:\s|$)")


@dataclass
class Stage:
    name: str
    parent: str | None  # a stage of this Dockerfile, or None for a base image
    copies: set[str] = field(default_factory=set)  # sources copied in this stage and its parents
    extras: set[str] = field(default_factory=set)  # extras installed in this stage and its parents
    installs: bool = False  # the project is pip-installed in this stage or a parent
    text: str = ""  # the stage's own lines, from its FROM on (continuations joined)


def stages(dockerfile: Path) -> dict[str, Stage]:
    """The Dockerfile's stages by name, in order; the last is the default target."""
    found: dict[str, Stage] = {}
    current: Stage | None = None
    for line in dockerfile.read_text(encoding="utf-8").replace("\\\n", " ").splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        instruction = words[0].upper()
        if instruction == "FROM":
            assert len(words) == 4 and words[2].upper() == "AS", f"every stage is named: {line!r}"
            assert words[3] not in found, f"a stage name used twice (docker build refuses it): {words[3]!r}"
            parent = found.get(words[1])
            current = Stage(words[3], words[1] if parent else None)
            if parent is not None:
                current.copies, current.extras, current.installs = (
                    set(parent.copies),
                    set(parent.extras),
                    parent.installs,
                )
            found[current.name] = current
        if current is None:
            continue
        current.text += line + "\n"
        if instruction == "COPY":
            current.copies.update(source.rstrip("/") for source in words[1:-1] if not source.startswith("--"))
        elif instruction == "RUN":
            for match in PIP_INSTALL.finditer(line):
                current.installs = True
                current.extras.update(e.strip() for e in (match["extras"] or "").split(",") if e.strip())
    return found


def image_name(image: str) -> str:
    """``registry.example.com/agl-celery-bridge-lab:0.1.0`` -> ``agl-celery-bridge-lab``."""
    return image.rsplit("/", 1)[-1].partition(":")[0]


def command_argv(command: Any) -> list[str]:
    """A container's command as argv: the image's init (``tini --``) and a ``setpriv --...`` (the user switch)
    dropped, ``sh -c "exec ..."`` unwrapped, ``tini --`` dropped again."""
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    if argv[:2] == ["tini", "--"]:
        argv = argv[2:]
    if argv[:1] == ["setpriv"]:
        argv = list(itertools.dropwhile(lambda word: word.startswith("--"), argv[1:]))
    if argv[:2] == ["sh", "-c"]:
        argv = shlex.split(argv[2].replace("$$", "$"))
        argv = argv[1:] if argv[0] == "exec" else argv
    return argv[2:] if argv[:2] == ["tini", "--"] else argv


def extras_needed(argv: list[str]) -> set[str]:
    """The extras a command needs installed (an empty set: the runtime dependencies are enough)."""
    if argv[:2] == ["agl", "store"]:
        return {"store"}
    if argv[0] == "celery":
        return {"flower"} if "flower" in argv else set()
    assert argv[0] == "python" and argv[1] in {"-m", "-c"}, f"a command this check does not know: {argv}"
    if argv[1] == "-c":
        return set()  # a health check's one-liner: the standard library
    module = argv[2]
    if module == "bridge":
        command = argv[3] if len(argv) > 3 else "run"
        return {"lab"} if TOOLS.get(command, ("",))[0].startswith(LAB_PACKAGE + ".") else set()
    if module == "bridge.ops.flower":
        return {"flower"}
    if module.partition(".")[0] in LAB_SOURCES:
        return {"lab"}
    return set()


def target_for(argv: list[str], found: dict[str, Stage]) -> str:
    """The leanest image target (of ``IMAGES``) that runs ``argv``: the one installing the fewest extras among
    those that install every extra it needs (and copy the lab's sources when it needs the lab)."""
    needed = extras_needed(argv)
    fits = [
        target
        for target in IMAGES.values()
        if found[target].installs
        and needed <= found[target].extras
        and ("lab" not in needed or found[target].copies >= LAB_SOURCES)
    ]
    assert fits, f"no Dockerfile target installs {sorted(needed)} for {argv}"
    return min(fits, key=lambda target: len(found[target].extras))
