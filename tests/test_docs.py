"""The README and the docs site hold together, without building Sphinx (`make docs`
builds it, warnings as errors): the README stays short, every page is in a toctree,
every relative link finds its file (and heading), and every public name has a place
in the API reference."""

from __future__ import annotations

import pathlib
import re

import pytest

import shardwise
import shardwise.checkpoint
import shardwise.errors
import shardwise.legacy

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"

PAGES = sorted(
    p for p in DOCS.rglob("*") if p.suffix in (".md", ".rst") and "_build" not in p.parts
)
MARKDOWN = [README, *(p for p in PAGES if p.suffix == ".md")]


def _toctree_entries(page: pathlib.Path) -> list[pathlib.Path]:
    """The pages a page's toctrees name, as files."""
    text = page.read_text()
    if page.suffix == ".md":
        blocks = re.findall(r"^```\{toctree\}\n(.*?)^```", text, re.S | re.M)
    else:
        blocks = re.findall(r"^\.\. toctree::\n((?:[ \t]+.*\n|\n)*)", text, re.M)
    names = [
        line.strip()
        for block in blocks
        for line in block.splitlines()
        if line.strip() and not line.strip().startswith(":")
    ]
    found = []
    for name in names:
        base = page.parent / name
        matches = [base.with_name(base.name + s) for s in (".md", ".rst")]
        found += [m for m in matches if m.exists()] or [base]
    return found


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= 260


def test_every_page_is_in_a_toctree():
    seen, todo = set(), [DOCS / "index.md"]
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        for entry in _toctree_entries(page):
            assert entry.exists(), f"{page.relative_to(ROOT)}: toctree names {entry}"
            todo.append(entry)
    assert [p.relative_to(ROOT) for p in PAGES if p not in seen] == []


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and MyST (`myst_heading_anchors`) make it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    # levels 1-3 only: the site makes anchors that deep (`myst_heading_anchors = 3`)
    return {_slug(h) for h in re.findall(r"^#{1,3} (.+)$", text, re.M)}


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_finds_its_file(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # not in code
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert broken == []


def test_the_install_page_includes_the_readme_example():
    """docs/install.md takes the README's first python block (`literalinclude`):
    it must be the example that tests/test_readme.py runs."""
    text = README.read_text()
    assert text.index("```python") == text.index("## Example\n\n```python") + len("## Example\n\n")
    assert ":start-after: ```python" in (DOCS / "install.md").read_text()


def _documented() -> set[str]:
    """`module.name` of every object the API pages name with a directive."""
    names = set()
    for page in (DOCS / "api").glob("*.rst"):
        module = None
        for line in page.read_text().splitlines():
            m = re.match(r"\.\. (?:py:)?(?:currentmodule|module)::\s*(\S+)", line)
            if m:
                module = m.group(1)
                continue
            m = re.match(r"\.\. (?:auto|py:)(?:class|function|exception|data)::\s*(\S+)", line)
            if m:
                name = m.group(1)
                names.add(name if name.startswith("shardwise.") else f"{module}.{name}")
    return names


@pytest.mark.parametrize(
    "module", [shardwise, shardwise.checkpoint, shardwise.legacy], ids=lambda m: m.__name__
)
def test_every_public_name_is_in_the_api_reference(module):
    errors = set(shardwise.errors.__all__)  # all on one page: automodule shardwise.errors
    documented = _documented()
    missing = [
        name
        for name in module.__all__
        if name != "__version__"
        and name not in errors
        and f"{module.__name__}.{name}" not in documented
    ]
    assert missing == []


def test_readme_resume_loop_is_the_examples_own_code():
    """The README's train/kill/resume excerpt is lines of examples/train_resume.py (which
    tests/examples runs), in its order: the README cannot drift from the tested script."""
    section = re.search(r"## Train, get killed, resume\n(.*?)\n## ", README.read_text(), re.S)
    assert section is not None
    code = re.search(r"```python\n(.*?)```", section.group(1), re.S).group(1)
    script = [line.strip() for line in (ROOT / "examples" / "train_resume.py").open()]
    at = 0
    for line in (x.strip() for x in code.splitlines()):
        if line in ("", "..."):
            continue
        assert line in script[at:], f"not in examples/train_resume.py (in order): {line}"
        at = script.index(line, at) + 1
    commands = re.findall(r"^torchrun .*?(?=  #|$)", section.group(1), re.M)
    assert len(commands) == 2
    listed = (ROOT / "examples" / "README.md").read_text()
    assert all(c.strip() in listed for c in commands)
