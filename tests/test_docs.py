"""The documentation stays findable and true to the repository: a short README
whose set-up commands are the scripts that exist, links that resolve (files and
headings), and no pointer to files outside the repository."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 320

# Spelled in pieces so that this file does not match itself.
OUTSIDE_POINTERS = ("shared" + "/DESIGN.md", "../" + "shared", "/work/" + "shared")

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text without code blocks and code spans, where brackets are not links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    headings = re.findall(r"^#{1,6} (.+)$", _FENCE.sub("", path.read_text()), re.M)
    return {slug(h) for h in headings}


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Every relative link in `path` that names no file, or no heading of its file."""
    problems = []
    for target in _LINK.findall(prose(path.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        rel = os.path.relpath(dest, root)
        if not dest.exists():
            problems.append(f"{path.relative_to(root)}: {target} (no such file)")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{path.relative_to(root)}: {target} (no such heading in {rel})")
    return problems


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


def test_the_checker_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](missing.md) [bad](#nowhere) `[code](x.md)`\n")
    assert broken_links(page, tmp_path) == [
        "page.md: missing.md (no such file)",
        "page.md: #nowhere (no such heading in page.md)",
    ]


def repository_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return [ROOT / os.fsdecode(name) for name in listed if name and (ROOT / os.fsdecode(name)).is_file()]


def test_nothing_points_outside_the_repository() -> None:
    found = []
    for path in repository_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # binary files hold no pointers
        found += [f"{path.relative_to(ROOT)}: {p}" for p in OUTSIDE_POINTERS if p in text]
    assert found == []


def setup_commands() -> list[str]:
    """The commands of the README's "Two commands" section (its first code block)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Two commands\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```sh\n(.*?)^```", section, re.S | re.M)
    assert block is not None, "the Two commands section has no sh block"
    lines = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line]


def test_the_two_commands_are_the_scripts() -> None:
    assert setup_commands() == ["scripts/run", "scripts/test"]
    for command in setup_commands():
        script = ROOT / command
        assert script.is_file() and os.access(script, os.X_OK), f"{command} is not an executable script"
    run = (ROOT / "scripts" / "run").read_text()
    test = (ROOT / "scripts" / "test").read_text()
    # scripts/run is the main job on the embedded default; scripts/test is the suite.
    assert "scripts/setup" in run and "thinblock quickstart" in run and "thinblock serve var/default-pool" in run
    assert "scripts/setup" in test and "pytest" in test and "tests.ceph_cluster start" in test
    assert "scripts/test" in (ROOT / ".ci" / "run").read_text()  # the README says CI runs exactly it
