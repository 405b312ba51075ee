"""The layering the two processes rely on, read from the source with ``ast`` (nothing is imported).

Why these rules: the bridge publishes by task name and must start without the worker stack (agent, LLM
client, telemetry); workers and the dispatcher share only ``bridge.core``; the offline WebShop server and
LLM stand-in run without either. The product (``bridge``, ``workers``) never imports the lab (``bridge_lab``, the
WebShop stand-in), whose dependencies are the ``lab`` extra's: ``bridge.cli`` reaches a lab command by name through
``importlib``, which is the one allowed way in and is invisible here on purpose (tests/unit/test_lean_product.py
imports every product module without the extra).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bridge", "bridge_lab", "workers", "webshop_env")

# Each dispatch line's package: its dispatcher, its repair planner, and the 0.3 line's process, hold, coalescing and
# placement. What both lines use (the one dispatcher, the publisher, the repair runner, leadership, metrics, the
# broker probe, the backlog reader) sits beside them in ``bridge.dispatch``.
V03_LINE = ("bridge.dispatch.v03",)
V1_LINE = ("bridge.dispatch.v1",)
LINES = V03_LINE + V1_LINE

# importer prefix -> prefixes it must never import (at any level: lazy imports count too)
FORBIDDEN = {
    # The product never needs the lab extra: no lab module, no WebShop stand-in.
    "bridge": ("bridge_lab", "webshop_env"),
    "bridge.core": ("bridge.dispatch", "bridge.ops", "bridge.cli", "bridge.runner", "workers"),
    "bridge.dispatch": ("workers", "bridge.ops", "bridge.runner"),
    "bridge.ops": ("workers", "bridge.cli", "bridge.runner"),
    "workers": ("bridge.dispatch", "bridge.ops", "bridge.cli", "bridge.runner", "bridge_lab", "webshop_env"),
    # The trainer-side runner runs the dispatcher in the trainer's process: never the worker stack.
    "bridge.runner": ("workers", "bridge.ops", "bridge.cli"),
    "bridge.runner_support": ("workers", "bridge.ops", "bridge.cli"),
    "webshop_env": ("bridge", "bridge_lab", "workers"),
    # The attempt protocol both lines share knows no agent, no line's attempt and no Celery task: each line's
    # attempt (workers.execution, workers.v1) supplies how its agent starts and stops and how it reports.
    "workers.protocol": (
        "workers.agents",
        "workers.v1",
        "workers.execution",
        "workers.tasks",
        "workers.lifecycle.steps",
    ),
    "workers.telemetry": ("workers.agents", "workers.v1", "workers.execution", "workers.tasks"),
    # The core's plumbing (errors, masking, HTTP, TLS, logging, tracing) is its bottom layer: it knows none of the
    # core's concepts (the settings it is handed excepted).
    "bridge.core.infra": ("bridge.core.store", "bridge.core.gateway", "bridge.core.task", "bridge.core.coordination"),
    # The dispatch lines share only the one dispatcher and what it shares; neither imports the other's line.
    # (What they share imports neither: test_the_shared_dispatch_modules_import_no_line.)
    "bridge.dispatch.v03": V1_LINE,
    "bridge.dispatch.v1": V03_LINE,
}
# The modules whose module-level imports must form no cycle.
ACYCLIC = ("bridge.core", "bridge.dispatch", "bridge.runner", "bridge.runner_support", "workers")


@dataclass(frozen=True)
class Import:
    target: str
    line: int
    module_level: bool  # executed on import (not inside a function, nor under ``if TYPE_CHECKING``)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


MODULES = {module_name(path): path for path in source_files()}


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def resolve(base: str, names: list[str]) -> Iterator[str]:
    """``from base import a, b``: each name that is a module of ours is the import, else the package."""
    for name in names:
        candidate = f"{base}.{name}"
        yield candidate if candidate in MODULES else base


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(name: str) -> list[Import]:
    path = MODULES[name]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, module_level: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, node.lineno, module_level) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: climb from this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = resolve(base, [alias.name for alias in node.names])
            found.extend(Import(target, node.lineno, module_level) for target in targets)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for child in ast.iter_child_nodes(node):
                visit(child, False)
            return
        elif isinstance(node, ast.If) and is_type_checking(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, module_level)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, module_level)

    visit(tree, True)
    return list(dict.fromkeys(found))  # ``from m import a, b`` of one package names it once


IMPORTS = {name: imports_of(name) for name in MODULES}


def test_the_packages_are_found() -> None:
    assert {"bridge.core.store.client", "bridge.dispatch.v03", "workers.tasks", "webshop_env.server"} <= set(MODULES)


@pytest.mark.parametrize("importer", sorted(FORBIDDEN))
def test_layers_import_only_downwards(importer: str) -> None:
    violations = [
        f"{name}:{imp.line} imports {imp.target}"
        for name, imports in IMPORTS.items()
        if within(name, importer)
        for imp in imports
        if any(within(imp.target, banned) for banned in FORBIDDEN[importer])
    ]
    assert not violations, f"{importer} must not import {', '.join(FORBIDDEN[importer])}:\n" + "\n".join(violations)


def test_the_shared_dispatch_modules_import_no_line() -> None:
    """Every module of ``bridge.dispatch`` outside a line's package is shared by both lines, so it imports neither."""
    shared = [name for name in MODULES if within(name, "bridge.dispatch") and not any(within(name, p) for p in LINES)]
    assert "bridge.dispatch.dispatcher" in shared
    violations = [
        f"{name}:{imp.line} imports {imp.target}"
        for name in shared
        for imp in IMPORTS[name]
        if any(within(imp.target, line) for line in LINES)
    ]
    assert not violations, "\n".join(violations)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that returns to its start, or None."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = []
        on_path: set[str] = set()
        stack: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        path.append(start)
        on_path.add(start)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif child in on_path:
                return [*path[path.index(child) :], child]
            elif child not in done:
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
                on_path.add(child)
    return None


