"""Every code block of the README and the site says what it is (run, its output, the stack's
command, or an illustration), so none is left out of the examples that CI runs
(tests/integration/test_doc_examples.py)."""

from __future__ import annotations

from tests.support.doc_examples import (
    KINDS,
    RUNNABLE_LANGUAGES,
    Block,
    documents,
    indented_code,
    matches,
)
from tests.support.doc_examples import blocks as blocks_of


def _all_blocks() -> list[Block]:
    return [block for document in documents() for block in blocks_of(document)]


def test_every_code_block_is_fenced_with_a_language_and_marked() -> None:
    found = _all_blocks()
    assert len(found) > 50  # the scan reads the pages' blocks
    wrong = [f"{b.page}:{b.line} {b.mark!r} {b.language!r}" for b in found
             if b.mark not in KINDS or not b.language]  # fmt: skip
    assert wrong == []
    indented = {str(d): lines for d in documents() if (lines := indented_code(d))}
    assert indented == {}


def test_runnable_blocks_are_bash_or_python_and_outputs_follow_them() -> None:
    found = _all_blocks()
    runs = [b for b in found if b.mark == "run"]
    assert len({b.page for b in runs}) >= 8  # examples on many pages run, the tutorial's too
    assert {b.language for b in runs} <= set(RUNNABLE_LANGUAGES)
    orphans = [f"{b.page}:{b.line}" for i, b in enumerate(found) if b.mark == "output"
               and (i == 0 or found[i - 1].mark != "run")]  # fmt: skip
    assert orphans == []
    stacks = [b.code.strip() for b in found if b.mark == "stack"]
    assert stacks
    assert all(code.endswith("make run") for code in stacks)


def test_an_output_matches_with_its_ellipses_standing_for_any_text() -> None:
    assert matches("MC squared\n", "MC squared  \n\n")
    assert matches('{"id": "...", "n": 1}', '{"id": "cmpl-9f", "n": 1}')
    assert not matches('{"id": "...", "n": 1}', '{"id": "cmpl-9f", "n": 2}')
    assert not matches("MC squared", "MC squared\nand more")
