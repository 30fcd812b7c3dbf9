"""`require_same`: the one "ranks disagree on their arguments" check."""

from __future__ import annotations

import pytest

import shardwise
from shardwise.comm.agreement import require_same


def test_same_values_pass_even_when_unhashable():
    require_same([[1, {"a": 2}], [1, {"a": 2}], [1, {"a": 2}]], "x")


def test_names_the_odd_ranks_and_the_majority_value():
    with pytest.raises(shardwise.ArgumentMismatchError) as info:
        require_same(["/a", "/b", "/a", "/b", "/b"], "path")
    assert str(info.value) == (
        "ranks disagree on path: ranks [0, 2] passed '/a', rank 1 passed '/b'; "
        "every rank must pass the same"
    )
    assert isinstance(info.value, ValueError)  # `except ValueError` callers keep working


def test_shown_verb_and_fix_shape_the_message():
    with pytest.raises(shardwise.ArgumentMismatchError) as info:
        require_same(
            [("k",), ("k",), ("k", "j")],
            "their Stateful values",
            shown=str,
            verb="hold",
            fix="every rank must pass the same Stateful keys",
        )
    assert str(info.value) == (
        "ranks disagree on their Stateful values: ranks [2] hold ('k', 'j'), rank 0 hold "
        "('k',); every rank must pass the same Stateful keys"
    )
