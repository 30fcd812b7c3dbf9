"""Cyclic collection paused around bulk object creation (`format.manifest`): off inside, the
collector's previous state back after, an exception included."""

from __future__ import annotations

import gc

import pytest

from shardwise.checkpoint.format.manifest import gc_paused


@pytest.fixture
def gc_state():
    """Whatever a test does to the collector, it is enabled again after."""
    yield
    gc.enable()


def test_paused_inside_and_enabled_after(gc_state):
    gc.enable()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_enabled_again_after_an_exception(gc_state):
    gc.enable()
    with pytest.raises(KeyError, match="boom"):
        with gc_paused():
            raise KeyError("boom")
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off(gc_state):
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_nested_pauses_restore_the_outer_state(gc_state):
    gc.enable()
    with gc_paused():
        with gc_paused():
            pass
        assert not gc.isenabled()  # the inner one found it off: leaves it off
    assert gc.isenabled()