def test_find_cycle_sees_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_in_core_dispatch_and_workers() -> None:
    nodes = {name for name in MODULES if any(within(name, prefix) for prefix in ACYCLIC)}
    graph = {
        name: {imp.target for imp in IMPORTS[name] if imp.module_level and imp.target in nodes and imp.target != name}
        for name in nodes
    }
    cycle = find_cycle(graph)
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle or [])


# --- a sub-package is entered through its public names --------------------------------------------------------

# Each sub-package of bridge.core, and each dispatch line's package, lists its public names in its ``__init__``
# (``__all__``): what it re-exports, and the modules it keeps public as namespaces (``keys``, ``capacity``). A module
# outside the package imports the package or such a public module, never one of its private modules. ``patches`` is
# not held to it: each module there is one correction of a library, imported by name where it applies (its
# ``PATCHES`` registry lists them).
OPEN_CORE_PACKAGES = ("bridge.core.patches",)


def public_names(package: str) -> set[str] | None:
    """The names in ``package``'s ``__all__`` (a literal list or tuple of strings), or None when it has none."""
    for node in ast.parse(MODULES[package].read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            value = ast.literal_eval(node.value)
            return {str(name) for name in value}
    return None


def entered_packages() -> list[str]:
    """The packages held to the rule: bridge.core's sub-packages (but the open ones) and the dispatch lines'."""
    core = [name for name in packages_under("bridge.core") if name.count(".") == 2 and name not in OPEN_CORE_PACKAGES]
    return sorted([*core, *LINES])


def private_entries(imports: dict[str, list[Import]], public: dict[str, set[str]]) -> list[str]:
    """Each import, from outside a package of ``public``, of a module inside it that is not one of its public names."""
    found = []
    for name, listed in sorted(imports.items()):
        for imp in listed:
            for package, names in public.items():
                inside = within(imp.target, package) and imp.target != package and not within(name, package)
                if inside and imp.target[len(package) + 1 :].split(".")[0] not in names:
                    found.append(f"{name}:{imp.line} imports {imp.target}")
    return found


def test_the_private_entry_check_sees_a_private_module() -> None:
    imports = {
        "a.user": [Import("a.pkg.hidden", 1, True), Import("a.pkg", 2, True), Import("a.pkg.shown", 3, False)],
        "a.pkg.shown": [Import("a.pkg.hidden", 4, True)],
    }
    assert private_entries(imports, {"a.pkg": {"shown", "f"}}) == ["a.user:1 imports a.pkg.hidden"]


def test_a_subpackage_is_imported_through_its_public_names_only() -> None:
    """``from bridge.core.store import StoreClient``, not ``from bridge.core.store.client import StoreClient``: a
    sub-package's modules can be split, merged or renamed without touching its users (the tests excepted: they may
    reach into a module to replace what it uses)."""
    packages = entered_packages()
    assert {"bridge.core.infra", "bridge.core.store", "bridge.dispatch.v03"} <= set(packages)
    public = {package: public_names(package) for package in packages}
    missing = [package for package, names in public.items() if names is None]
    assert not missing, f"these packages declare no __all__ (their public names): {missing}"
    wrong = private_entries(IMPORTS, {package: names for package, names in public.items() if names is not None})
    assert not wrong, "import the sub-package (or a module its __all__ names), not its private module:\n" + "\n".join(
        wrong
    )


def test_each_entered_package_exports_what_its_all_names() -> None:
    """Every name in a sub-package's ``__all__`` is bound in its ``__init__`` (imported or defined there)."""
    for package in entered_packages():
        tree = ast.parse(MODULES[package].read_text(encoding="utf-8"))
        bound = {
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
        }
        assert (public_names(package) or set()) <= bound, package


# --- docs/architecture.md's tree against the modules -------------------------------------------------------

ARCHITECTURE = ROOT / "docs" / "architecture.md"
TREE_PACKAGES = ("bridge.core", "bridge.dispatch", "bridge.runner_support", "workers")  # listed module by module


def documented_tree() -> dict[str, set[str]]:
    """The tree block of docs/architecture.md: package path -> the modules it names (a package line with no module
    lines under it names none)."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    block = text.split("## The tree", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    tree: dict[str, set[str]] = {}
    package: str | None = None
    for line in block.splitlines():
        if not line.strip():
            continue
        head = line.split("  ", 1)[0] if not line.startswith(" ") else None
        if head is not None:
            package = head.strip().rstrip("/").replace("/", ".") if head.strip().endswith("/") else None
            if package is not None:
                tree.setdefault(package, set())
            continue
        if package is None or not line.startswith("  ") or line.startswith("    "):
            continue  # a continuation of a description
        names = line.strip().split("  ", 1)[0]
        if names.endswith("/"):
            tree.setdefault(f"{package}.{names.rstrip('/')}", set())
            continue
        tree[package].update(name.strip() for name in names.split(","))
    return tree


def modules_in(package: str) -> set[str]:
    return {
        name.rpartition(".")[2]
        for name, path in MODULES.items()
        if name.rpartition(".")[0] == package and path.name != "__init__.py"
    }


def packages_under(prefix: str) -> set[str]:
    return {name for name, path in MODULES.items() if path.name == "__init__.py" and within(name, prefix)}


def test_the_architecture_tree_names_every_module_of_the_listed_packages_and_no_other() -> None:
    """The tree in docs/architecture.md is checked against the code: every package of bridge.core, bridge.dispatch,
    bridge.runner_support and workers is a line, and names exactly the modules it holds."""
    tree = documented_tree()
    problems: list[str] = []
    for prefix in TREE_PACKAGES:
        for package in sorted(packages_under(prefix)):
            if package not in tree:
                problems.append(f"package {package} is not in the tree")
                continue
            documented, actual = tree[package], modules_in(package)
            if documented and documented != actual:
                problems += [f"{package}.{m}: in the tree, not in the code" for m in sorted(documented - actual)]
                problems += [f"{package}.{m}: in the code, not in the tree" for m in sorted(actual - documented)]
            elif not documented and actual and package in TREE_PACKAGES:
                problems.append(f"{package}: its modules are not listed")
    assert not problems, "docs/architecture.md's tree is out of date:\n" + "\n".join(problems)


def test_each_workers_package_says_what_it_is_in_its_first_docstring_line() -> None:
    for package in sorted(packages_under("workers")):
        doc = ast.get_docstring(ast.parse(MODULES[package].read_text(encoding="utf-8")))
        assert doc and doc.splitlines()[0].strip(), f"{package} has no docstring saying what it holds"


# --- the tests' own structure ------------------------------------------------------------------------------------

TESTS = ROOT / "tests"
PRODUCT = ("bridge", "workers", "webshop_env")
# How many private-name accesses on product objects the tests still make (``private_accesses``): a ceiling that only
# goes down, toward 10 (docs/test-suite.md, "How it runs": tests drive the product through its public surface); each
# left is a place where a test reaches past that surface, and a new need gets a documented public seam (a read-only
# property, a constructor argument, a public method) instead.
PRIVATE_ACCESS_CEILING = 5
ACCESSORS = ("getattr", "setattr", "delattr", "hasattr", "monkeypatch.setattr", "monkeypatch.delattr")


def test_modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "fakes" not in p.parts)


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def product_private_names() -> set[str]:
    """Every private name the product defines: functions, methods and classes, module and class attributes, and the
    attributes its objects set on themselves (``self._name``)."""
    names: set[str] = set()
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(node.name)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                    if node.value.id in ("self", "cls"):
                        names.add(node.attr)
                elif isinstance(node, ast.alias):
                    names.add((node.asname or node.name).rsplit(".", 1)[-1])
    return {name for name in names if is_private(name)}


def private_accesses(tree: ast.AST, product_names: set[str]) -> list[tuple[int, str]]:
    """``obj._name`` (and ``getattr``/``setattr``/``monkeypatch.setattr(obj, "_name", ...)``) where ``_name`` is one the
    product defines and ``obj`` is not the test's own ``self`` or ``cls``: the line and the expression."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr) and node.attr in product_names:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ACCESSORS and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value in product_names:
                found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_private_access_count_sees_attributes_accessors_and_not_self() -> None:
    tree = ast.parse(
        "d._lock.release()\nself._lock = 1\nmonkeypatch.setattr(m, '_sleep', f)\ngetattr(d, '_x')\nos._exit(0)\n"
    )
    assert private_accesses(tree, {"_lock", "_sleep", "_x"}) == [
        (1, "d._lock"),
        (3, "monkeypatch.setattr(m, '_sleep', f)"),
        (4, "getattr(d, '_x')"),
    ]


def test_tests_reach_past_the_products_public_surface_no_more_than_the_ceiling() -> None:
    """Tests drive the product through its public surface (documented properties, constructor arguments, public
    methods), so that a refactoring inside a class breaks no test that did not test it. Counted: in every module
    under tests/, each access to a private name (one underscore) the product (bridge/, workers/, webshop_env/) defines,
    on anything but the test's own ``self``/``cls``, as an attribute or through ``getattr``/``setattr``/
    ``monkeypatch.setattr``. A name a test's own class defines as well counts too (the check reads no types): the
    count is an upper bound. Lower ``PRIVATE_ACCESS_CEILING`` when a change removes accesses."""
    names = product_private_names()
    found = [
        f"{path.relative_to(ROOT)}:{line}: {expression}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, expression in private_accesses(ast.parse(path.read_text(), str(path)), names)
    ]
    assert len(found) <= PRIVATE_ACCESS_CEILING, "\n".join(found)


def defined_names(path: Path) -> dict[str, ast.stmt]:
    return {
        node.name: node
        for node in ast.parse(path.read_text(), str(path)).body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    }


def is_fake(name: str, node: ast.stmt | None) -> bool:
    """A class, a private function or a fixture: what a module builds its tests on (``tests/fakes``' rule)."""
    if node is None:
        return False
    if isinstance(node, ast.ClassDef) or is_private(name):
        return True
    return any("fixture" in ast.unparse(decorator) for decorator in getattr(node, "decorator_list", []))


def test_no_test_module_imports_another_test_modules_fakes() -> None:
    """Fakes live in ``tests/fakes/``. A test module (``tests/**/test_*.py``) imports from another test module no
    class (a fake or a stand-in agent), no private name (a builder such as ``_dispatcher``) and no fixture: what two
    modules share moves to ``tests/fakes/``, so that a test module can be renamed, split or deleted without breaking
    another. Shared helpers that are no fake (constants, public functions such as ``run_batch``) may stay where they
    are defined; modules outside ``test_*.py`` (``tests/helpers.py``, ``tests/loopback.py``, a ``conftest.py``) are
    helpers, not test modules, and anyone may import them."""
    modules = {module_name(path): path for path in test_modules()}
    wrong: list[str] = []
    for path in modules.values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or node.module not in modules or modules[node.module] == path:
                continue
            defined = defined_names(modules[node.module])
            wrong += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {alias.name} from {node.module}"
                for alias in node.names
                if is_fake(alias.name, defined.get(alias.name))
            ]
    assert not wrong, "\n".join(wrong)
