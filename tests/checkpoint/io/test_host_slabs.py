"""`io.device`: the staging budget is checked up front, against what this host has."""

from __future__ import annotations

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise.checkpoint.io.device import host_memory, staging_bytes
from shardwise.errors import InvalidArgumentError


def test_a_budget_beyond_the_hosts_memory_is_refused_naming_both():
    memory = host_memory()
    assert memory is not None and memory > 1 << 20  # Linux says
    assert staging_bytes(memory) == memory
    with pytest.raises(InvalidArgumentError, match=rf"staging_bytes={2**62} .*\({memory} bytes\)"):
        staging_bytes(2**62)


def test_the_environment_budget_is_checked_alike(monkeypatch):
    monkeypatch.setenv("SHARDWISE_STAGING_BYTES", str(2**62))
    with pytest.raises(InvalidArgumentError, match="more than this host's memory"):
        staging_bytes(None)


@pytest.mark.parametrize("call", ["save", "async_save"])
def test_a_save_with_a_huge_budget_fails_before_writing(tmp_path, call):
    state = {"t": torch.ones(4)}
    with pytest.raises(InvalidArgumentError, match="more than this host's memory"):
        result = getattr(swc, call)(state, tmp_path / "ck", staging_bytes=2**62)
        if call == "async_save":
            result.result(60)
    assert not (tmp_path / "ck").exists()
