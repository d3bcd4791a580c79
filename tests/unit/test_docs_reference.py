"""The reference pages agree with the code both ways: the metrics' label values and outcomes,
the management commands and their arguments, the make targets, the exit codes, the HTTP
headers and the OpenAPI document (docs/reference/)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from batching.outcomes import RequestOutcome
from tests.support.python_source import parse as parse_source

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"
# The packages whose management commands are ours (the rest are Django's and third parties').
OUR_APPS = {p.name for p in ROOT.iterdir() if (p / "management" / "commands").is_dir()}


def _rows(text: str) -> list[list[str]]:
    """The table rows of a page (or of a part of one), as their cells; header rules left out."""
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("|") and not re.fullmatch(r"[|\s:-]+", line)
    ]


def _code(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _section(text: str, heading: str) -> str:
    """The text under a heading, up to the next heading of its level or above."""
    level = heading.split(" ", 1)[0]
    start = text.index(heading + "\n") + len(heading)
    end = re.search(rf"^#{{1,{len(level)}}} ", text[start:], flags=re.M)
    return text[start : start + end.start()] if end else text[start:]


# --- metrics ------------------------------------------------------------------------------


def _literal_loop(path: Path, variable: str) -> set[str]:
    """The constants of a `for VARIABLE in ("a", "b")` loop or comprehension of a module."""
    for node in ast.walk(parse_source(path.read_text())):
        if (
            isinstance(node, ast.comprehension | ast.For)
            and isinstance(node.target, ast.Name)
            and node.target.id == variable
            and isinstance(node.iter, ast.Tuple)
        ):
            return {str(e.value) for e in node.iter.elts if isinstance(e, ast.Constant)}
    raise AssertionError(f"no loop over {variable} in {path}")


def _job_steps() -> set[str]:
    """The steps the feeder counts its failures by: the names its `_alone` and
    `count_failure` calls give."""
    steps = set()
    for path in (ROOT / "offline").rglob("*.py"):
        for node in ast.walk(parse_source(path.read_text())):
            if isinstance(node, ast.Call):
                function = ast.unparse(node.func)
                index = {"_alone": 1, "count_failure": 0}.get(function)
                if index is not None and len(node.args) > index:
                    argument = node.args[index]
                    if isinstance(argument, ast.Constant):
                        steps.add(str(argument.value))
    return steps


def _label_values_in_code() -> dict[tuple[str, str], set[str]]:
    from serving.shedding import ShedReason
    from workers.pipeline import Stage

    outcomes = {outcome.value for outcome in RequestOutcome}
    return {
        ("sampling_requests_total", "outcome"): outcomes,
        ("sampling_tier_requests_total", "outcome"): outcomes,
        ("sampling_shed_requests_total", "reason"): {reason.value for reason in ShedReason},
        ("sampling_cache_lookups_total", "result"): _literal_loop(
            ROOT / "serving" / "metrics.py", "result"
        ),
        ("sampling_call_places_total", "filled"): _literal_loop(
            ROOT / "workers" / "metrics.py", "filled"
        ),
        ("sampling_batch_failures_total", "stage"): {stage.value for stage in Stage},
        ("sampling_batch_job_failures_total", "step"): _job_steps(),
    }


# Labels whose values are names (of workers, models, tiers) or HTTP's (django-prometheus).
NAMED_LABELS = {"worker", "queue", "tier", "method", "status", "view"}


def test_the_metrics_reference_lists_each_labels_values_as_the_code() -> None:
    page = (REFERENCE / "metrics.md").read_text()
    documented = {
        (_code(row[0])[0], _code(row[1])[0]): set(_code(row[2]))
        for row in _rows(_section(page, "## Label values"))[1:]
    }
    code = _label_values_in_code()
    assert "moved on" in code["sampling_batch_job_failures_total", "step"]  # the scans work
    assert documented == code
    # Every label of the metrics table is named, or has its values in the table above.
    labels = {
        (_code(row[0])[0], label)
        for row in _rows(page.split("## Outcomes", 1)[0])[1:]
        for label in _code(row[2])
    }
    assert len(labels) > 20  # the metrics table is read
    assert {pair for pair in labels if pair[1] not in NAMED_LABELS} == set(code)


def test_the_metrics_reference_lists_every_outcome() -> None:
    page = (REFERENCE / "metrics.md").read_text()
    rows = _rows(_section(page, "## Outcomes"))[1:]
    documented = set()
    for row in rows:
        label = re.fullmatch(r'outcome="(\w+)"', _code(row[0])[0])
        assert label is not None, row
        documented.add(label.group(1))
    assert documented == {outcome.value for outcome in RequestOutcome}


# --- commands, make targets, exit codes ---------------------------------------------------

COMMANDS_PAGE = REFERENCE / "commands.md"


def _our_commands() -> dict[str, str]:
    from django.core.management import get_commands

    return {name: app for name, app in get_commands().items() if app in OUR_APPS}


def _arguments(app: str, name: str) -> set[str]:
    """A command's own arguments: its positional ones by name, its options by their long
    form; the options every Django command takes (--verbosity, --settings ...) left out."""
    from django.core.management import load_command_class
    from django.core.management.base import BaseCommand

    def of(command: BaseCommand) -> set[str]:
        parser = command.create_parser("manage.py", name)
        found = set()
        for action in parser._actions:
            longs = [o for o in action.option_strings if o.startswith("--")]
            found.add(longs[0] if longs else action.dest)
        return found

    return of(load_command_class(app, name)) - of(BaseCommand())


def test_the_commands_reference_lists_every_command_and_its_arguments() -> None:
    page = COMMANDS_PAGE.read_text()
    part = _section(page, "## Management commands")
    commands = _our_commands()
    assert {"createapikey", "runfeeder", "capacity"} <= set(commands)  # ours are found
    assert set(re.findall(r"^### `(\w+)`$", part, flags=re.M)) == set(commands)
    wrong = {}
    for name, app in commands.items():
        documented = {_code(row[0])[0] for row in _rows(_section(part, f"### `{name}`"))[1:]}
        if documented != _arguments(app, name):
            wrong[name] = (documented, _arguments(app, name))
    assert wrong == {}


def _make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))


def test_the_commands_reference_lists_every_make_target() -> None:
    rows = _rows(_section(COMMANDS_PAGE.read_text(), "## Make targets"))[1:]
    documented = {re.sub(r"^make ", "", _code(row[0])[0]) for row in rows}
    assert "run" in documented
    assert documented == _make_targets()


def _exit_statuses() -> dict[str, int]:
    """The workers' named exit statuses (EXIT_... = 78)."""
    found = {}
    for path in (ROOT / "workers").rglob("*.py"):
        for node in ast.walk(parse_source(path.read_text())):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id.startswith("EXIT_")
                and isinstance(node.value, ast.Constant)
                and type(node.value.value) is int
            ):
                found[node.targets[0].id] = node.value.value
    return found


