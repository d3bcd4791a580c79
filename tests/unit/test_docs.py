"""The README and the documentation site agree with the tree: the README stays short, its
links lead to files that exist, and every page under docs/ is in the site's navigation (a
page left out of mkdocs.yml's nav is unreachable; `make docs` checks the links between
pages). The references agree with the code both ways, over every package of the service:
settings with their defaults and bounds, error codes each in its own row, routes, and the
commands, flags and make targets the pages name."""

from __future__ import annotations

import ast
import importlib.util
import math
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from batching.problems import Problem
from tests.support.python_source import parse as parse_source

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _nav_pages(node: object) -> set[str]:
    if isinstance(node, str):
        return {node}
    if isinstance(node, list):
        return set().union(*(_nav_pages(item) for item in node))
    if isinstance(node, dict):
        return set().union(*(_nav_pages(value) for value in node.values()))
    return set()


def test_the_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES


def test_the_readme_links_lead_to_files_of_the_tree() -> None:
    targets = LINK.findall((ROOT / "README.md").read_text())
    assert targets  # it links the documentation
    relative = [t for t in targets if "://" not in t]
    missing = [t for t in relative if not (ROOT / t).exists()]
    assert missing == []


def test_every_page_is_in_the_navigation() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert pages - nav == set()
    assert nav - pages == set()


# Read by the service but not settings of an operator's: the WSGI environment's PATH_INFO,
# and the directory where the test and benchmark stacks learn that every web process booted.
NOT_SETTINGS = {"PATH_INFO", "WEB_READY_DIR", "XDG_CACHE_HOME"}  # the last: a standard of the OS
# Every first-party package of the tree, found rather than listed: a new app is scanned the
# day it lands. The benchmarks and the tests read settings of their own (BENCH_*, REQUIRE_*),
# documented with them, not the service's.
FIRST_PARTY = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
SERVICE_PACKAGES = [package for package in FIRST_PARTY if package not in ("bench", "tests")]
CONFIGURATION_PAGE = ROOT / "docs" / "reference" / "configuration.md"


def _settings_read() -> dict[str, str]:
    """Every environment variable the service's code reads, with a file that reads it: the
    first argument of config.env's readers (and of the settings' policy readers),
    of os.environ.get and os.getenv, and os.environ[...]."""
    found: dict[str, str] = {}
    files = [path for package in SERVICE_PACKAGES for path in (ROOT / package).rglob("*.py")]
    for path in files:
        for node in ast.walk(parse_source(path.read_text())):
            name = None
            if isinstance(node, ast.Call) and node.args:
                function = ast.unparse(node.func)
                reader = function.rsplit(".", 1)[-1]
                if reader.startswith(("env_", "_policy_")) or function in (
                    "os.environ.get", "environ.get", "os.getenv",
                ):  # fmt: skip
                    name = node.args[0]
            elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
                name = node.slice
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                found.setdefault(name.value, str(path.relative_to(ROOT)))
    return found


def _settings_documented() -> set[str]:
    """The names in the first cell of each row of the configuration reference's tables."""
    names: set[str] = set()
    for line in CONFIGURATION_PAGE.read_text().splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            names.update(re.findall(r"`([A-Z][A-Z0-9_]+)`", first_cell))
    return names


def test_every_setting_the_code_reads_is_in_the_configuration_reference() -> None:
    read = _settings_read()
    assert len(read) > 30  # the scan found the settings module's readers
    undocumented = {name: path for name, path in read.items() if name not in NOT_SETTINGS}
    for name in _settings_documented():
        undocumented.pop(name, None)
    assert undocumented == {}


def test_every_documented_setting_is_read_by_the_code() -> None:
    assert _settings_documented() - set(_settings_read()) == set()


# config.env's readers whose second argument is the default.
READERS_WITH_DEFAULT = {
    "env_str", "env_int", "env_float", "env_bool", "env_choice", "env_list", "env_name", "env_text",
}  # fmt: skip
# Defaults and bounds that are no operator's: devstack's test stack picks a free port.
NOT_DEFAULTS = {("devstack/stack.py", "PORT")}
UNKNOWN = object()  # a default or bound the scan cannot know without running the process


@dataclass(frozen=True)
class Reading:
    """One reading of a setting in the code: its default and bounds, each UNKNOWN unless a
    literal (or a constant of the module, or the policy's default and bounds)."""

    path: str
    default: object
    minimum: object = None
    maximum: object = None


