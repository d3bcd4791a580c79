"""The README and the documentation site agree with the tree: the README stays short, its
links lead to files that exist, and every page under docs/ is in the site's navigation (a
page left out of mkdocs.yml's nav is unreachable; `make docs` checks the links between
pages)."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from batching.problems import Problem

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
SERVICE_PACKAGES = [
    "inference_site",
    "devstack",
    "serving",
    "workers",
    "batching",
    "accounts",
    "telemetry",
    "operations",
    "planning",
]
CONFIGURATION_PAGE = ROOT / "docs" / "reference" / "configuration.md"


def _settings_read() -> dict[str, str]:
    """Every environment variable the service's code reads, with a file that reads it: the
    first argument of config.env's readers (and of the settings' policy readers),
    of os.environ.get and os.getenv, and os.environ[...]."""
    found: dict[str, str] = {}
    files = [path for package in SERVICE_PACKAGES for path in (ROOT / package).rglob("*.py")]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
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


ERRORS_PAGE = ROOT / "docs" / "reference" / "errors.md"


def _error_names_in_code() -> set[str]:
    """Every error type and code the API can answer: the table of problems, and the constants
    the request checks pass as a code or an error type (`code=`, a `code` parameter's default,
    openai_error's type and code, an `..._error` type literal)."""
    names: set[str] = set()
    for problem in Problem:
        names.update((problem.openai_type, problem.openai_code, problem.inference_error))
    for package in ("serving", "operations", "inference_site"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names.update(_error_names_of(node))
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
    elif isinstance(node, ast.Constant) and re.fullmatch(r"[a-z]+_error", str(node.value)):
        values.append(node)
    return {v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)}


def test_every_error_code_and_status_is_in_the_errors_reference() -> None:
    page = ERRORS_PAGE.read_text()
    documented = set(re.findall(r"`([A-Za-z_]+)`", page))
    names = _error_names_in_code()
    assert {"invalid_json", "unknown_url", "not_found_error"} <= names  # the scan sees them
    assert names - documented == set()
    statuses = set(re.findall(r"^\| (\d{3}) \|", page, flags=re.M))
    assert {str(problem.status) for problem in Problem} - statuses == set()


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
    for app in ("operations", "planning", "offline", "inference_site"):
        if (ROOT / app / "management" / "commands" / f"{command}.py").exists():
            return f"{app}.management.commands.{command}"
    return f"django.core.management.commands.{command}"


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
