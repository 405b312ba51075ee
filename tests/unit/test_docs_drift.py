"""The user docs cannot drift from the code: every ``python -m bridge ...`` and ``celery -A workers ...`` command
they show parses against the real command line, every environment variable they name is a setting (or listed
here as another program's), every relative link and #anchor resolves, every section a source file or page cites
by title exists, no table cell is a wall of text, a long page opens with a table of contents, and the
architecture's CLI list is the CLI's. The docs and the product's docstrings state the current truth: no dated
history or run log in the docs, performance.md holds the latest figures within 400 lines, and no history marker
in the product's code."""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from celery.bin.celery import celery as celery_cli

from bridge import cli
from bridge.core.settings import Settings, env_name
from bridge_lab import configdoc

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [ROOT / "README.md", ROOT / "deploy" / "kubernetes" / "README.md", *(ROOT / "docs").glob("*.md")],
)
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
PERFORMANCE = ROOT / "docs" / "performance.md"
PERFORMANCE_MAX_LINES = 400
PRODUCT_DIRS = ("bridge", "workers", "webshop_env", "bridge_lab")
CITING = [
    *(
        path
        for folder in (*PRODUCT_DIRS, "tests")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != Path(__file__).resolve()  # its examples of citations
    ),
    *sorted((ROOT / "deploy").rglob("*.yaml")),
    ROOT / "docker-compose.yml",
]
"""Files whose comments and docstrings cite docs/ pages by section title (the pages themselves are in PAGES)."""
MAX_CELL = 300
GENERATED = ROOT / "docs" / "configuration.md"
"""Generated from the settings' descriptions (bridge_lab/configdoc.py): its cells are those descriptions."""
TOC_OVER_LINES = 200

FOREIGN_VARIABLES: dict[str, set[str]] = {
    "the shell, Python and the OS": {
        "PATH",
        "PYTHONPATH",
        "HOME",
        "VIRTUAL_ENV",
        "BASH_ENV",
        "PROMPT_COMMAND",
        "LD_PRELOAD",
    },
    "the OS's libraries (TLS, resolver, Ruby)": {
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "RES_OPTIONS",
        "GEM_HOME",
        "GEM_PATH",
    },
    "OpenTelemetry": {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"},
    "Celery": {"REMAP_SIGTERM"},
    "Flower": {"FLOWER_UNAUTHENTICATED_API"},
    "Agent Lightning (its runner roles; what 1.0 gives an agent program)": {
        "AGL_CURRENT_ROLE",
        "AGL_SERVER_HOST",
        "AGL_SERVER_PORT",
        "AGL_MANAGED_STORE",
        "AGL_EVENT_URL",
        "AGL_KEY",
        "AGL_OPENAI_BASE_URL",
    },
    "LiteLLM (behind 1.0's gateway)": {"LITELLM_LOCAL_MODEL_COST_MAP"},
    "the Dockerfile's build arguments, the Docker CLI and pip": {
        "PYTHON_BASE_IMAGE",
        "PYTHON312_BASE_IMAGE",
        "DOCKER_HOST",
        "DOCKER_BUILDKIT",
        "PIP_CERT",
    },
    "this repository's agent programs, WebShop server and test tools": {
        "WEBSHOP_TASK",
        "WEBSHOP_NOUNS",
        "AGL_V1_WHEEL",
        "AGL_DOCKER_ROOT",
        "AGL_PYTHON312_PREFIX",
        "AGL_WHEELHOUSE",
        "AGL_DEPLOYED_IMAGES",
        "AGL_DEPLOYED_BROKEN",
        "POLICY_LATENCY_MS",
        "PYTHON312",
        "CI",
        "TEST_REDIS_URL",
        "CHAOS_SLOW",
        "CLUSTER_SLOW",
    },
}
"""Variables the docs may name that another program reads, not ``bridge/core/settings/``, by owner. The
variables of docker compose, Flower and prometheus_client are ``FOREIGN`` in bridge_lab/configdoc.py."""

NOT_VARIABLES = {
    "PR_SET_PDEATHSIG",
    "CAP_NET_ADMIN",
    "CAP_SETUID",
    "CAP_SETGID",
    "CAP_SETPCAP",
    "CAP_KILL",
    "CAP_SYS_ADMIN",
    "SYS_ADMIN",  # the same capability as docker compose and Kubernetes spell it
    "SO_LINGER",
    "PRECONDITION_FAILED",
    "BYPASS_S",
    "KEEPALIVE_S",
}
"""ALL_CAPS names in the docs that are no environment variable: constants of Linux, AMQP and this code."""

FENCE = re.compile(r"^```([a-z]*)\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
BRIDGE_COMMAND = re.compile(r"(?:^|[\s/])python3? -m bridge(?=\s|$)(.*)")
CELERY_COMMAND = re.compile(r"(?:^|\s)celery -A workers(?=\s)(.*)")
VARIABLE = re.compile(r"\b([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+)\b")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6}) (.+?)\s*$", re.M)
SHELL_LANGUAGES = {"bash", "sh", "shell", "console", ""}


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _without_fences(text: str) -> str:
    return FENCE.sub("", text)


