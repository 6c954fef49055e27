"""Docs stay navigable: every relative link in README.md and docs/*.md points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    broken = [target for target in LINK.findall(page.read_text())
              if "://" not in target and not target.startswith("mailto:")
              and not (page.parent / target).exists()]
    assert broken == [], f"{page.relative_to(ROOT)} links to missing files: {broken}"


def test_readme_fits_one_screen_and_names_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert "make demo" in text and "make test" in text
    assert len(text.splitlines()) <= 60
