"""Every example the README and the site mark runnable, run as written against `make run` with
the simulated sampler: a page's blocks in order, through bash from the repository's root, as a
second terminal would (the stack's database, no Redis settings), with the page's port 8000
replaced by the stack's. Variables a block exports reach the page's next blocks. A block that
shows its output must print it (`...` stands for any text)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support.doc_examples import ROOT, Block, blocks, documents, matches, script
from tests.support.make_run import MakeRun, make_run

pytestmark = pytest.mark.integration

BLOCK_TIMEOUT_S = 120


def _tutorial_order() -> list[str]:
    """The tutorial's pages in the navigation's order: one story, each page using what the
    pages before it made (a key, an exported variable)."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    tutorial = next(entry["Tutorial"] for entry in nav if isinstance(entry, dict)
                    and "Tutorial" in entry)  # fmt: skip
    return [f"docs/{page}" for entry in tutorial for page in entry.values()]


def _pages() -> dict[str, list[Block]]:
    """Each page's runnable blocks; the tutorial's pages as one, in order."""
    found: dict[str, list[Block]] = {}
    tutorial = _tutorial_order()
    for document in documents():
        page = str(document.relative_to(ROOT))
        runs = [block for block in blocks(document) if block.mark == "run"]
        if runs and page not in tutorial:
            found[page] = runs
    found["docs/tutorial/"] = [block for page in tutorial for block in blocks(ROOT / page)
                               if block.mark == "run"]  # fmt: skip
    return found


PAGES = _pages()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MakeRun]:
    with make_run(tmp_path_factory.mktemp("examples")) as running:
        yield running


def _run(block: Block, running: MakeRun, state: Path) -> subprocess.CompletedProcess[str]:
    # `set -a` exports what a block assigns; the state file carries it to the next block. An
    # HTTP error fails curl, so a block that shows no output still checks its answers.
    prelude = f'set -ea\nsource {state}\ncurl() {{ command curl --fail-with-body "$@"; }}\n'
    code = f"{prelude}{script(block, running.address)}\nexport -p > {state}\n"
    return subprocess.run(
        ["bash", "-c", code], cwd=ROOT, env=running.env, capture_output=True, text=True,
        timeout=BLOCK_TIMEOUT_S, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("page", sorted(PAGES))
def test_the_pages_examples_run_and_print_what_they_show(
    page: str, stack: MakeRun, tmp_path: Path
) -> None:
    state = tmp_path / "state.sh"
    state.write_text("")
    for block in PAGES[page]:
        done = _run(block, stack, state)
        where = f"{block.page}:{block.line}"
        assert done.returncode == 0, f"{where} exited {done.returncode}: {done.stderr[-3000:]}"
        if block.output is not None:
            assert matches(block.output, done.stdout), f"{where} printed:\n{done.stdout}"


def test_the_tutorial_and_the_readme_run_examples() -> None:
    assert "README.md" in PAGES
    pages = {block.page for block in PAGES["docs/tutorial/"]}
    assert {
        "docs/tutorial/keys.md",
        "docs/tutorial/streaming.md",
        "docs/tutorial/batch.md",
    } <= pages