def _command_lines(path: Path) -> Iterator[tuple[str, bool]]:
    """Shell lines of ``path`` and whether each is a whole command: the lines of its shell code blocks
    (continuations joined) and, for an example module, its docstring's indented lines are; an inline code span
    may be a mention (`python -m bridge autoscale`, a flag without its value)."""
    text = _text(path)
    if path.suffix == ".py":
        docstring = text.split('"""')[1] if '"""' in text else ""
        yield from ((line.strip(), True) for line in docstring.splitlines() if line.startswith("    "))
        return
    for language, body in FENCE.findall(text):
        if language in SHELL_LANGUAGES:
            yield from ((line, True) for line in body.replace("\\\n", " ").splitlines())
    for span in INLINE.findall(_without_fences(text)):
        yield span, False


def _words(rest: str) -> list[str]:
    """The arguments after the program: up to the first shell operator or comment; placeholders end them too."""
    rest = re.split(r"\s(?:&&|\|\||\||;|&|#)(?:\s|$)|[;&|]\s*$|\s#", " " + rest)[0]
    words = shlex.split(rest)
    cut = next((i for i, word in enumerate(words) if word in {"...", "…"} or word.startswith("<")), len(words))
    return words[:cut]


def _commands(pattern: re.Pattern[str]) -> list[tuple[str, list[str], bool]]:
    found = []
    for path in [*PAGES, *EXAMPLES]:
        for line, whole in _command_lines(path):
            match = pattern.search(line)
            if match:
                found.append((_name(path), _words(match.group(1)), whole))
    return found


BRIDGE_COMMANDS = _commands(BRIDGE_COMMAND)
CELERY_COMMANDS = _commands(CELERY_COMMAND)


def test_the_docs_show_commands_to_check() -> None:
    assert len(BRIDGE_COMMANDS) > 20 and len(CELERY_COMMANDS) > 5


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None