def _readings() -> dict[str, list[Reading]]:
    """Every call of config.env's readers (and the settings' policy readers) whose default is
    a literal, by the setting it reads."""
    from batching.policy import BOUNDS, Policy

    found: dict[str, list[Reading]] = {}
    for package in SERVICE_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            tree = parse_source(path.read_text())
            namespace = _constants(path, tree)
            name = str(path.relative_to(ROOT))
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and len(node.args) >= 2):
                    continue
                reader = ast.unparse(node.func).rsplit(".", 1)[-1]
                variable = node.args[0]
                if not isinstance(variable, ast.Constant) or (name, variable.value) in NOT_DEFAULTS:
                    continue
                if reader.startswith("_policy_") and isinstance(node.args[1], ast.Constant):
                    field = str(node.args[1].value)
                    low, high = BOUNDS[field]
                    reading = Reading(name, getattr(Policy(), field), low, high)
                elif reader in READERS_WITH_DEFAULT:
                    bounds = {k.arg: _value(k.value, namespace) for k in node.keywords}
                    reading = Reading(name, _value(node.args[1], namespace),
                                      bounds.get("minimum"), bounds.get("maximum"))  # fmt: skip
                else:
                    continue
                found.setdefault(str(variable.value), []).append(reading)
    return found


def _constants(path: Path, tree: ast.Module) -> dict[str, Any]:
    """The module's namespace when it is imported already (the settings are), less the names
    it binds from a setting: a default built on another setting is no literal."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    namespace = dict(vars(sys.modules[module])) if module in sys.modules else {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and "env_" in ast.unparse(node.value):
            for target in node.targets:
                namespace.pop(ast.unparse(target), None)
    return namespace


def _value(node: ast.expr, namespace: dict[str, Any]) -> object:
    """The expression's value when it calls nothing and names only constants; else UNKNOWN."""
    if any(isinstance(part, ast.Call | ast.JoinedStr) for part in ast.walk(node)):
        return UNKNOWN  # a call's value, or a path in an f-string, is the machine's
    names = {part.id for part in ast.walk(node) if isinstance(part, ast.Name)}
    if not names <= set(namespace):
        return UNKNOWN
    return eval(compile(ast.Expression(node), "<default>", "eval"), dict(namespace))  # noqa: S307


def _configuration_rows() -> dict[str, tuple[str, str]]:
    """Each setting of the configuration reference, with its default and bounds as the table
    writes them. A row of several settings gives each its part of those cells (`8000` /
    `127.0.0.1`; `32`, `0`, `1`, none)."""
    rows: dict[str, tuple[str, str]] = {}
    for line in CONFIGURATION_PAGE.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        names = re.findall(r"`([A-Z][A-Z0-9_]+)`", cells[0])
        defaults, bounds = (_parts(cells[i], len(names)) for i in (1, 2))
        rows.update(zip(names, zip(defaults, bounds, strict=True), strict=True))
    return rows


def _parts(cell: str, count: int) -> list[str]:
    if count == 1:
        return [cell]
    parts = re.split(r", | / ", cell)
    return parts if len(parts) == count else [cell] * count


def _documented_values(cell: str) -> list[object]:
    """What a default cell may mean: each value in code font, and off, on, none or empty when
    the cell starts with that word."""
    values: list[object] = re.findall(r"`([^`]*)`", cell)
    word = cell.split(" ", 1)[0].rstrip(":,;")
    words: dict[str, list[object]] = {
        "off": [False], "on": [True], "none": ["", []], "empty": ["", []],
    }  # fmt: skip
    values += words.get(word, [])
    return values


def _same(code: object, documented: object) -> bool:
    if isinstance(documented, str) and isinstance(code, bool):
        return documented.lower() in (("1", "true", "on") if code else ("0", "false", "off"))
    if isinstance(documented, str) and isinstance(code, int | float):
        try:
            return math.isclose(float(documented.replace(",", "")), code)
        except ValueError:
            return False
    if isinstance(documented, str) and isinstance(code, list):
        return documented == ",".join(code)
    if isinstance(documented, str) and isinstance(code, str):
        return documented.lower() == code.lower()  # LOG_LEVEL: INFO for Django, info for Celery
    return documented == code


