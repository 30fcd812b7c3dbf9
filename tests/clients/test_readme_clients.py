"""The Megatron-Core / PhysicsNeMo / TorchRec snippets of docs/clients.md (moved there
from the README) run as written (checkpoint paths moved to a temp dir) and print what
the page says."""

from __future__ import annotations

import pathlib
import re

import pytest

from tests.clients.conftest import require
from tests.snippets import run_snippet

pytestmark = pytest.mark.spawned

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "clients.md"
SECTION = re.search(
    r"^# With Megatron-Core, PhysicsNeMo and TorchRec\n(.*)", PAGE.read_text(), re.S | re.M
).group(1)


def snippet(heading: str) -> str:
    part = re.search(rf"^## {heading}\n(.*?)(?:\n## |\Z)", SECTION, re.S | re.M).group(1)
    return re.search(r"```python\n(.*?)```", part, re.S).group(1)


run = run_snippet


def test_megatron_snippet(tmp_path):
    require("megatron.core.dist_checkpointing")
    assert run(snippet("Megatron-Core"), tmp_path) == ["[[True], [], [True]] {'iteration': 100}"]


def test_physicsnemo_snippet(tmp_path):
    require("physicsnemo.domain_parallel")
    assert run(snippet("PhysicsNeMo"), tmp_path) == ["[True, True, True] True"]


def test_torchrec_snippet(tmp_path):
    require("torchrec.distributed")
    assert run(snippet("TorchRec"), tmp_path) == [
        "0 [([0, 0], True)]",
        "1 [([14, 0], True)]",
        "2 [([28, 0], True)]",
    ]


def test_every_snippet_is_tested():
    assert re.findall(r"^## (.+)$", SECTION, re.M) == ["Megatron-Core", "PhysicsNeMo", "TorchRec"]
    assert SECTION.count("```python") == 3
