"""Random byte flips, truncations and deletions: every case detected, nothing wrong loads."""

from __future__ import annotations

import random

import pytest

from . import chaos

pytestmark = pytest.mark.spawned


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("corrupt") / "ref"
    chaos.save_reference(path)
    return path


@pytest.mark.parametrize("kind", chaos.CORRUPTIONS)
def test_damage_is_always_detected(reference, tmp_path, kind):
    rng = random.Random(kind)
    for _ in range(8):
        outcome = chaos.corrupt_and_load(reference, tmp_path / "scratch", rng, kind)
        assert outcome.ok, outcome
        assert not outcome.load.startswith("loaded WRONG"), outcome