def test_every_literal_default_is_the_configuration_references() -> None:
    rows = _configuration_rows()
    readings = _readings()
    assert {"SAMPLING_DEADLINE_MS", "WEB_LIMIT_REQUEST_LINE"} <= set(readings)  # scanned
    wrong = {}
    for name, found in readings.items():
        for reading in found:
            if reading.default is UNKNOWN or name not in rows:
                continue  # a default that depends on the machine or another setting
            documented = _documented_values(rows[name][0])
            if not any(_same(reading.default, value) for value in documented):
                wrong[name] = (reading.path, reading.default, rows[name][0][:60])
    assert wrong == {}


def _bounds_text(minimum: object, maximum: object) -> str:
    def number(value: object) -> str:
        return f"{value:g}" if isinstance(value, float) else str(value)

    if minimum is not None and maximum is not None:
        return f"{number(minimum)} to {number(maximum)}"
    if minimum is not None:
        return f"at least {number(minimum)}"
    return "" if maximum is None else f"at most {number(maximum)}"


def test_the_configuration_reference_gives_each_settings_bounds() -> None:
    """The bounds column says what the readers' minimum and maximum say, as `1` to `100`,
    at least `1` or at most `64` (a note in parentheses may follow), and no more."""
    rows = _configuration_rows()
    expected: dict[str, set[str]] = {}
    for name, found in _readings().items():
        for reading in found:
            if UNKNOWN not in (reading.minimum, reading.maximum):
                expected.setdefault(name, set()).add(_bounds_text(reading.minimum, reading.maximum))
    assert "1 to 100" in expected["SAMPLING_MAX_BATCH_SIZE"]  # the policy's bounds are read
    documented = {
        name: bounds.split(" (", 1)[0].replace("`", "").replace(",", "").strip()
        for name, (_, bounds) in rows.items()
    }
    documented = {name: "" if text == "none" else text for name, text in documented.items()}
    wrong = {name: (texts, documented.get(name)) for name, texts in expected.items()
             if texts != {documented.get(name)}}  # fmt: skip
    assert wrong == {}
    unbounded = {name for name, text in documented.items() if text and name not in expected}
    assert unbounded == set()


ERRORS_PAGE = ROOT / "docs" / "reference" / "errors.md"


def _error_names_in_code() -> dict[str, set[str]]:
    """Every error the API can answer, by kind: the /v1 `code`s, the /v1 `type`s, and the
    /api/inference names. They come from the table of problems, the lines an offline job
    leaves unanswered, and the constants the request checks pass as a code or an error type
    (`code=`, a `code` parameter's default, a `"code"` key of an error's dict, openai_error's
    type and code, an `..._error` type literal) in every package of the service."""
    from offline.finish import UNANSWERED

    names: dict[str, set[str]] = {"code": set(), "type": set(), "inference": set()}
    for problem in Problem:
        names["code"].add(problem.openai_code)
        names["type"].add(problem.openai_type)
        names["inference"].add(problem.inference_error)
    names["code"].update(code for code, _ in UNANSWERED.values())
    for package in SERVICE_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(parse_source(path.read_text())):
                for name in _error_names_of(node):
                    names["type" if name.endswith("_error") else "code"].add(name)
    return names


def _error_names_of(node: ast.AST) -> set[str]:
    values: list[ast.expr | None] = []
    if isinstance(node, ast.Call):
        values += [k.value for k in node.keywords if k.arg in ("code", "error_type")]
        if ast.unparse(node.func).endswith("openai_error"):
            values += node.args[2:5:2]
    elif isinstance(node, ast.arguments):
        positional = reversed(node.posonlyargs + node.args)
        defaults = zip(positional, reversed(node.defaults), strict=False)
        keywords = zip(node.kwonlyargs, node.kw_defaults, strict=True)
        values += [default for arg, default in [*defaults, *keywords] if arg.arg == "code"]
    elif isinstance(node, ast.Dict):  # {"code": ..., "message": ...}
        for key, value in zip(node.keys, node.values, strict=True):
            if isinstance(key, ast.Constant) and key.value == "code":
                # "invalid_line" if ... else "invalid_file": both
                values += [value.body, value.orelse] if isinstance(value, ast.IfExp) else [value]
    elif isinstance(node, ast.Constant) and re.fullmatch(r"[a-z]+_error", str(node.value)):
        values.append(node)
    return {v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)}


def _error_rows() -> list[list[str]]:
    """The errors reference's table rows, as their cells."""
    rows = []
    for line in ERRORS_PAGE.read_text().splitlines():
        if line.startswith("|") and not re.fullmatch(r"[|\s:-]+", line):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _names(cell: str) -> set[str]:
    return set(re.findall(r"`([A-Za-z_]+)`", cell))


