"""The documentation reads as the product's, in plain sentences: no sentence of the README or
the site runs past 60 words, the median sentence stays under 25, no page speaks of how the
project was built (loans of a device, sessions, withdrawn runs), and the benchmarks stay a
minority of the site."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_WORDS = 60
MEDIAN_BELOW = 25
# Benchmark pages: at most this share of the site's lines.
BENCHMARK_SHARE = 0.25
BENCHMARK_PAGES = ("docs/benchmarks/", "docs/gpu-report.md")
# Words of the development process, not of the product.
PROCESS_WORDS = re.compile(
    r"\bloan(?:ed|s)?\b|\blent\b|\b(?:this|that|an earlier|a later|the last|our) session\b"
    r"|\bsessions? of work\b|\bcarried wheels\b|\bwheels (?:we|were) carried\b|\bwithdrawn runs?\b"
    r"|\bas before\b|\bcame to be\b|\bnoisier session\b|\bthey were up to\b|\bwas (?:then|later)\b"
    r"|\bwithdrawn\b(?! from)|\bborrow(?:ed|ing)?\b|\bdevice time\b|\bwork session\b",
    re.I,
)
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\[*(`\"])")
LIST_ITEM = re.compile(r"^(?:[-*+]|\d+\.)\s+")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def included() -> list[Path]:
    """The files the site's pages include whole (docs/changelog.md: CHANGELOG.md): the same
    sentence limit holds there; their history is theirs to tell."""
    return [ROOT / "CHANGELOG.md"]


def _paragraphs(text: str) -> tuple[list[str], list[str]]:
    """The page's prose as paragraphs and list items, and its table cells apart; code blocks,
    headings, HTML comments and snippet lines left out."""
    paragraphs: list[str] = []
    cells: list[str] = []
    current: list[str] = []
    fenced = False

    def close() -> None:
        if current:
            paragraphs.append(" ".join(current))
            current.clear()

    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            fenced = not fenced
            close()
        elif fenced or (line.startswith("    ") and not current):
            continue
        elif stripped.startswith("|"):
            close()
            cells += [c.strip() for c in stripped.strip("|").split("|")
                      if not re.fullmatch(r"[\s:-]*", c)]  # fmt: skip
        elif not stripped or stripped.startswith(("#", "<!--", "--8<--", "!!!", "???")):
            close()
        elif LIST_ITEM.match(stripped):
            close()
            current.append(LIST_ITEM.sub("", stripped))
        else:
            current.append(stripped)
    close()
    return paragraphs, cells


def _sentences(paragraph: str) -> list[str]:
    # An inline code span or a link's address is one word however it is written.
    plain = re.sub(r"`[^`]*`", "CODE", paragraph)
    plain = re.sub(r"\]\([^)]*\)", "]", plain)
    return [s for s in SENTENCE_END.split(plain) if s.split()]


def sentences(text: str) -> tuple[list[str], list[str]]:
    """The sentences of the page's prose, and those of its table cells."""
    paragraphs, cells = _paragraphs(text)
    return (
        [s for p in paragraphs for s in _sentences(p)],
        [s for c in cells for s in _sentences(c)],
    )


def _words(sentence: str) -> int:
    return len(sentence.split())


def test_no_sentence_runs_past_the_limit() -> None:
    long = {}
    for document in documents() + included():
        prose, cells = sentences(document.read_text())
        over = [s[:80] for s in prose + cells if _words(s) > MAX_WORDS]
        if over:
            long[str(document.relative_to(ROOT))] = over
    assert long == {}


def test_the_median_sentence_is_short() -> None:
    words = [_words(s) for d in documents() for s in sentences(d.read_text())[0]]
    assert len(words) > 500  # the scan reads the pages' prose
    assert statistics.median(words) < MEDIAN_BELOW


def test_the_scan_splits_sentences_and_skips_code() -> None:
    page = "A first one. A second (with `x.y`) one.\n\n```\nNot. Prose.\n```\n| A cell. | B |\n"
    assert sentences(page) == (["A first one.", "A second (with CODE) one."], ["A cell.", "B"])


def test_no_page_speaks_of_the_development_process() -> None:
    found = {}
    for document in documents():
        hits = [m.group(0) for m in PROCESS_WORDS.finditer(document.read_text())]
        if hits:
            found[str(document.relative_to(ROOT))] = hits
    assert found == {}


def test_the_benchmarks_are_a_minority_of_the_site() -> None:
    lines = {str(d.relative_to(ROOT)): len(d.read_text().splitlines()) for d in documents()}
    site = {name: n for name, n in lines.items() if name.startswith("docs/")}
    benchmarks = sum(n for name, n in site.items() if name.startswith(BENCHMARK_PAGES))
    assert benchmarks <= BENCHMARK_SHARE * sum(site.values())