def _mention_problem(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    """A mention names a real subcommand and only options it has (values and required arguments may be left out)."""
    if args and not args[0].startswith("-"):
        found = _subparser(parser, args[0])
        if found is None:
            return f"no command {args[0]!r}"
        parser, args = found, args[1:]
    unknown = [word.split("=")[0] for word in args if word.startswith("-")]
    unknown = [name for name in unknown if name not in parser._option_string_actions]
    return f"no option {unknown}" if unknown else None


@pytest.mark.parametrize(("page", "args", "whole"), BRIDGE_COMMANDS, ids=lambda value: str(value)[:60])
def test_every_bridge_command_parses(page: str, args: list[str], whole: bool) -> None:
    """A command in a code block parses as given; one named inline names a real command and real options."""
    command = args[0] if args and args[0] in cli.TOOLS else None
    parser = cli.build_parser(command)
    shown = f"`python -m bridge {shlex.join(args)}`"
    if not whole:
        problem = _mention_problem(parser, args)
        assert problem is None, f"{page}: {shown}: {problem}"
        return
    try:
        parser.parse_args(args)
    except SystemExit as stop:
        pytest.fail(f"{page}: {shown} does not parse (exit {stop.code})")


def _options(command: click.Command) -> dict[str, bool]:
    """Option name -> whether it takes a value."""
    names: dict[str, bool] = {"--help": False}
    for param in command.params:
        if isinstance(param, click.Option):
            for name in [*param.opts, *param.secondary_opts]:
                names[name] = not (param.is_flag or param.count)
    return names


def _check_options(command: click.Command, args: list[str]) -> list[str]:
    """Options in ``args`` that ``command`` does not declare; the words left after the options."""
    known = _options(command)
    rest, i = [], 0
    while i < len(args):
        word = args[i]
        if word.startswith("-") and word != "-":
            name = word.split("=", 1)[0]
            if name not in known and not (len(name) > 2 and name[:2] in known and not name.startswith("--")):
                raise click.UsageError(f"no such option {name}")
            takes_value = known.get(name, True)
            i += 2 if takes_value and "=" not in word and name in known else 1
            continue
        rest.append(word)
        i += 1
    return rest


@pytest.mark.parametrize(("page", "args", "whole"), CELERY_COMMANDS, ids=lambda value: str(value)[:60])
def test_every_celery_command_names_a_real_subcommand_and_options(page: str, args: list[str], whole: bool) -> None:
    """Celery's own options before the subcommand, then the subcommand's (unless it passes unknown ones on, as
    ``flower`` does to Flower)."""
    ctx = click.Context(celery_cli)
    group_options, position = _options(celery_cli), 0
    while position < len(args) and args[position].startswith("-"):
        position += 2 if group_options.get(args[position], False) else 1
    try:
        _check_options(celery_cli, args[:position])
        assert position < len(args), "no subcommand"
        subcommand = celery_cli.get_command(ctx, args[position])
        assert subcommand is not None, f"no celery subcommand {args[position]!r}"
        if not subcommand.context_settings.get("ignore_unknown_options"):
            _check_options(subcommand, args[position + 1 :])
    except (click.UsageError, AssertionError) as error:
        pytest.fail(f"{page}: `celery -A workers {shlex.join(args)}`: {error}")


def test_a_wrong_command_is_caught() -> None:
    """The checks above would catch a renamed flag or subcommand."""
    with pytest.raises(SystemExit):
        cli.build_parser("demo").parse_args(["demo", "--no-such-flag"])
    with pytest.raises(click.UsageError):
        _check_options(celery_cli.get_command(click.Context(celery_cli), "worker"), ["--concurency", "8"])


def _settings_variables() -> set[str]:
    return {env_name(field) for field in Settings.model_fields}


def _named_variables(text: str) -> set[str]:
    """ALL_CAPS names in code (fenced blocks, inline spans): what a user would set or read."""
    code = [body for _language, body in FENCE.findall(text)] + INLINE.findall(_without_fences(text))
    return {name for chunk in code for name in VARIABLE.findall(chunk)}


def test_every_variable_the_docs_name_is_a_setting_or_another_programs() -> None:
    compose_and_others = {variable.name for group in configdoc.FOREIGN.values() for variable in group}
    known = _settings_variables() | compose_and_others | set().union(*FOREIGN_VARIABLES.values()) | NOT_VARIABLES
    unknown = {}
    for path in PAGES:
        missing = sorted(_named_variables(_text(path)) - known)
        if missing:
            unknown[_name(path)] = missing
    assert not unknown, f"named in the docs but neither a setting nor in FOREIGN_VARIABLES: {unknown}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for _level, heading in HEADING.findall(_without_fences(_text(path))):
        slug = _slug(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for path in PAGES:
        for target in LINK.findall(_without_fences(_text(path))):
            if re.match(r"^[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{_name(path)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{_name(path)}: {target} (no such heading)")
    assert not broken, "broken links: " + "; ".join(broken)


def test_the_link_check_sees_a_broken_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A `page`: one\n\n## Second part\n", encoding="utf-8")
    assert _anchors(page) == {"a-page-one", "second-part"}


def _table_cells(text: str) -> Iterator[str]:
    for line in _without_fences(text).splitlines():
        if line.startswith("|"):
            yield from (cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|")))


def test_no_table_cell_is_a_wall_of_text() -> None:
    long = [
        f"{_name(path)}: {cell[:60]}... ({len(cell)} characters)"
        for path in PAGES
        if path != GENERATED
        for cell in _table_cells(_text(path))
        if len(cell) > MAX_CELL
    ]
    assert not long, f"table cells over {MAX_CELL} characters (a paragraph belongs below the table): {long}"


def test_a_long_page_opens_with_a_table_of_contents() -> None:
    """A page over 200 lines has a "Contents" heading whose links name every one of its ``##`` sections."""
    problems = []
    for path in PAGES:
        text = _text(path)
        if len(text.splitlines()) <= TOC_OVER_LINES:
            continue
        parts = re.split(r"^## Contents\s*$", text, maxsplit=1, flags=re.M)
        if len(parts) < 2:
            problems.append(f"{_name(path)}: no '## Contents'")
            continue
        toc = re.split(r"^## ", parts[1], maxsplit=1, flags=re.M)[0]
        linked = {target.lstrip("#") for target in LINK.findall(toc)}
        sections = {_slug(h) for level, h in HEADING.findall(_without_fences(text)) if level == "##"} - {"contents"}
        if sections - linked:
            problems.append(f"{_name(path)}: contents miss {sorted(sections - linked)}")
    assert not problems, "; ".join(problems)


def test_the_architecture_lists_every_cli_command() -> None:
    text = _text(ROOT / "docs" / "architecture.md")
    match = re.search(r"`python -m bridge \[([a-z0-9|-]+)\]`", text)
    assert match, "docs/architecture.md lists no `python -m bridge [a|b|...]`"
    listed = set(match.group(1).split("|"))
    parser = cli.build_parser()
    actions = [action for action in parser._actions if action.dest == "command"]
    commands = set(actions[0].choices or {})
    assert listed == commands, f"listed but no such command: {listed - commands}; missing: {commands - listed}"


MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
DOC_HISTORY = re.compile(
    r"where the targets st(?:ood|and)|\b(?:this|last|later|next|that|previous) session\b"
    r"|\bthe session (?:before|after)\b|\bthis week\b|\ba release ago\b|\bbefore the fix(?:es)?\b"
    r"|\bthe code before\b|\bfixed since\b|\bas before\b"
    rf"|\b20\d\d-[01]\d-[0-3]\d\b|\b(?:{MONTHS})(?: \d{{1,2}},)? 20\d\d\b",
    re.IGNORECASE,
)
"""What makes a page a log: a dated section, a figure "from this session", a "before the fix". What changed and why
belongs in the commit history; a page states what holds now."""

CODE_HISTORY = re.compile(
    r"\bas before\b|\b(?:it|we|they|this|that|which|each|every) used to\b|\bpreviously\b|\bolder messages\b"
    r"|% of a worker\b|\bprofiled\b|\bpy-spy\b|\b(?:this|last) session\b|\bthis week\b|\bbefore the fix\b"
    r"|\bthe code before\b|\ba release ago\b|\bwas measured\b|where the targets st",
    re.IGNORECASE,
)
"""History markers a product docstring or comment must not carry: it states the contract (what the code does, what
it guarantees, why), and a measured figure lives in docs/performance.md, which the code cites."""

HISTORY_OWNED_ELSEWHERE: set[tuple[str, str]] = set()
CITATIONS_OWNED_ELSEWHERE: set[tuple[str, str]] = set()
"""Known findings in modules that another change in flight rewrites (the one dispatcher): (file, marker or cited
title). Each must still be found, so an entry goes as soon as its file is fixed."""

CITATION = re.compile(
    r"\b(?:docs/)?([a-z0-9-]+\.md)(?:,| \(|, section)\s*\"([^\"]{2,200})\"(?: in (?:docs/)?([a-z0-9-]+\.md))?"
)


def _flat(text: str) -> str:
    """A source file's text with comment markers at line starts dropped and all whitespace one space, so that a
    cited title or a phrase wrapped over lines reads whole."""
    return re.sub(r"\s+", " ", re.sub(r"\n[ \t]*#[ \t]?", "\n", text))


def _plain(text: str) -> str:
    return re.sub(r"[`*_]", "", re.sub(r"\s+", " ", text)).strip().lower()


def _titles(page: Path) -> tuple[list[str], list[str]]:
    """A page's headings and the bold lead-ins of its paragraphs and bullets, as plain lower-case text."""
    text = _text(page)
    headings = [_plain(heading) for _level, heading in HEADING.findall(_without_fences(text))]
    return headings, [_plain(lead) for lead in re.findall(r"\*\*([^*]+?)\*\*", text)]


def _cited_sections(path: Path) -> Iterator[tuple[str, str]]:
    """(page, title) for each section ``path`` cites by title: ``docs/<page>.md, "Title"``, ``<page>.md ("Title")``."""
    for page, title, other in CITATION.findall(_flat(_text(path))):
        yield other or page, title


def _missing_section(page: str, title: str) -> bool:
    """Whether docs/``page`` has no heading containing ``title`` and no bold lead-in starting with it."""
    target = ROOT / "docs" / page
    if not target.is_file():
        return True
    headings, leads = _titles(target)
    wanted = _plain(title)
    return not any(wanted in heading for heading in headings) and not any(lead.startswith(wanted) for lead in leads)


def test_every_section_cited_by_title_exists() -> None:
    """A comment, docstring or page that sends the reader to a section by its title names one that is there."""
    found, broken, elsewhere = 0, [], set()
    for path in [*CITING, *PAGES]:
        for page, title in _cited_sections(path):
            found += 1
            if (_name(path), title) in CITATIONS_OWNED_ELSEWHERE:
                elsewhere.add((_name(path), title))
            elif _missing_section(page, title):
                broken.append(f"{_name(path)}: docs/{page}, {title!r}")
    assert found > 40, f"only {found} citations by title found: has the citation pattern stopped matching?"
    assert not broken, "cited sections that do not exist: " + "; ".join(broken)
    fixed = CITATIONS_OWNED_ELSEWHERE - elsewhere
    assert not fixed, f"no longer cited, drop them from CITATIONS_OWNED_ELSEWHERE: {sorted(fixed)}"


def test_the_citation_check_sees_a_missing_section() -> None:
    text = 'Figures: docs/performance.md, "Where the\n    # targets stood" and operations.md ("Choosing a pool")'
    assert CITATION.findall(_flat(text)) == [
        ("performance.md", "Where the targets stood", ""),
        ("operations.md", "Choosing a pool", ""),
    ]
    assert _missing_section("performance.md", "No section has this title")
    assert _missing_section("no-such-page.md", "Latest figures")
    assert not _missing_section("operations.md", "choosing a POOL")
    assert not _missing_section("architecture.md", "Handing a rollout back")  # a bold lead-in


def test_the_performance_page_holds_the_latest_figures_only() -> None:
    """performance.md: the latest figure of each benchmark and the command that reproduces it, within 400 lines."""
    lines = len(_text(PERFORMANCE).splitlines())
    assert lines <= PERFORMANCE_MAX_LINES, f"docs/performance.md has {lines} lines (at most {PERFORMANCE_MAX_LINES})"
    assert "## Latest figures" in _text(PERFORMANCE)


def test_no_page_is_a_log() -> None:
    found = [
        f"{_name(path)}:{number}: {match.group(0)!r}"
        for path in PAGES
        for number, line in enumerate(_text(path).splitlines(), 1)
        for match in DOC_HISTORY.finditer(line)
    ]
    assert not found, "dated history or run-log phrases in the docs (the commit history keeps them): " + "; ".join(
        found
    )


def _code_history(path: Path) -> list[str]:
    return sorted({match.group(0).lower() for match in CODE_HISTORY.finditer(_flat(_text(path)))})


def test_product_code_states_contracts_not_history() -> None:
    found, elsewhere = [], set()
    for folder in PRODUCT_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for marker in _code_history(path):
                if (_name(path), marker) in HISTORY_OWNED_ELSEWHERE:
                    elsewhere.add((_name(path), marker))
                else:
                    found.append(f"{_name(path)}: {marker!r}")
    assert not found, "history in product docstrings or comments (state the contract instead): " + "; ".join(found)
    fixed = HISTORY_OWNED_ELSEWHERE - elsewhere
    assert not fixed, f"no longer found, drop them from HISTORY_OWNED_ELSEWHERE: {sorted(fixed)}"


def test_the_history_checks_see_a_marker() -> None:
    assert DOC_HISTORY.search("### Where the targets stood (December 2, 2026)")
    assert DOC_HISTORY.search("a fresh-clone CI run of 2026-12-03 counted one")
    assert not DOC_HISTORY.search("the latest fresh-clone CI run: 788 s")
    assert CODE_HISTORY.search("Profiled at 0 ms, create spent ~40% of a worker's CPU")
    assert CODE_HISTORY.search("absent in older messages")
    assert not CODE_HISTORY.search("a key used to sign the token; the lease older than its holder")