def test_every_error_code_and_status_has_its_row_in_the_errors_reference() -> None:
    """Each /v1 code and /api/inference name of the code is the first cell of a row of the
    errors reference (a mention in passing does not count), and each /v1 type is in a row."""
    names = _error_names_in_code()
    assert {"invalid_json", "unknown_url", "batch_failed", "token_limit_exceeded"} <= names["code"]
    assert "not_found_error" in names["type"]  # the scans see them
    rows = _error_rows()
    first_cells = set().union(*(_names(row[0]) for row in rows))
    in_rows = set().union(*(_names(cell) for row in rows for cell in row))
    assert names["code"] - first_cells == set()
    assert names["inference"] - first_cells == set()
    assert names["type"] - in_rows == set()
    statuses = {cell for row in rows for cell in row if re.fullmatch(r"\d{3}", cell)}
    assert {str(problem.status) for problem in Problem} - statuses == set()


def test_every_error_the_errors_reference_lists_is_one_of_the_code() -> None:
    """The other way: a row's code, name or type that the code never answers is a stale one."""
    names = set().union(*_error_names_in_code().values())
    rows = _error_rows()
    assert len(rows) > 20  # the tables are read
    header_words = {"status", "code", "type", "name", "when"}
    listed = set().union(*(_names(row[0]) for row in rows)) - header_words
    listed |= {name for row in rows for name in _names(" ".join(row)) if name.endswith("_error")}
    assert listed - names == set()


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _code_lines(text: str) -> list[str]:
    """What the page shows as code: inline code spans, fenced blocks and indented lines."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):
            lines.append(line)
        else:
            lines += re.findall(r"`([^`]+)`", line)
    return lines


def _module_sources(module: str) -> str:
    """The source of a module, or of every file of a package."""
    spec = importlib.util.find_spec(module)
    assert spec is not None, module
    assert spec.origin is not None, module
    origin = Path(spec.origin)
    files = sorted(origin.parent.rglob("*.py")) if origin.name == "__init__.py" else [origin]
    return "\n".join(path.read_text() for path in files)


def _commands_named() -> dict[str, set[str]]:
    """Each `python -m MODULE`, `python -m bench NAME` and `manage.py COMMAND` the documents
    show, as the module that runs it, with the flags shown beside it."""
    found: dict[str, set[str]] = {}
    for document in _documents():
        for line in _code_lines(document.read_text()):
            for match in re.finditer(
                r"python -m ([\w.]+)(?: ([a-z_]+))?|manage\.py ([a-z_]+)", line
            ):
                module, name, command = match.groups()
                if command is not None:
                    module = _management_command(command)
                elif module == "bench" and name is not None:
                    module = f"bench.{name}"
                rest = line[match.end() :].split("python -m", 1)[0].split("manage.py", 1)[0]
                found.setdefault(module, set()).update(re.findall(r"(--[a-z][a-z-]*)", rest))
    return found


def _management_command(command: str) -> str:
    """The module of a `manage.py` command: one of the installed apps' (ours, Django's and the
    third-party apps'), as Django itself finds them. A command no app has fails the test."""
    from django.core.management import get_commands

    if command == "help":  # manage.py's own, not an app's
        return "django.core.management"
    app = get_commands().get(command)
    assert app is not None, f"manage.py {command}: no installed app has this command"
    return f"{app}.management.commands.{command}"


def test_every_make_target_the_documents_name_exists() -> None:
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    named = {target for document in _documents()
             for line in _code_lines(document.read_text())
             for target in re.findall(r"(?:^|\s|;)make ([a-z][\w-]*)", line)}  # fmt: skip
    assert {"run", "test", "docs"} <= named
    assert named - targets == set()


def _retired_benchmarks() -> dict[str, str]:
    """The retired benchmarks' table in docs/benchmarks/index.md: each name and the last commit
    that holds its script."""
    text = (ROOT / "docs" / "benchmarks" / "index.md").read_text()
    table = text.split("## Retired benchmarks", 1)[1]
    return dict(re.findall(r"\| `(\w+)` \| `([0-9a-f]{7,40})` \|", table))


def test_every_module_and_flag_the_documents_name_exists() -> None:
    commands = _commands_named()
    assert "bench.gap" in commands  # the scan sees the benchmarks' commands
    retired = {f"bench.{name}" for name in _retired_benchmarks()}
    wrong = {}
    for module, flags in commands.items():
        if module in ("pytest", "gunicorn", "pip") or module.startswith("django."):
            continue  # third-party commands
        if module.split(".")[0] in sys.stdlib_module_names:
            continue  # the standard library's (python -m json.tool)
        if module in retired:
            continue  # its script is at the commit the retired table names (checked below)
        source = _module_sources(module)
        unknown = {flag for flag in flags - {"--help"} if f'"{flag}"' not in source}
        if unknown:
            wrong[module] = unknown
    assert wrong == {}


