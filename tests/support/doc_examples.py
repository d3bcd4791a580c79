"""The code blocks of the README and the documentation site, as their marks say: each fenced
block follows one HTML comment that says what it is.

    <!-- example: run -->           run against `make run` with the simulated sampler
    <!-- example: output -->        what the run block above prints (`...`: any text)
    <!-- example: stack -->         the `make run` line that starts that stack
    <!-- example: illustration -->  shown, not run (a file's shape, a GPU's or a cluster's command)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARK = re.compile(r"<!-- example: (\w+) -->")
KINDS = ("run", "output", "stack", "illustration")
# What a runnable block may be written in: each runs through bash (python with its stdin).
RUNNABLE_LANGUAGES = ("bash", "python")
PAGE_ADDRESS = re.compile(r"(?:localhost|127\.0\.0\.1):8000")


@dataclass
class Block:
    page: str  # relative to the repository's root
    line: int  # the fence's, from 1
    language: str
    mark: str | None  # None: no mark above the fence
    code: str
    output: str | None = None  # the output block's text that follows a run block


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


def blocks(path: Path) -> list[Block]:
    """The page's fenced blocks in order (a list item's, indented, too), each with the mark on
    the last non-blank line above it; an output block is also attached to the run block
    before it. A fence never closed is an error: the rest of the page would render as code."""
    found: list[Block] = []
    lines = path.read_text().splitlines()
    page = str(path.relative_to(ROOT))
    previous, index = "", 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if fence is None:
            if lines[index].strip():
                previous = lines[index].strip()
            index += 1
            continue
        indent, marker = fence.group(1), fence.group(2)
        closing = re.compile(rf"\s*{re.escape(marker[0])}{{{len(marker)},}}\s*")
        end = next((i for i in range(index + 1, len(lines)) if closing.fullmatch(lines[i])), None)
        if end is None:
            raise ValueError(f"{page}:{index + 1}: a fence that is never closed")
        code = "\n".join(line.removeprefix(indent) for line in lines[index + 1 : end]) + "\n"
        mark = MARK.fullmatch(previous)
        block = Block(page, index + 1, fence.group(3), mark.group(1) if mark else None, code)
        if block.mark == "output" and found and found[-1].mark == "run":
            found[-1].output = block.code
        found.append(block)
        previous, index = "", end + 1
    return found


def indented_code(path: Path) -> list[int]:
    """Lines that open an indented code block: four spaces after a blank line, outside fences
    and lists (a list item's continuation is indented too)."""
    opened: list[int] = []
    fenced, blank, in_list = False, True, False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if re.match(r"^(`{3,}|~{3,})", line.lstrip()):
            fenced = not fenced
        elif not fenced:
            if re.match(r"^\s*(?:[-*+]|\d+\.)\s", line):
                in_list = True
            elif line.strip() and not line.startswith(" "):
                in_list = False
            if line.startswith("    ") and line.strip() and blank and not in_list:
                opened.append(number)
        blank = not line.strip()
    return opened


def matches(shown: str, printed: str) -> bool:
    """The printed text is the shown one, where each `...` of the shown one stands for any
    text; lines compared without their trailing spaces, blank lines at either end ignored."""

    def tidy(text: str) -> str:
        return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).strip("\n")

    pattern = ".*?".join(re.escape(part) for part in tidy(shown).split("..."))
    return re.fullmatch(pattern, tidy(printed), flags=re.S) is not None


def script(block: Block, address: str) -> str:
    """The block as a bash script, the page's address 8000 replaced with the stack's."""
    code = PAGE_ADDRESS.sub(address, block.code)
    if block.language == "python":
        # A quoted here-document: the code reaches Python as written.
        return f".venv/bin/python - <<'PYTHON_EXAMPLE'\n{code}PYTHON_EXAMPLE\n"
    return code
