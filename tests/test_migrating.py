"""docs/migrating.md runs as written: each `<!-- snippet: name -->` block is run as a
script (checkpoint paths moved to a temp dir), on spawned gloo ranks, and must print
exactly the lines the page promises under it; the block of docs/legacy.md too.

A snippet whose client package is missing is skipped (failed in CI) through the
clients' `require`.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from tests.clients.conftest import require
from tests.snippets import run_snippet

pytestmark = pytest.mark.spawned

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "migrating.md").read_text()
# The legacy API in brief (moved from the README), with its one runnable block.
LEGACY_PAGE = (ROOT / "docs" / "legacy.md").read_text()

SNIPPET = re.compile(
    r"<!-- snippet: (\w+) -->\n```python\n(.*?)```\n\nprints\n\n```\n(.*?)```", re.S
)
SNIPPETS = {m.group(1): (m.group(2), m.group(3).splitlines()) for m in SNIPPET.finditer(PAGE)}

# What each snippet must print (the page's "prints" block must say the same).
EXPECTED = {
    "legacy": (
        None,
        [
            "0 True [[3, 4], [2, 4]] True (5, 2)",
            "1 True [[3, 4], [2, 4]] True (5, 2)",
            "[1.0, 1.0, 1.0, 2.0, 2.0] None True",
        ],
    ),
    "physicsnemo": (
        "physicsnemo.domain_parallel",
        [
            "0 (0,) (5, 6) 861.0 ShardTensor (0,)",
            "1 (5,) (2, 6) 861.0 ShardTensor (5,)",
            "True",
        ],
    ),
    "megatron": (
        "megatron.core.tensor_parallel",
        [
            "{'fc1.bias': (6,), 'fc1.weight': (6, 12), 'fc2.bias': (12,), 'fc2.weight': (12, 6)}",
            "[(2, 12), (2, 12), (2, 12)] True True",
        ],
    ),
    "megatron_resume": (
        "megatron.core.tensor_parallel",
        ["(100, 100, 100) True"],
    ),
    "torchrec": (
        "torchrec.distributed",
        ["0 [] True", "1 [] True", "2 [(40, 8)] True"],
    ),
}


run = run_snippet


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_snippet_prints_what_the_page_says(name, tmp_path):
    module, expected = EXPECTED[name]
    if module is not None:
        require(module)
    code, promised = SNIPPETS[name]
    assert promised == expected, f"the page's 'prints' block of {name!r} is out of date"
    assert run(code, tmp_path) == expected


def test_legacy_page_block_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", LEGACY_PAGE, re.S)
    assert run(blocks[0], tmp_path) == [
        "[('ShardedTensor', True, (3, 4)), ('ShardedTensor', True, (2, 4))]"
    ]
    assert "prints `[('ShardedTensor', True, (3, 4)), ('ShardedTensor', True, (2, 4))]`" in (
        LEGACY_PAGE.replace("\n", " ")
    )


def test_every_snippet_is_tested():
    markers = re.findall(r"<!-- snippet: (\w+) -->", PAGE)
    assert markers == ["legacy", "physicsnemo", "megatron", "megatron_resume", "torchrec"]
    assert sorted(SNIPPETS) == sorted(markers) == sorted(EXPECTED)  # each with its prints block
    assert PAGE.count("```python") == len(markers)  # no python block without a marker
    assert LEGACY_PAGE.count("```python") == 1
    headings = re.findall(r"^## (.+)$", PAGE, re.M)
    assert len(headings) == 4 and [h.split(" ")[0] for h in headings] == [
        "Legacy",
        "PhysicsNeMo",
        "Megatron-Core",
        "TorchRec",
    ]
