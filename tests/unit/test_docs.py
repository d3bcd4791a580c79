"""The README and the documentation site agree with the tree: the README stays short, its
links lead to files that exist, and every page under docs/ is in the site's navigation (a
page left out of mkdocs.yml's nav is unreachable; `make docs` checks the links between
pages)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

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
