"""The README is the front door (issue 19, item 13): at most 300 lines, the two commands, its pictures
committed under docs/images/, and every link it makes leads to a file of this repository; docs/ links
the same way (no reference outside the repository)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)\s]+)\)")
MAX_LINES = 300


def _local_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(page.read_text(encoding="utf-8")) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_the_readme_is_a_front_door() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_LINES, f"README.md has {len(text.splitlines())} lines (at most {MAX_LINES})"
    assert "make demo" in text and "make test" in text
    pictures = re.findall(r"!\[[^\]]+\]\(([^)]+)\)", text)
    assert len(pictures) >= 2 and all(p.startswith("docs/images/") for p in pictures), pictures
    for picture in pictures:
        data = (ROOT / picture).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000, picture  # a real image, not a stub


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_every_link_leads_into_the_repository(page: Path) -> None:
    missing = []
    for target in _local_links(page):
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists() or ROOT not in path.parents:
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to {missing}"
