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


def _agreement_run(world_size: int, fn):
    from .threaded_world import ThreadedWorld

    return ThreadedWorld(world_size).run(fn)


def test_agreement_raises_a_deferred_problem_on_every_rank_at_the_next_exchange():
    from shardwise.comm.agreement import Agreement

    def one(comm):
        agreement = Agreement(comm, ("the path", "/ckpt"))
        if comm.rank == 2:
            agreement.defer(ValueError("rank-two trouble"))
        agreement.defer(None)  # a later None never clears a kept problem
        return agreement.exchange(comm.rank)

    results = _agreement_run(4, one)
    assert [type(r) for r in results] == [ValueError] * 4
    assert {str(r) for r in results} == {"rank 2: rank-two trouble"}


def test_agreement_compares_arguments_once_and_counts_exchanges():
    from shardwise.comm.agreement import Agreement

    def one(comm):
        agreement = Agreement(comm, ("save path", "/a" if comm.rank != 1 else "/b"))
        try:
            agreement.exchange(None)
        except shardwise.ArgumentMismatchError as e:
            return str(e), agreement.exchanges
        return None

    results = _agreement_run(3, one)
    assert [n for _, n in results] == [1, 1, 1]
    assert results[0][0] == results[2][0]
    assert "ranks disagree on save path: ranks [1] passed '/b', rank 0 passed '/a'" in results[0][0]

    def agreed(comm):
        agreement = Agreement(comm, ("flags", (True, 3)))
        got = [agreement.exchange(comm.rank * 10), agreement.exchange("x")]
        return got, agreement.exchanges

    for got, count in _agreement_run(3, agreed):
        assert got == [[0, 10, 20], ["x", "x", "x"]] and count == 2