def test_the_commands_reference_lists_every_exit_status_of_a_worker() -> None:
    rows = _rows(_section(COMMANDS_PAGE.read_text(), "## Exit statuses"))[1:]
    statuses = {cell for row in rows for cell in row[1:2]}
    named = _exit_statuses()
    assert {"EXIT_DUPLICATE_NAME", "EXIT_HUNG_CALL"} <= set(named)  # the scan sees them
    assert {str(status) for status in named.values()} - statuses == set()
    # Both ways: a worker's status on the page is one the code names, or 0 and 1 (Python's).
    workers = {row[1] for row in rows if row[0].startswith("a worker")}
    assert workers - {str(status) for status in named.values()} - {"0", "1"} == set()


# --- HTTP headers -------------------------------------------------------------------------

HEADER = re.compile(r"Allow|(?:[A-Z][A-Za-z]*|x)(?:-[A-Za-z]+)+")


def _headers_in_code() -> set[str]:
    """The headers the service reads (request.META's HTTP_...) and sets (a response's or a
    headers dict's key that looks like a header: Retry-After, x-cache)."""
    found = set()
    packages = [p for p in ROOT.iterdir() if (p / "__init__.py").is_file()]
    for package in packages:
        if package.name in ("bench", "tests"):
            continue
        for path in package.rglob("*.py"):
            for node in ast.walk(parse_source(path.read_text())):
                keys: list[ast.expr | None] = []
                if isinstance(node, ast.Subscript):
                    keys.append(node.slice)
                elif isinstance(node, ast.Dict):
                    keys += node.keys
                for key in keys:
                    if isinstance(key, ast.Constant) and HEADER.fullmatch(str(key.value)):
                        found.add(str(key.value).lower())
                meta = str(node.value) if isinstance(node, ast.Constant) else ""
                if re.fullmatch(r"HTTP_[A-Z_]+", meta):  # request.META's name of a header
                    found.add(meta.removeprefix("HTTP_").replace("_", "-").lower())
    return found


def test_the_http_reference_lists_every_header_the_code_reads_or_sets() -> None:
    rows = _rows((REFERENCE / "http.md").read_text())
    documented = {name.lower() for row in rows for name in _code(row[0])}
    found = _headers_in_code()
    assert {"authorization", "x-request-start", "retry-after", "x-cache"} <= found
    assert found - documented == set()
    assert documented - found - FRAMEWORK_HEADERS == set()


# Headers the page documents that Django sets (its security middleware), not our code.
FRAMEWORK_HEADERS = {
    "content-type", "cross-origin-opener-policy", "referrer-policy", "strict-transport-security",
    "x-content-type-options", "x-frame-options",
}  # fmt: skip


# --- the OpenAPI document -----------------------------------------------------------------

OPENAPI_FILE = REFERENCE / "openapi.json"


def openapi_text() -> str:
    """The document GET /v1/openapi.json serves, indented as docs/reference/openapi.json
    keeps it (python -m json.tool --indent 2 writes the same)."""
    from serving.openapi import openapi_document

    return json.dumps(openapi_document(), indent=2) + "\n"


def test_the_rendered_openapi_document_is_the_one_the_code_builds() -> None:
    """Regenerate it as docs/reference/openapi.md says when this fails."""
    assert OPENAPI_FILE.read_text() == openapi_text()
    page = (REFERENCE / "openapi.md").read_text()
    assert '--8<-- "docs/reference/openapi.json"' in page
