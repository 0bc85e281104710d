"""The README is a first screen (under 250 lines) and every relative link of README.md and docs/ leads to a
file that exists (and, with a ``#fragment`` into a markdown file, to one of its headings)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "benchmarks").glob("*.md"))]
MAX_README_LINES = 250

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def links(text: str) -> list[str]:
    """The targets of the markdown links outside code blocks and code spans."""
    text = _FENCE.sub("", text)
    text = _CODE.sub("", text)
    return _LINK.findall(text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = re.sub(r"[`*_]", "", heading.strip().lower())
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


def test_readme_is_a_first_screen():
    n = len(README.read_text().splitlines())
    assert n < MAX_README_LINES, f"README.md has {n} lines, over {MAX_README_LINES - 1}: move material into docs/"


def test_readme_keeps_its_quick_start_commands():
    text = README.read_text()
    assert '```bash\npip install -e ".[dev]" && llamaspec generate "def fibonacci(n):" --temp 0\n```' in text
    assert "```bash\npytest\n```" in text  # .ci/run runs exactly this


def test_link_helpers():
    assert links("see [a](docs/a.md) and `[b](x.md)`\n```\n[c](y.md)\n```\n[d](https://x.org)") == [
        "docs/a.md", "https://x.org"]
    assert slug("## llamaspec's defaults (issue 12)".lstrip("# ")) == "llamaspecs-defaults-issue-12"
    assert slug("`llamaspec generate`") == "llamaspec-generate"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files(page: Path):
    bad = []
    for target in links(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#") and not target[1:]:
            continue  # http(s):, mailto: ...
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{target}: no heading #{fragment}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)
