"""The front door holds: the README is short, its Python example runs, and
every relative link in the README and docs/ resolves inside the repository."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_readme_is_read_in_five_minutes():
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


def test_the_readme_python_example_runs(monkeypatch):
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1 and "replay(" in blocks[0]
    monkeypatch.chdir(REPO)  # its log path is the checkout's
    exec(compile(blocks[0], "README.md", "exec"), {})


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves_inside_the_repository(page):
    bad = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL, or an anchor on the same page
        path = (page.parent / target.split("#", 1)[0]).resolve()
        try:
            path.relative_to(REPO)
        except ValueError:
            bad.append(f"{target} leaves the repository")
            continue
        if not path.exists():
            bad.append(f"{target} does not exist")
    assert not bad, bad


def test_no_file_links_outside_the_repository():
    """The design notes once lived in ../shared/design/ARCHITECTURE.md."""
    hits = [str(p.relative_to(REPO)) for p in REPO.rglob("*")
            if p.is_file() and p.suffix in (".py", ".md", ".toml", ".mmd") and ".git" not in p.parts
            and "shared/design" in p.read_text(errors="replace")
            and p.name != "test_readme.py"]
    assert hits == []