def test_each_retired_benchmark_is_gone_and_its_commit_holds_its_script() -> None:
    retired = _retired_benchmarks()
    assert "farm" in retired  # the table is read
    shallow = subprocess.run(
        ["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    if shallow != "false":
        pytest.skip(f"the checkout's history is needed (git says shallow: {shallow!r})")
    missing = {}
    for name, commit in retired.items():
        assert importlib.util.find_spec(f"bench.{name}") is None, name
        listing = subprocess.run(
            ["git", "ls-tree", "--name-only", commit, "bench/"], cwd=ROOT, capture_output=True,
            text=True,
        ).stdout.split()  # fmt: skip
        if f"bench/{name}.py" not in listing and f"bench/{name}" not in listing:
            missing[name] = commit
    assert missing == {}


# Pages that report a measurement: their command, machine and date lines name commits and
# dates (so does the changelog, CHANGELOG.md, included by docs/changelog.md).
MEASUREMENT_PAGES = ("docs/benchmarks/", "docs/gpu-report.md")
WORK_ITEM = re.compile(r"\bissues? \d+|\b(this|the) issue\b|\bwork item", re.I)
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _prose(text: str) -> str:
    """The text but its code: fenced and indented blocks, inline code spans (example values
    such as a request's ?date= are code)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and not line.startswith("    "):
            kept.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def test_no_page_names_a_work_item_and_only_measurements_name_commits_and_dates() -> None:
    found = {}
    for document in _documents():
        name = str(document.relative_to(ROOT))
        text = document.read_text()
        wrong = [match.group(0) for match in WORK_ITEM.finditer(text)]
        if not name.startswith(MEASUREMENT_PAGES):
            wrong += [m.group(0) for m in COMMIT.finditer(text)] + DATE.findall(_prose(text))
        if wrong:
            found[name] = wrong
    assert found == {}


def _routes() -> set[str]:
    """Every URL the service routes, as the docs write it (/v1/models/{id}); the API's
    catch-all for unknown /v1/ paths aside (its 404 is in the errors reference)."""
    from django.urls import URLPattern, URLResolver, get_resolver

    def walk(patterns: list[Any], prefix: str) -> set[str]:
        found: set[str] = set()
        for pattern in patterns:
            if pattern.pattern.regex.pattern == "^v1/":
                continue
            if isinstance(pattern, URLResolver) and pattern.app_name != "admin":
                found |= walk(pattern.url_patterns, prefix + str(pattern.pattern))
            elif isinstance(pattern, URLResolver | URLPattern):
                route = str(pattern.pattern).lstrip("^").rstrip("$")
                route = re.sub(r"\(\?P<(\w+)>[^)]*\)", r"{\1}", route)  # a regex's group
                found.add("/" + prefix + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route))  # a path's
        return found

    # The docs name any object's id {id}: /v1/models/{id}, /v1/files/{id}, /v1/batches/{id}.
    routes = walk(get_resolver().url_patterns, "")
    return {re.sub(r"\{\w+_id\}", "{id}", route) for route in routes}


def _endpoint_tables(text: str) -> set[str]:
    """The paths named in the first cell of a table's rows."""
    paths: set[str] = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            paths.update(re.findall(r"`(?:[A-Z]+ )?(/[^`?\s,]*)", line.split("|")[1]))
    return paths


def test_every_route_is_in_the_readme_and_the_api_reference() -> None:
    routes = _routes()
    assert {"/sample", "/v1/models/{id}", "/admin/", "/v1/usage"} <= routes
    assert routes - _endpoint_tables((ROOT / "README.md").read_text()) == set()
    api_page = (ROOT / "docs" / "guides" / "api.md").read_text()
    assert routes - _endpoint_tables(api_page) == set()


def test_every_route_the_readme_and_the_api_reference_list_exists() -> None:
    """The other way: a path in their endpoint tables that the service does not route."""
    routes = _routes()
    for document in (ROOT / "README.md", ROOT / "docs" / "guides" / "api.md"):
        listed = _endpoint_tables(document.read_text())
        assert len(listed) > 10, document  # the tables are read
        assert listed - routes == set(), document
